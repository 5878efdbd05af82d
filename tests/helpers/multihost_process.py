"""Run a multi-process engine as real subprocesses on loopback: process 0 (`python -m serving.run`,
the leader, serving HTTP) and followers (`--headless`), each with its own simulated CPU devices.

    with multihost_engine(["-tp", "4", "-dp", "2"], devices_per_process=4) as mh:
        httpx.get(mh.url + "/health"); mh.followers[0].send_signal(signal.SIGKILL)

Start-up fails with RuntimeError showing every process's log tail. Every process still running at
the end is killed. The children inherit the environment (the compilation cache under
`$GLM53_HOME`, the suite's XLA flags) with the device count replaced.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from sharding.distributed import loopback_engine_flags
from tests.helpers.server_process import REPO, server_process


def child_env(devices_per_process: int, extra: dict | None = None) -> dict:
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    return {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices_per_process}".strip(),
            **(extra or {})}


@dataclass
class MultiHost:
    url: str
    leader: subprocess.Popen
    leader_log: callable
    followers: list[subprocess.Popen] = field(default_factory=list)
    follower_logs: list[str] = field(default_factory=list)

    def logs(self) -> str:
        out = [f"--- leader ---\n{self.leader_log()[-3000:]}"]
        for i, path in enumerate(self.follower_logs):
            with open(path, errors="replace") as f:
                out.append(f"--- follower {i + 1} ---\n{f.read()[-3000:]}")
        return "\n".join(out)

    def follower_log(self, i: int = 0) -> str:
        with open(self.follower_logs[i], errors="replace") as f:
            return f.read()

    def wait_all(self, timeout_s: float) -> list[int | None]:
        """Wait up to `timeout_s` for every process to exit → exit codes (leader first; None:
        still running)."""
        deadline = time.monotonic() + timeout_s
        procs = [self.leader, *self.followers]
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        return [p.poll() for p in procs]


@contextlib.contextmanager
def multihost_engine(flags: list[str], devices_per_process: int = 4, num_processes: int = 2,
                     leader_env: dict | None = None, startup_timeout_s: float = 600.0,
                     follower_flags: list[str] = ()) -> Iterator[MultiHost]:
    """Start `num_processes` processes of one engine with `flags` (the same on every process;
    followers also get `follower_flags`) and wait until the leader answers /health; yield them."""
    common = [*loopback_engine_flags(num_processes), "--distributed-timeout", str(int(startup_timeout_s)), *flags]
    env = child_env(devices_per_process)
    followers, logs = [], []
    try:
        for pid in range(1, num_processes):
            fd, path = tempfile.mkstemp(prefix=f"glm53-follower{pid}-", suffix=".log")
            os.close(fd)
            logs.append(path)
            with open(path, "wb") as log:
                followers.append(subprocess.Popen(
                    [sys.executable, "-m", "serving.run", "--headless", "--process-id", str(pid), *common,
                     *follower_flags],
                    cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            cm = server_process(["--process-id", "0", *common], env={**env, **(leader_env or {})},
                                startup_timeout_s=startup_timeout_s)
            srv = cm.__enter__()
        except RuntimeError as e:
            deadline = time.monotonic() + 20  # a follower the leader told to stop exits at once
            while time.monotonic() < deadline and any(p.poll() is None for p in followers):
                time.sleep(0.1)
            tails = []
            for i, path in enumerate(logs):
                with open(path, errors="replace") as f:
                    code = followers[i].poll()
                    state = "still running" if code is None else f"exited with {code}"
                    tails.append(f"--- follower {i + 1} ({state}) ---\n{f.read()[-3000:]}")
            raise RuntimeError(f"{e}\n" + "\n".join(tails)) from None
        try:
            yield MultiHost(srv.url, srv.proc, srv.log, followers, logs)
        finally:
            cm.__exit__(None, None, None)
    finally:
        for p in followers:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        for path in logs:
            os.unlink(path)
