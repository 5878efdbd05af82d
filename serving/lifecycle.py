"""The server process's lifecycle: graceful shutdown on SIGTERM / Ctrl-C, and exit when the engine dies.

* First SIGTERM or SIGINT: the server **drains** — every new HTTP request (and `/health`) gets a
  503 with an OpenAI error body (Anthropic's on `/v1/messages`; `GET /v1/responses/{id}…`, which
  reads a stored response, is still served), running requests go on for at most `--shutdown-timeout` seconds,
  then the process exits 0. Requests still running at the deadline are aborted: each response
  ends properly (finish_reason "abort"; a stream's last chunk and `[DONE]`), and the process
  exits once they are written (at most 2 s more).
* A second signal exits at once (status 1).
* The engine dies (`serving.faults.EngineDeadError`: its device state was lost): `/health`
  answers 503, the failed requests get their 500s, and the process exits 1 so that a
  supervisor restarts it (vLLM's behaviour on `EngineDeadError`).

`DrainMiddleware` (ASGI) refuses requests while draining and counts those in flight;
`GracefulServer` is a `uvicorn.Server` whose signal handling drives it.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import uvicorn

from serving.api import anthropic

logger = logging.getLogger("serving.run")

UNCOUNTED_PATHS = ("/health", "/metrics")  # probes: never counted as work in flight


def _reads_a_stored_response(scope) -> bool:
    """`GET /v1/responses/{id}…`: reading a stored (e.g. background) response is not new work, and
    a draining server still finishes background responses, whose clients poll for them."""
    return scope.get("method") == "GET" and scope.get("path", "").startswith("/v1/responses/")


class DrainMiddleware:
    """ASGI middleware: 503 for every HTTP request once `draining` is set (`/metrics` excepted,
    so the final figures can still be scraped); counts the requests in flight (probes excepted)."""

    def __init__(self, app) -> None:  # noqa: ANN001
        self.app = app
        self.draining = False
        self.in_flight = 0
        self._lock = threading.Lock()

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        if self.draining and path != "/metrics" and not _reads_a_stored_response(scope):
            message = "the server is shutting down"
            error = (anthropic.error_body(503, message) if anthropic.is_anthropic_path(path) else
                     {"error": {"message": message, "type": "ServiceUnavailableError", "param": None, "code": 503}})
            body = json.dumps(error, separators=(",", ":")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        counted = path not in UNCOUNTED_PATHS
        if counted:
            with self._lock:
                self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                with self._lock:
                    self.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """`uvicorn.Server` with draining on the first signal and an exit status (`exit_code`).

    engine: the `AsyncEngine` (its `num_unfinished_requests`, `is_healthy` and `on_dead`).
    drain: the app's `DrainMiddleware`. shutdown_timeout: seconds running requests may take.
    """

    def __init__(self, config: uvicorn.Config, engine, drain: DrainMiddleware, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain = drain
        self.shutdown_timeout = float(shutdown_timeout)
        self.exit_code = 0
        engine.on_dead.append(self._engine_died)

    def handle_exit(self, sig, frame) -> None:  # noqa: ANN001 - uvicorn's signal callback
        if self.drain.draining or self.should_exit:
            logger.warning("second signal: exiting now")
            self.exit_code = 1
            self.should_exit = self.force_exit = True
            return
        self.drain.draining = True
        logger.info("signal %s: refusing new requests; waiting up to %.0f s (--shutdown-timeout) for %d running",
                    sig, self.shutdown_timeout, self.engine.num_unfinished_requests())
        threading.Thread(target=self._wait_then_exit, args=(self.shutdown_timeout,), name="drain",
                         daemon=True).start()

    def _idle(self) -> bool:
        return self.engine.num_unfinished_requests() == 0 and self.drain.in_flight == 0

    def _wait_then_exit(self, timeout: float, exit_code: int | None = None, linger: float = 0.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._idle() and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if not self._idle():
            abort_all = getattr(self.engine, "abort_all", None)
            n = abort_all() if abort_all is not None and exit_code is None else 0
            logger.warning("%d requests still running after %.0f s; %s", self.engine.num_unfinished_requests(),
                           timeout, f"aborted {n} (finish_reason abort)" if n else "exiting anyway")
            end = time.monotonic() + 2.0  # their last chunks go out before the connections close
            while n and self.drain.in_flight and time.monotonic() < end and not self.should_exit:
                time.sleep(0.02)
        else:
            logger.info("drained; exiting")
        time.sleep(linger)  # a dead engine: let probes see the 503 before the port closes
        if exit_code is not None:
            self.exit_code = exit_code
        self.should_exit = True

    def _engine_died(self, error: BaseException) -> None:
        logger.error("the engine died (%s: %s): /health answers 503; exiting with status 1 once the failed "
                     "requests are answered", type(error).__name__, error)
        threading.Thread(target=self._wait_then_exit, args=(5.0, 1, 2.0), name="engine-dead", daemon=True).start()
