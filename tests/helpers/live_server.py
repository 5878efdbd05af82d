"""Run an ASGI app under uvicorn on a free loopback port in a background thread.

    with live_server(app) as base_url:      # "http://127.0.0.1:PORT"
        httpx.get(base_url + "/health")

The listening socket is bound before the server starts (port 0, picked by the OS), so there is no
window in which another process can take the port. The server runs its own event loop in a daemon
thread; anything the app does at start-up (lifespan) runs there too.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn


@contextlib.contextmanager
def live_server(
    app: Any,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 30.0,
    shutdown_timeout_s: float = 10.0,
    **config_kwargs: Any,
) -> Iterator[str]:
    """Serve `app` on `host` at a free port for the duration of the `with` block.

    Yields the base URL (`http://host:port`). Extra keyword arguments go to `uvicorn.Config`
    (default `log_level="warning"`, `timeout_graceful_shutdown=2`). Raises RuntimeError when the
    server does not come up within `startup_timeout_s`.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    config_kwargs.setdefault("log_level", "warning")
    config_kwargs.setdefault("timeout_graceful_shutdown", 2)
    config = uvicorn.Config(app, host=host, port=port, **config_kwargs)
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as e:  # noqa: BLE001 - reported to the caller below
            errors.append(e)

    thread = threading.Thread(target=run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if errors or not thread.is_alive():
                raise RuntimeError(f"server failed to start: {errors[0] if errors else 'exited'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server did not start within {startup_timeout_s} s")
            time.sleep(0.01)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(shutdown_timeout_s)
        if thread.is_alive():
            server.force_exit = True
            thread.join(shutdown_timeout_s)
        sock.close()
