"""Run `python -m serving.run` as a real subprocess on a free loopback port.

    with server_process(["--max-model-len", "512"]) as srv:
        httpx.get(srv.url + "/health"); srv.proc.send_signal(signal.SIGTERM); srv.proc.wait(60)

The server's stdout and stderr go to a log file whose tail is shown when start-up fails. The
process inherits the environment (the compilation cache under `$GLM53_HOME` is shared with the
in-process tests), plus `env`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(argv: list[str], env: dict[str, str] | None = None,
                   startup_timeout_s: float = 600.0) -> Iterator[ServerProcess]:
    """Start the server with `argv` (plus `--port`), wait for `/health` 200, yield it; kill it at
    the end if it is still running. Raises RuntimeError (with the log's tail) when it exits or
    does not become healthy within `startup_timeout_s`."""
    port = _free_port()
    fd, log_path = tempfile.mkstemp(prefix="glm53-server-", suffix=".log")
    os.close(fd)
    # A server compiles its step buckets before it reports healthy, as in production (the suite's
    # SKIP_JAX_PRECOMPILE is for in-process engines), unless `env` asks otherwise.
    base = {k: v for k, v in os.environ.items() if k != "SKIP_JAX_PRECOMPILE"}
    # Structured outputs' step variants compile on first use, as in-process test engines compile
    # everything: a background compile would take a core from the test's requests for minutes.
    if "--structured-outputs-config" not in argv:
        argv = [*argv, "--structured-outputs-config", '{"precompile": false}']
    full_env = {**base, "PYTHONPATH": REPO, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serving.run", "--port", str(port), *argv], cwd=REPO,
                                env=full_env, stdout=log, stderr=subprocess.STDOUT)
    srv = ServerProcess(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during start-up:\n{srv.log()[-3000:]}")
            try:
                if httpx.get(srv.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {startup_timeout_s:.0f} s:\n{srv.log()[-3000:]}")
            time.sleep(0.25)
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        os.unlink(log_path)
