"""The Responses API's routes: `POST /v1/responses` (streamed or not, in the background or not),
`GET /v1/responses/{id}` (also `?stream=true&starting_after=N` for a background stream),
`POST /v1/responses/{id}/cancel`, `DELETE /v1/responses/{id}` and
`GET /v1/responses/{id}/input_items`, as OpenAI's API (and vLLM's, whose store is off unless an
environment variable turns it on) serves them.

A request is translated into a chat completion request (`serving/api/responses.py`) and served by
the chat route's path. With the server's store (`--responses-store-size`, on by default; the
store: `serving/api/response_store.py`) a response is kept unless the request says
`store: false`; `previous_response_id` continues a stored response's conversation (its context
and output, then the new input; the new request's `instructions` only). `background: true` (which
needs the store) answers at once with the response `queued` and runs it detached from the HTTP
request: the client polls it, follows its stream, or cancels it.

Errors: an unknown (never stored, evicted or deleted) response id is a 404 naming the parameter
(`previous_response_id` or `response_id`); `previous_response_id` of a response still running,
`background` with `store: false`, a stream of a response that was not created as a background
stream, or cancelling one that was not created in the background are 400s. A background response
whose chat request fails (e.g. a prompt longer than the context) ends `failed` with `error`
(`invalid_prompt` for what the request got wrong, `server_error` otherwise).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serving.api.errors import APIError
from serving.api.response_store import ResponseStore, StoredResponse, json_bytes
from serving.api.responses import (
    ResponsesRequest,
    ResponseStreamTranslator,
    input_items,
    response_envelope,
    to_chat_request,
    to_response,
)
from serving.api.streaming import named_sse_event, translated_answer
from serving.api.validation import parse_body

logger = logging.getLogger(__name__)

_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _stored_items(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The input items as OpenAI lists them: each with an `id` unique among them (a new one where
    the client gave none, a non-string or empty one, or one an earlier item has: `input_items`
    pages by id) and a message's string content as one text part (copies where anything
    changes; the translation reads either form the same)."""
    out, seen = [], set()
    for item in items:
        kind = item.get("type", "message")
        rid = item.get("id")
        if not isinstance(rid, str) or not rid or rid in seen:
            item = {**item, "id": f"{_ITEM_ID_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}"}
        seen.add(item["id"])
        if kind == "message" and isinstance(item.get("content"), str):
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item = {**item, "type": "message", "content": [{"type": part, "text": item["content"]}]}
        out.append(item)
    return out


def _detached(request: Request) -> Request:
    """The request as the chat path sees it for a background response: the same app and headers,
    but it never disconnects (the response outlives its HTTP request until it ends or is cancelled)."""
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    return Request(dict(request.scope), receive)


def _failed(entry: StoredResponse, code: str, message: str) -> None:
    """End a background response as failed (unless it has ended); its stream ends with a
    `response.failed` event carrying it."""
    if entry.finished:
        return
    entry.update({**entry.response, "status": "failed", "error": {"code": code, "message": message}})
    if entry.stream:
        seq = entry.events[-1][0] + 1 if entry.events else 0
        payload = {"type": "response.failed", "sequence_number": seq, "response": entry.response}
        entry.add_event(seq, named_sse_event("response.failed", payload))


async def _run_background(entry: StoredResponse, store: ResponseStore, run: Awaitable[Response]) -> None:
    """Serve a background response to its end: the chat path's stream (`run`), drained here; its
    events reach the entry through the translator's sink."""
    inner = None
    try:
        inner = await run
        if isinstance(inner, StreamingResponse):
            async for _ in inner.body_iterator:
                pass
        elif inner.status_code != 200:
            _failed(entry, "server_error", f"the request ended with status {inner.status_code}")
    except asyncio.CancelledError:
        if not entry.finished:  # cancelled by a shutting-down event loop, not by the cancel route
            entry.update({**entry.response, "status": "cancelled"})
        raise
    except APIError as e:
        _failed(entry, "invalid_prompt" if e.status_code < 500 else "server_error", e.message)
    except Exception as e:  # a background run reports its failure in the response
        logger.exception("Background response %s failed", entry.id)
        _failed(entry, "server_error", f"{type(e).__name__}: {e}")
    finally:
        if isinstance(inner, StreamingResponse):
            with anyio.CancelScope(shield=True):
                await inner.body_iterator.aclose()  # type: ignore[union-attr]
        _failed(entry, "server_error", "the response ended without a result")
        store.evict()


def _sink(entry: StoredResponse) -> Callable[[str, dict[str, Any], str], None]:
    """The translator's sink for a background response: progress and result into the entry, and
    the events too when it was created as a stream."""

    def sink(kind: str, payload: dict[str, Any], text: str) -> None:
        if entry.finished:  # cancelled: nothing more is recorded
            return
        if entry.stream:
            entry.add_event(payload["sequence_number"], text)
        if kind in ("response.created", "response.in_progress", "response.completed", "response.incomplete"):
            entry.update(payload["response"])
        elif kind == "error":
            _failed(entry, "server_error" if str(payload.get("code")).startswith("5") else "invalid_prompt",
                    payload.get("message", ""))

    return sink


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response {response_id!r} not found (never stored, evicted from the server's store, "
                         "or deleted).", param)


