"""vLLM's profiling routes, served with `--profiler-config` (serving/profiling.py):

* `POST /start_profile` → 200 `{"status": "started", "profiler_dir": DIR}`: a jax.profiler trace
  starts between two engine steps.
* `POST /stop_profile` → 200 `{"status": "stopped", "trace_dir": RUN}`: it ends after the step
  running now; RUN is the run directory JAX wrote (`<profiler_dir>/plugins/profile/<date_time>`).

A start while a trace runs, or a stop while none does, is a 400 saying so. Outside `/v1`, so not
behind `--api-key` (as vLLM's); serve it only where the port is trusted.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from serving.api.errors import APIError
from serving.profiling import ProfilerError


def add_profiler_routes(app: FastAPI) -> None:
    """Add the two routes; they reach the engine (an `AsyncEngine` with a `profiler`) through
    `app.state.engine`."""

    async def profile(request: Request, action: str, status: str, key: str) -> JSONResponse:
        try:
            out = await getattr(request.app.state.engine, f"{action}_profile")()
        except ProfilerError as e:
            raise APIError(400, str(e)) from None
        return JSONResponse({"status": status, key: out})

    @app.post("/start_profile", include_in_schema=False)
    async def start_profile(request: Request) -> JSONResponse:
        return await profile(request, "start", "started", "profiler_dir")

    @app.post("/stop_profile", include_in_schema=False)
    async def stop_profile(request: Request) -> JSONResponse:
        return await profile(request, "stop", "stopped", "trace_dir")
