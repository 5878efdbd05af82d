"""The routes a router reads to find out about this server by itself (outside `/v1`, no API key).

* `GET /get_server_info`: `{"model_id", "model_path", "instance_id", "kv_block_size",
  "max_model_len"}` — the served model name (what a request's `model` is
  looked up under), the `--model` it was started with, an id unique to this server process, the
  tokens per KV event block (null with `--kv-events-config` off) and the context length requests
  are checked against.
* `GET /kv_event_sources`: where each data-parallel replica publishes its KV events, keyed by the
  rank as a string: `{"0": {"endpoint": "tcp://*:5557", "replay_endpoint", "topic", "hwm",
  "buffer_steps", "publisher": "zmq", "enable_kv_cache_events": true, "encoding": "msgpack",
  "schema_version": 1}, ...}`; `{}` when events are off.

vllm-router's `kv_aware` policy (0.1.17) asks both for every worker it was given without a static
`--kv-event-source`, in the regular mode and for the prefill servers of its P/D mode, and
subscribes to each rank (`*` meaning the host of the worker's URL); docs/kv_events.md "Discovery".
vLLM's own server answers `/kv_event_sources` with a list of entries carrying
`data_parallel_rank`, which this router version does not parse: the shape here is the router's.
"""

from __future__ import annotations

import os
import socket
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse


def add_discovery_routes(app: FastAPI, model_root: str | None) -> None:
    """Add `GET /get_server_info` and `GET /kv_event_sources` to `app` (whose `state` holds `engine`
    and `served_model_name`, as `build_app` sets). An engine without `kv_event_sources()` /
    `kv_block_size` (a test double) reports no events."""
    # one id per app: a router keeps one event source per instance id and refuses a second
    # registration of the same id, so two servers must never share one (host and pid alone could
    # repeat across containers)
    instance_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    @app.get("/get_server_info", include_in_schema=False)
    async def get_server_info(request: Request) -> JSONResponse:
        """This server's identity for a router's KV index (see the module docstring)."""
        engine = request.app.state.engine
        name = request.app.state.served_model_name
        return JSONResponse({
            "model_id": name, "model_path": model_root or name, "instance_id": instance_id,
            "kv_block_size": getattr(engine, "kv_block_size", None), "max_model_len": engine.max_model_len,
        })

    @app.get("/kv_event_sources", include_in_schema=False)
    async def kv_event_sources(request: Request) -> JSONResponse:
        """Each data-parallel replica's KV event sockets, keyed by rank (see the module docstring)."""
        sources = getattr(request.app.state.engine, "kv_event_sources", None)
        return JSONResponse(sources() if sources is not None else {})
