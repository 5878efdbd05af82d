"""Run a real `vllm-router` subprocess on a free loopback port.

    with vllm_router(["--policy", "round_robin", "--worker-urls", url]) as (router_url, log_path): ...

The router's stdout and stderr go to `log_path` (kept after the block, for tests that read its
debug lines). `ROUTER` is the executable (None when the `pd` / test extra is not installed).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx

ROUTER = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
if not os.path.exists(ROUTER):
    ROUTER = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def vllm_router(args: list[str], startup_timeout_s: float = 60.0) -> Iterator[tuple[str, str]]:
    """Start `vllm-router --host 127.0.0.1 --port P *args`, wait for `/health` 200, yield
    (url, log path); kill it at the end. Raises AssertionError when it exits or is not ready in time."""
    port = free_port()
    log_path = os.path.join(tempfile.gettempdir(), f"vllm-router-{port}.log")
    # its Prometheus exporter would bind 29000: two routers at once (xdist workers, or one a
    # developer runs) would collide, and the second exits at start-up
    metrics = [] if "--prometheus-port" in args else ["--prometheus-port", str(free_port())]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([ROUTER, "--host", "127.0.0.1", "--port", str(port), *metrics, *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, "OPENAI_API_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            assert proc.poll() is None, f"vllm-router exited with {proc.returncode}; see {log_path}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"vllm-router not ready after {startup_timeout_s} s"
            time.sleep(0.2)
        yield url, log_path
    finally:
        proc.kill()
        proc.wait(10)