def add_responses_routes(
    v1: APIRouter,
    chat_response: Callable[..., Awaitable[Response]],
    prepare_chat: Callable[..., Awaitable[Any]],
    max_body_bytes: int,
) -> None:
    """Add the Responses API's routes (see the module docstring) to the `/v1` router (before it is
    included: its API-key check applies). `chat_response(request, chat_body, frames, ready)` serves a
    chat completion request (the chat route's work; a stream's events from `frames`; `ready` what
    `prepare_chat(request, chat_body)` returned, which raises the request's 400s: a background
    response is prepared before it is answered). The store is `request.app.state.responses_store`
    (None: stateless, `store` answered as false)."""

    def _store(request: Request) -> ResponseStore | None:
        return getattr(request.app.state, "responses_store", None)

    def _stored(request: Request, response_id: str) -> tuple[ResponseStore, StoredResponse]:
        store = _store(request)
        entry = store.get(response_id) if store is not None else None
        if entry is None:
            raise _not_found(response_id, "response_id")
        return store, entry

    @v1.post("/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API (see the module docstring)."""
        body = await parse_body(request, ResponsesRequest, max_body_bytes)
        store = _store(request)
        previous, context = None, []
        if body.previous_response_id is not None:
            if store is None:
                raise APIError(400, "This server keeps no responses (--responses-store-size 0): send the whole "
                                    "conversation as `input`.", "previous_response_id")
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            if not previous.finished:
                raise APIError(400, f"Response {body.previous_response_id!r} is still {previous.status}: continue "
                                    "it once it has finished.", "previous_response_id")
            context = previous.next_context()
        if body.background and (store is None or body.store is False):
            raise APIError(400, "A background response must be stored: "
                                + ("the server keeps no responses (--responses-store-size 0)." if store is None
                                   else "send `store: true` (the default) with `background: true`."),
                           "background" if store is None else "store")
        chat_body = to_chat_request(body, context, stream=True if body.background else None)
        keep = store is not None and body.store is not False
        if not keep:
            inner = await chat_response(request, chat_body, ResponseStreamTranslator(body) if body.stream else None)
            return translated_answer(inner, body.stream, lambda chat: to_response(chat, body))

        items = _stored_items(input_items(body))
        context = [*context, *items]
        context_bytes = (previous.context_bytes + previous.output_bytes if previous is not None else 0) + json_bytes(items)

        def entry_of(rid: str, response: dict[str, Any], **kw: Any) -> StoredResponse:
            entry = StoredResponse(rid, response, items, context, context_bytes, **kw)
            entry.update(response)
            return entry

        if body.background:
            ready = await prepare_chat(request, chat_body)  # its 400s before it is queued
            rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
            queued = {**response_envelope(body, rid, created, request.app.state.served_model_name, store=True),
                      "status": "queued", "incomplete_details": None, "output": [], "usage": None}
            entry = entry_of(rid, queued, background=True, stream=body.stream)
            if body.stream:  # the stream opens with the queued response (sequence number 0)
                event = {"type": "response.queued", "sequence_number": 0, "response": queued}
                entry.add_event(0, named_sse_event("response.queued", event))
            store.put(entry)
            translator = ResponseStreamTranslator(body, rid=rid, created=created, store=True, sink=_sink(entry),
                                                  first_seq=1 if body.stream else 0)
            entry.task = asyncio.ensure_future(
                _run_background(entry, store, chat_response(_detached(request), chat_body, translator, ready)))
            if body.stream:
                return StreamingResponse(entry.follow(), media_type="text/event-stream", headers=_SSE_HEADERS)
            return JSONResponse(queued)

        def keep_final(kind: str, payload: dict[str, Any], _: str) -> None:
            if kind in ("response.completed", "response.incomplete"):
                store.put(entry_of(payload["response"]["id"], payload["response"]))

        def whole(chat: dict[str, Any]) -> dict[str, Any]:
            response = to_response(chat, body, store=True)
            store.put(entry_of(response["id"], response))
            return response

        frames = ResponseStreamTranslator(body, store=True, sink=keep_final) if body.stream else None
        return translated_answer(await chat_response(request, chat_body, frames), body.stream, whole)

    @v1.get("/responses/{response_id}")
    async def get_response(request: Request, response_id: str, stream: bool = False,
                           starting_after: int = Query(-1, ge=-1)) -> Response:
        """The stored response; with `stream=true`, the events of a background stream after
        `starting_after` (then the rest as they come)."""
        _, entry = _stored(request, response_id)
        if stream:
            if not (entry.background and entry.stream):
                raise APIError(400, "Only a response created with background=true and stream=true can be streamed "
                                    "again.", "stream")
            return StreamingResponse(entry.follow(starting_after), media_type="text/event-stream",
                                     headers=_SSE_HEADERS)
        return JSONResponse(entry.response)

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        """Cancel a background response (its engine request is aborted); a finished one is answered
        as it is."""
        _, entry = _stored(request, response_id)
        if not entry.background:
            raise APIError(400, "Only a response created with background=true can be cancelled.", "response_id")
        await entry.cancel()
        return JSONResponse(entry.response)

    @v1.delete("/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        """Forget a stored response (a background one still running is cancelled first)."""
        store, entry = _stored(request, response_id)
        await entry.cancel()
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @v1.get("/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str, after: str | None = None,
                               limit: int = Query(20, ge=1, le=100), order: str = "desc") -> Response:
        """The input items of the response's own request (OpenAI's list object, cursor `after`)."""
        _, entry = _stored(request, response_id)
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: expected asc or desc, got {order!r}.", "order")
        items = entry.input_items if order == "asc" else entry.input_items[::-1]
        start = 0
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in response {response_id!r}.", "after")
            start = ids.index(after) + 1
        page = items[start:start + limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)})
