"""The plumbing between one HTTP request and its engine requests: a handle per engine request
that is always aborted unless it finished, the `n` choices of one HTTP request, racing the
client's disconnect, a streaming response that always closes its iterator, and the SSE
encoding of chunks."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from serving.api.errors import engine_error
from serving.api.protocol import (
    CompletionTokensDetails,
    PromptTokensDetails,
    UsageInfo,
)
from serving.api.validation import params_per_choice
from serving.output_processor import RequestTextState
from serving.types import EngineClient, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    """The client went away before its request finished (`race_disconnect`)."""


async def listen_for_disconnect(request: Request) -> None:
    """Return once the client has gone (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(request: Request, awaitable: Any) -> Any:
    """Await `awaitable`, raising `ClientDisconnected` (and cancelling it) if the client goes."""
    task = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(listen_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)


class RequestHandle:
    """An engine request: its output iterator and a guaranteed abort unless it finished."""

    def __init__(
        self, engine: EngineClient, prompt_ids: list[int], params: SamplingParams, rid: str
    ) -> None:
        self.engine = engine
        self.request_id = rid
        self.finished = False
        self.kv_transfer_params: dict | None = None  # P/D: the prefill engine's answer
        self._closed = False
        self._aborted = False
        self._iter: AsyncIterator[RequestOutput] = aiter(engine.generate(prompt_ids, params, rid))

    async def next(self) -> RequestOutput | None:
        """The next engine output, or None when the engine's stream has ended."""
        out = await anext(self._iter, None)
        if out is not None and out.finished:
            self.finished = True
            self.kv_transfer_params = out.kv_transfer_params
        return out

    async def abort(self, finished_reason: str = "abort") -> None:
        """Abort the engine request unless it finished or was aborted already; finished_reason
        "stop" when a stop string ended it. Call it before anything that closes or cancels the
        output iterator (closing the iterator aborts the request with reason "abort")."""
        if self.finished or self._aborted:
            return
        self._aborted = True
        with anyio.CancelScope(shield=True):
            try:
                await self.engine.abort(self.request_id, finished_reason)
            except Exception:  # noqa: BLE001 - cleanup must not mask the real outcome
                logger.exception("Aborting request %s failed", self.request_id)

    async def close(self, finished_reason: str = "abort") -> None:
        """Abort the request unless it finished (see `abort`), then close the engine iterator.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.abort(finished_reason)
            aclose = getattr(self._iter, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:  # noqa: BLE001 - cleanup must not mask the real outcome
                    logger.exception("Closing the output stream of %s failed", self.request_id)


class Choices:
    """The engine requests (choices) of one API request and their accumulated outputs: `n` per
    prompt, and a completions request may batch several prompts (`batch`).

    Choice `p · n + j` is prompt p's j-th sample (OpenAI's and vLLM's order); its request id is
    `rid` when there is one choice in all, else `f"{rid}-{index}"`. `prompt_of[i]` is choice i's
    prompt index. Raises the engine's rejection as an API error when the engine refuses one
    synchronously.

    Args:
      prompt_ids, params: the one prompt and its sampling parameters, or
      batch: `[(prompt_ids, params), ...]`, one entry per prompt (then `prompt_ids` and `params`
        are None).
      count_reasoning: a choice's generated token ids → its reasoning tokens; when given, `usage()`
        reports their sum as `completion_tokens_details.reasoning_tokens`.
    """

    def __init__(self, engine: EngineClient, tokenizer: Any, prompt_ids: list[int] | None,
                 params: SamplingParams | None, rid: str,
                 batch: list[tuple[list[int], SamplingParams]] | None = None,
                 count_reasoning: Callable[[list[int]], int] | None = None) -> None:
        self.request_id = rid
        self.count_reasoning = count_reasoning
        batch = batch if batch is not None else [(prompt_ids, params)]
        self.prompt_lens = [len(ids) for ids, _ in batch]
        self.prompt_len = self.prompt_lens[0]
        per_prompt = [params_per_choice(p) for _, p in batch]
        self.prompt_of = [pi for pi, ps in enumerate(per_prompt) for _ in ps]
        self.states = [RequestTextState(tokenizer, p, len(batch[pi][0]))
                       for pi, ps in enumerate(per_prompt) for p in ps]
        total = len(self.states)
        self.handles: list[RequestHandle] = []
        try:
            for pi, ps in enumerate(per_prompt):
                for p in ps:
                    i = len(self.handles)
                    self.handles.append(RequestHandle(engine, batch[pi][0], p, rid if total == 1 else f"{rid}-{i}"))
        except Exception as e:  # noqa: BLE001 - a synchronous rejection by the engine
            raise engine_error(e, rid) from None

    def __len__(self) -> int:
        return len(self.states)

    async def close(self) -> None:
        """Close every choice's engine stream (aborting unfinished ones)."""
        for h in self.handles:
            await h.close()

    def choice_usage(self, i: int) -> UsageInfo:
        """Choice i's usage so far: its prompt and the tokens it generated up to now (vLLM's
        `stream_options.continuous_usage_stats`, one per chunk)."""
        st = self.states[i]
        prompt = st.num_prompt_tokens if st.num_prompt_tokens is not None else self.prompt_lens[self.prompt_of[i]]
        return UsageInfo(prompt_tokens=prompt, completion_tokens=st.num_output_tokens,
                         total_tokens=prompt + st.num_output_tokens)

    def usage(self) -> UsageInfo:
        """Each prompt counted once (and its cached tokens, from its first choice), completion
        tokens summed over every choice."""
        prompt = cached = 0
        seen: set[int] = set()
        for pi, st in zip(self.prompt_of, self.states):
            if pi in seen:
                continue
            seen.add(pi)
            prompt += st.num_prompt_tokens if st.num_prompt_tokens is not None else self.prompt_lens[pi]
            cached += st.num_cached_tokens or 0
        first = self.states[0]
        if len(self.prompt_lens) == 1:
            cached = first.num_cached_tokens
        completion = sum(st.num_output_tokens for st in self.states)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
            completion_tokens_details=None if self.count_reasoning is None else CompletionTokensDetails(
                reasoning_tokens=sum(self.count_reasoning(st.token_ids) for st in self.states)),
        )


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client vanished
    while the iterator was suspended at a `yield` (so the iterator's cleanup runs at once)."""

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


def without_null_kv_params(d: dict[str, Any]) -> dict[str, Any]:
    """A response body without `kv_transfer_params` unless a prefill engine set it."""
    if d.get("kv_transfer_params") is None:
        d.pop("kv_transfer_params", None)
    return d


def sse_event(obj: BaseModel | dict[str, Any]) -> str:
    data = obj if isinstance(obj, dict) else obj.model_dump(mode="json")
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def named_sse_event(kind: str, payload: dict[str, Any]) -> str:
    """An SSE event with an `event:` line (Anthropic's and the Responses API's framing)."""
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def chunk_dict(chunk: BaseModel) -> dict[str, Any]:
    """A stream chunk's body: without a null `usage` or `kv_transfer_params`."""
    d = chunk.model_dump(mode="json")
    if d.get("usage") is None:
        d.pop("usage", None)
    return without_null_kv_params(d)


class StreamFrames(Protocol):
    """What a stream sends for its chunk dicts: `feed(chunk)` the events for one chunk (an error
    chunk is `{"error": {...}}`), `end()` those after the last."""

    def feed(self, chunk: dict[str, Any]) -> list[str]: ...

    def end(self) -> list[str]: ...


class SSEFrames:
    """OpenAI's framing (chat and completions): each chunk as `data: {json}`, then `data: [DONE]`."""

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        return [sse_event(chunk)]

    def end(self) -> list[str]:
        return ["data: [DONE]\n\n"]


def translated_answer(inner: Any, stream: bool, whole: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A chat completion answer (`inner`, the chat route's response, served with the translated
    route's `StreamFrames` when streamed) in another API's shape: not streamed,
    `whole(chat body dict)` as JSON; streamed (already framed), or not a 200 (e.g. the 499 of a
    client that left before the first output), `inner` as it is."""
    if stream or inner.status_code != 200 or isinstance(inner, StreamingResponse):
        return inner
    return JSONResponse(whole(json.loads(inner.body)))
