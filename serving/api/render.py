"""vLLM's render routes: `POST /v1/chat/completions/render` and `POST /v1/completions/render`
take the body of the route they are named after and answer the prompt's token ids as the engine
would get them — chat template, tokenizer, every check the request would pass — without running
the model.

vllm-router's prefix-aware policies (`cache_aware`, `kv_aware`) ask a worker's render route for a
request's token ids before routing it and fall back to `/tokenize` when it is missing (one more
round trip per request; measured with vllm-router 0.1.17, docs/kv_events.md). Its parser takes
an object or a list with `token_ids`.

Answers (vLLM's shape): chat, one object `{"request_id", "model", "token_ids", "sampling_params",
"stream"}`; completions, a list of such objects, one per prompt (a batched prompt's prompts in
order). `sampling_params` are the resolved sampling fields (vLLM names: `max_tokens` is the room
the request gets, defaults applied). Errors are the generating route's 400s, the engine's own
checks (vocabulary, lengths, a constraint's compile: `AsyncEngine.check_request`) included.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from serving.api.protocol import ChatCompletionRequest, CompletionRequest
from serving.api.validation import parse_body
from serving.types import SamplingParams

_NOT_SAMPLING = {"kv_transfer_params", "data_parallel_rank", "structured_outputs", "reasoning_tags"}  # not sampling


def sampling_params_json(params: SamplingParams) -> dict[str, Any]:
    """The sampling fields of `params` as JSON (vLLM's names; `logit_bias` keys as strings)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name not in _NOT_SAMPLING}
    if out.get("logit_bias") is not None:
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out


def add_render_routes(
    v1: APIRouter,
    prepare_chat: Callable[[Request, ChatCompletionRequest], Awaitable[Any]],
    prepare_completion: Callable[[Request, CompletionRequest], Awaitable[Any]],
    max_body_bytes: int,
) -> None:
    """Add the two render routes to the `/v1` router (before it is included: its API-key check
    applies). `prepare_chat` / `prepare_completion` are the generating routes' own preparation
    (`serving/api/server.py`: `PreparedChat`, `PreparedCompletion`)."""

    def rendered(request: Request, rid: str, token_ids: list[int], params: SamplingParams, stream: bool) -> dict:
        return {"request_id": rid, "model": request.app.state.served_model_name, "token_ids": list(token_ids),
                "sampling_params": sampling_params_json(params), "stream": bool(stream)}

    @v1.post("/chat/completions/render")
    async def render_chat(request: Request) -> JSONResponse:
        """A chat completion request's prompt token ids (see the module docstring)."""
        body = await parse_body(request, ChatCompletionRequest, max_body_bytes)
        ready = await prepare_chat(request, body)
        return JSONResponse(rendered(request, f"chatcmpl-{uuid.uuid4().hex}", ready.rendered.prompt_ids,
                                     ready.params, body.stream))

    @v1.post("/completions/render")
    async def render_completion(request: Request) -> JSONResponse:
        """A completions request's prompts' token ids, one entry per prompt (see the module docstring)."""
        body = await parse_body(request, CompletionRequest, max_body_bytes)
        ready = await prepare_completion(request, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return JSONResponse([rendered(request, f"{rid}-{i}", ids, params, body.stream)
                             for i, (ids, params) in enumerate(ready.batch)])
