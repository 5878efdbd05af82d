"""The OpenAI-compatible HTTP server: `build_app(engine, tokenizer, served_model_name)`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions`, `GET /v1/models`,
`GET /v1/models/{model}`, `GET /health`. `/metrics` and other routes are added by the caller
through `build_app(..., extra_routes=callback)`, which receives the app before it is returned
(for example `lambda app: app.mount("/metrics", prometheus_client.make_asgi_app())`).

The server uses three tokenizer methods, `encode(text)`, `decode(ids, skip_special_tokens=...)`
and `apply_chat_template(messages, tools=..., add_generation_prompt=True, **kwargs)`, and the
engine's `serving.types.EngineClient` protocol. A streaming response starts (status line and the
role chunk) only once the engine has produced its first output, so a rejection at submission is
still a plain HTTP error.

Errors use the OpenAI error body `{"error": {"message", "type", "param", "code"}}` with `code` the
HTTP status:

* 400 `BadRequestError`: malformed JSON, a body that fails validation (wrong types, missing
  fields; vLLM also answers 400 here, where FastAPI's default would be 422), values out of range
  (`max_tokens` < 1, `temperature` < 0, `top_p` outside (0, 1], `n` outside [1, 128], empty
  stop strings, `top_logprobs` without `logprobs`), features this build does not support yet
  (`echo`, penalties, `best_of`, ...), a prompt that does not fit `max_model_len` (alone or with
  `max_tokens`), chat-template errors, `tools` / `tool_choice` / `reasoning_effort` values the
  output parsing cannot honour (`serving.api.chat_output`), and any ValueError raised by the
  engine (e.g. more logprobs than `--max-logprobs`).
* 401 `AuthenticationError`: `/v1/*` without `Authorization: Bearer <api_key>` when a key is set.
* 404 `NotFoundError`: a `model` other than the served model name; unknown paths.
* 413 `RequestTooLargeError`: a body over `max_body_bytes` (refused before it is read whole).
* 500 `InternalServerError`: any other exception from the engine (logged; the server keeps
  serving). Once a stream has started, an error is sent as a `data: {"error": ...}` event followed
  by `data: [DONE]`.

A client that disconnects (streaming or not) gets its request aborted in the engine: the engine's
output iterator is closed and `engine.abort(request_id)` is awaited.

Sampling features: `n` choices are `n` engine requests (`{id}-{i}` when n > 1; with a `seed`,
choice i uses seed + i); their stream chunks interleave, each tagged with its `index`. `stop`
strings are matched on the detokenized text (`serving.output_processor`): the output ends before
the match, a stream never shows text past it, and the engine request is aborted at once.
`logprobs` (chat: `logprobs` + `top_logprobs`; completions: `logprobs: k`) come from the engine
(fp32 log-softmax of the raw logits) and are formatted by `serving.api.logprobs`. Usage counts
the prompt once and the completion tokens of all choices; `prompt_tokens_details.cached_tokens`
is the prefix-cache hit of choice 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.api.chat_output import ChatParsing, ChatRequestError
from serving.api.logprobs import chat_logprobs, completion_logprobs
from serving.api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    UsageInfo,
)
from serving.output_processor import RequestTextState, TextDelta
from serving.pd.params import KVTransferParamsError, parse_kv_transfer_params
from serving.types import EngineClient, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered to the client as an OpenAI error body with `status_code`."""

    def __init__(self, status_code: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param

    def to_response(self) -> ErrorResponse:
        """The OpenAI error body for this error."""
        return ErrorResponse(
            error=ErrorInfo(
                message=self.message,
                type=_ERROR_TYPES.get(self.status_code, "APIError"),
                param=self.param,
                code=self.status_code,
            )
        )


def _error_json(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code)


def _bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


class _ClientDisconnected(Exception):
    pass


_warned_extra_fields: set[str] = {"kv_transfer_params"}  # P/D: read from model_extra


# ------------------------------------------------------------------------------- request parsing


def default_max_body_bytes(max_model_len: int) -> int:
    """The largest request body the server reads: 256 bytes per token of context, at least
    16 MiB (a prompt of `max_model_len` tokens is far smaller, even as JSON `\\uXXXX` escapes or
    a token-id list; a client that sends more is refused before the body fills the memory)."""
    return max(16 << 20, 256 * max_model_len)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, or 413 as soon as it is known to exceed `max_bytes` (from its
    Content-Length, else while it streams in)."""
    too_large = APIError(413, f"The request body exceeds the limit of {max_bytes} bytes.")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise too_large
    parts, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


async def _parse_body(request: Request, model_cls: type[BaseModel], max_bytes: int) -> Any:
    """Read the JSON body (413 beyond `max_bytes`) and validate it into `model_cls`; 400 on any
    other failure."""
    raw = await _read_body(request, max_bytes)
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _bad_request(f"Invalid JSON body: {e}") from None
    except RecursionError:
        raise _bad_request("Invalid JSON body: nested too deeply.") from None
    if not isinstance(obj, dict):
        raise _bad_request("The request body must be a JSON object.")
    try:
        body = model_cls.model_validate(obj)
    except ValidationError as e:
        raise _validation_error(e) from None
    new_extra = set(body.model_extra or ()) - _warned_extra_fields
    if new_extra:
        _warned_extra_fields.update(new_extra)
        logger.warning("Ignoring unsupported request fields: %s", sorted(new_extra))
    return body


def _validation_error(e: ValidationError | RequestValidationError) -> APIError:
    errors = e.errors()
    parts = []
    for err in errors[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid value')}")
    first_loc = errors[0].get("loc", ()) if errors else ()
    param = next((str(x) for x in first_loc if x != "body"), None)
    return _bad_request("Invalid request: " + "; ".join(parts), param)


def _check_unicode(text: str, param: str) -> None:
    """400 naming `param` when `text` is not valid Unicode (a lone UTF-16 surrogate, which JSON
    `\\ud800` escapes can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _bad_request(f"The text is not valid Unicode: {e.reason} at index {e.start}.", param) from None


async def _encode(tokenizer: Any, text: str, param: str) -> list[int]:
    """Tokenise request text in a worker thread (a prompt of many megabytes takes seconds to
    tokenise, and the event loop must keep serving the other requests meanwhile); text that is not
    valid Unicode (a lone UTF-16 surrogate) is a 400."""
    _check_unicode(text, param)
    return list(await anyio.to_thread.run_sync(tokenizer.encode, text))


def _is_set(value: Any, default: Any) -> bool:
    return value is not None and value != default


MAX_N = 128  # most choices one request may ask for

# Arguments of `apply_chat_template` that `chat_template_kwargs` must not carry: the server's own,
# and `chat_template`, which would let a client render a template of its choosing.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "chat_template"})


def _reject_unsupported(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Refuse parameters whose non-default values this build cannot honour (never drop them),
    and check `n`, `stop`, `logprobs` and `stream_options`."""
    if body.n is not None and not 1 <= body.n <= MAX_N:
        raise _bad_request(f"n must be in [1, {MAX_N}], got {body.n}.", "n")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops):
        raise _bad_request("stop strings must be non-empty.", "stop")
    for s in stops:
        _check_unicode(s, "stop")
    if body.stream_options is not None and not body.stream:
        raise _bad_request("stream_options can only be set when stream=true.", "stream_options")
    checks: list[tuple[str, bool]] = [
        ("presence_penalty", _is_set(body.presence_penalty, 0.0)),
        ("frequency_penalty", _is_set(body.frequency_penalty, 0.0)),
        ("logit_bias", bool(body.logit_bias)),
        ("top_k", body.top_k not in (None, 0, -1)),
        ("min_p", _is_set(body.min_p, 0.0)),
        ("repetition_penalty", _is_set(body.repetition_penalty, 1.0)),
    ]
    if isinstance(body, ChatCompletionRequest):
        fmt = (body.response_format or {}).get("type", "text")
        if body.top_logprobs is not None:
            if body.top_logprobs < 0:
                raise _bad_request(f"top_logprobs must be >= 0, got {body.top_logprobs}.", "top_logprobs")
            if body.top_logprobs > 0 and not body.logprobs:
                raise _bad_request("top_logprobs requires logprobs=true.", "top_logprobs")
        checks += [("response_format", fmt != "text")]
    else:
        if body.logprobs is not None and body.logprobs < 0:
            raise _bad_request(f"logprobs must be >= 0, got {body.logprobs}.", "logprobs")
        checks += [
            ("echo", bool(body.echo)),
            ("best_of", body.best_of not in (None, 1)),
            ("suffix", bool(body.suffix)),
        ]
    for name, bad in checks:
        if bad:
            raise _bad_request(f"{name} is not supported yet in this build.", name)


def _resolve_max_tokens(
    requested: int | None, param: str, prompt_len: int, max_model_len: int, prompt_param: str
) -> int:
    """Check the prompt and completion lengths against `max_model_len`; 400 naming the lengths.

    Returns the number of tokens to generate: `requested`, or all the room left when None."""
    if requested is not None and requested < 1:
        raise _bad_request(f"{param} must be at least 1, got {requested}.", param)
    if prompt_len >= max_model_len:
        raise _bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {prompt_len} tokens, which leaves no room for a completion. Please "
            "reduce the length of the prompt.",
            prompt_param,
        )
    if requested is None:
        return max_model_len - prompt_len
    if prompt_len + requested > max_model_len:
        raise _bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} "
            f"in the completion). Please reduce the length of the prompt or of {param}.",
            param,
        )
    return requested


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int, max_logprobs: int | None = None
) -> SamplingParams:
    """The engine's `SamplingParams` of a request body (choice 0; see `_choice_params`).

    max_logprobs: the engine's `--max-logprobs` when it exposes one; more alternatives than that
    is a 400 naming the request's own field (`top_logprobs` for chat, `logprobs` for completions).
    """
    if body.temperature is not None and not 0 <= body.temperature < math.inf:  # NaN fails too
        raise _bad_request(f"temperature must be a finite number >= 0, got {body.temperature}.", "temperature")
    if body.top_p is not None and not 0.0 < body.top_p <= 1.0:
        raise _bad_request(f"top_p must be in (0, 1], got {body.top_p}.", "top_p")
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
    else:
        logprobs = body.logprobs
    if max_logprobs is not None and logprobs is not None and logprobs > max_logprobs:
        name = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise _bad_request(f"{name} must be at most {max_logprobs} (--max-logprobs), got {logprobs}.", name)
    kv_params = (body.model_extra or {}).get("kv_transfer_params")
    if kv_params is not None:
        try:
            parse_kv_transfer_params(kv_params)
        except KVTransferParamsError as e:
            raise _bad_request(str(e), e.param) from None
        if (body.n or 1) > 1:
            raise _bad_request("kv_transfer_params cannot be combined with n > 1.", "n")
    params = SamplingParams(
        kv_transfer_params=kv_params or None,
        temperature=1.0 if body.temperature is None else float(body.temperature),
        top_p=1.0 if body.top_p is None else float(body.top_p),
        seed=body.seed,
        max_tokens=max_tokens,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        n=body.n or 1,
        skip_special_tokens=body.skip_special_tokens,
    )
    try:
        params.validate()
    except ValueError as e:
        raise _bad_request(str(e)) from None
    return params


def _data_parallel_rank(request: Request) -> int | None:
    """vLLM's `X-data-parallel-rank` header (a router pinning the request to a data-parallel
    replica), or None. A value that is not an integer is a 400."""
    value = request.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise _bad_request(f"X-data-parallel-rank must be an integer, got {value!r}.", "X-data-parallel-rank") from None


def _choice_params(params: SamplingParams) -> list[SamplingParams]:
    """One engine request per choice: n = 1 each; with a seed, choice i samples with seed + i
    (so choices are independent samples, and reproducible)."""
    return [
        dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                            stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))
        for i in range(params.n)
    ]


def _flatten_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad_request(
                f"messages[{index}].content[{j}]: only text content parts "
                '({"type": "text", "text": ...}) are supported.',
                "messages",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _template_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template (content flattened to text; other keys such
    as `tool_calls`, `tool_call_id`, `reasoning_content` unchanged)."""
    out = []
    for i, msg in enumerate(body.messages):
        d: dict[str, Any] = dict(msg.model_extra or {})
        d["role"] = "system" if msg.role == "developer" else msg.role
        d["content"] = _flatten_content(msg.content, i)
        out.append(d)
    return out


# ------------------------------------------------------------------------------ engine plumbing


def _engine_error(e: BaseException, request_id: str) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, KVTransferParamsError):
        return _bad_request(str(e), e.param)
    if isinstance(e, ValueError):
        return _bad_request(str(e))
    logger.exception("Engine error for request %s", request_id, exc_info=e)
    return APIError(500, f"Internal server error: {type(e).__name__}: {e}")


async def _listen_for_disconnect(request: Request) -> None:
    """Return once the client has gone (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(request: Request, awaitable: Any) -> Any:
    """Await `awaitable`, raising `_ClientDisconnected` (and cancelling it) if the client goes."""
    task = asyncio.ensure_future(awaitable)
    listener = asyncio.ensure_future(_listen_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _ClientDisconnected()
    finally:
        for t in (task, listener):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, listener, return_exceptions=True)


class _RequestHandle:
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


class _Choices:
    """The `n` engine requests (choices) of one API request and their accumulated outputs.

    Choice i has request id `rid` when n == 1, else `f"{rid}-{i}"`."""

    def __init__(self, engine: EngineClient, tokenizer: Any, prompt_ids: list[int],
                 params: SamplingParams, rid: str) -> None:
        self.request_id = rid
        self.prompt_len = len(prompt_ids)
        per_choice = _choice_params(params)
        self.states = [RequestTextState(tokenizer, p, len(prompt_ids)) for p in per_choice]
        self.handles: list[_RequestHandle] = []
        try:
            for i, p in enumerate(per_choice):
                self.handles.append(
                    _RequestHandle(engine, prompt_ids, p, rid if len(per_choice) == 1 else f"{rid}-{i}"))
        except Exception as e:  # noqa: BLE001 - a synchronous rejection by the engine
            raise _engine_error(e, rid) from None

    def __len__(self) -> int:
        return len(self.states)

    async def close(self) -> None:
        """Close every choice's engine stream (aborting unfinished ones)."""
        for h in self.handles:
            await h.close()

    def usage(self) -> UsageInfo:
        """Prompt counted once, completion tokens summed over choices, cached tokens of choice 0."""
        first = self.states[0]
        prompt = first.num_prompt_tokens if first.num_prompt_tokens is not None else self.prompt_len
        completion = sum(st.num_output_tokens for st in self.states)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=first.num_cached_tokens),
        )


class _AbortOnCloseStreamingResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, even when the client vanished
    while the iterator was suspended at a `yield` (so the iterator's cleanup runs at once)."""

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[union-attr]


def _without_null_kv_params(d: dict[str, Any]) -> dict[str, Any]:
    """A response body without `kv_transfer_params` unless a prefill engine set it."""
    if d.get("kv_transfer_params") is None:
        d.pop("kv_transfer_params", None)
    return d


def _sse(obj: BaseModel | dict[str, Any]) -> str:
    data = obj if isinstance(obj, dict) else obj.model_dump(mode="json")
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _chunk_dict(chunk: BaseModel) -> dict[str, Any]:
    d = chunk.model_dump(mode="json")
    if d.get("usage") is None:
        d.pop("usage", None)
    return d


# ------------------------------------------------------------------------------------- the app


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    served_model_name: str,
    api_key: str | None = None,
    extra_routes: Callable[[FastAPI], None] | None = None,
    chat_parsing: ChatParsing | None = None,
    max_body_bytes: int | None = None,
) -> FastAPI:
    """Build the OpenAI-compatible FastAPI app over `engine`.

    engine: an `EngineClient` (generate / abort / is_healthy, `model_name`, `max_model_len`; an
        optional `max_logprobs` attribute makes the server refuse larger `logprobs` requests itself).
    tokenizer: provides `encode`, `decode`, `apply_chat_template` (see the module docstring).
    served_model_name: the only accepted value of a request's `model` (an absent `model` means
        this one); listed by `/v1/models`.
    api_key: when set, every `/v1/*` route requires `Authorization: Bearer <api_key>`.
    extra_routes: called with the app before it is returned, to add routes or mounts such as
        `/metrics`; those are outside `/v1` and so not behind the API key.
    chat_parsing: reasoning / tool-call parsing of chat outputs (`serving.api.chat_output`);
        default none (the text is returned as content).
    max_body_bytes: larger request bodies get a 413 (default `default_max_body_bytes`).
    """
    chat_parsing = chat_parsing or ChatParsing()
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(engine.max_model_len)
    app = FastAPI(title="GLM-5.3 OpenAI-compatible server", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.served_model_name = served_model_name
    # The routes reach both through `request.app.state`, never through their closures: FastAPI
    # keeps route callables in process-wide caches, and a closure over the engine would keep a
    # shut-down engine (its weights and KV arena) alive after its app is gone.
    del engine, tokenizer

    def _served(request: Request) -> tuple[EngineClient, Any]:
        return request.app.state.engine, request.app.state.tokenizer

    # ------------------------------------------------------------------ exception handlers
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_json(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_json(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail)).to_response().model_dump(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error", exc_info=exc)
        return _error_json(APIError(500, f"Internal server error: {type(exc).__name__}"))

    # ------------------------------------------------------------------ auth
    async def _check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise APIError(
                401, "Invalid or missing API key (expected 'Authorization: Bearer <key>')."
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_check_api_key)])

    def _check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def _first_outputs(request: Request, ch: _Choices) -> list[RequestOutput | None]:
        """Wait for every choice's first output before answering, so that an engine rejection
        is a clean HTTP error; the client leaving meanwhile aborts the requests."""
        try:
            return await _race_disconnect(request, asyncio.gather(*(h.next() for h in ch.handles)))
        except _ClientDisconnected:
            await ch.close()
            raise
        except BaseException as e:
            await ch.close()
            if isinstance(e, Exception):
                raise _engine_error(e, ch.request_id) from None
            raise

    async def _run_nonstream(request: Request, ch: _Choices) -> bool:
        """Collect every choice's whole output (a choice whose stop string matched is aborted in
        the engine at once). False when the client disconnected (requests aborted)."""

        async def consume(i: int) -> None:
            handle, st = ch.handles[i], ch.states[i]
            while (out := await handle.next()) is not None:
                st.add(out)
                if st.finished:
                    break
            if not st.finished:
                st.finish("abort")
            await handle.close("stop" if st.stopped else "abort")

        try:
            await _race_disconnect(request, asyncio.gather(*(consume(i) for i in range(len(ch)))))
        except _ClientDisconnected:
            logger.info("Client disconnected; aborted %s", ch.request_id)
            return False
        except Exception as e:
            raise _engine_error(e, ch.request_id) from None
        finally:
            await ch.close()
        return True

    def _stream(
        request: Request,
        ch: _Choices,
        firsts: list[RequestOutput | None],
        make_chunks: Callable[[int, TextDelta, RequestTextState], list[dict[str, Any]]],
        make_usage_chunk: Callable[[UsageInfo], dict[str, Any]] | None,
        opening: list[dict[str, Any]],
    ) -> StreamingResponse:
        """SSE over all choices: their outputs interleave as the engine produces them; a choice
        stops at its stop string (and is aborted in the engine); then the usage chunk (when
        asked) and `[DONE]`."""

        async def events() -> AsyncIterator[str]:
            queue: asyncio.Queue = asyncio.Queue()
            pumps: dict[int, asyncio.Task] = {}

            async def pump(i: int) -> None:
                try:
                    while True:
                        out = await ch.handles[i].next()
                        queue.put_nowait((i, out, None))
                        if out is None or out.finished:
                            return
                except Exception as e:  # noqa: BLE001 - forwarded to the stream
                    queue.put_nowait((i, None, e))

            async def stop_choice(i: int) -> None:
                await ch.handles[i].abort("stop" if ch.states[i].stopped else "abort")  # before the cancel
                task = pumps.pop(i, None)
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                await ch.handles[i].close()

            pending = set(range(len(ch)))

            async def apply(i: int, out: RequestOutput | None) -> list[dict[str, Any]]:
                st = ch.states[i]
                if i not in pending:
                    return []
                delta = st.add(out) if out is not None else st.finish("abort")
                chunks = []
                # One chunk per engine step and choice, as vLLM sends: a step whose token adds no
                # visible text yet (part of a UTF-8 character, a possible stop string, a tag a
                # parser holds) still gets its (empty) chunk, so clients count decode steps right.
                if delta.text or delta.logprobs or delta.finished or delta.token_ids:
                    chunks = make_chunks(i, delta, st)
                if st.finished:
                    pending.discard(i)
                    if not ch.handles[i].finished:
                        await stop_choice(i)
                return chunks

            try:
                for d in opening:
                    yield _sse(d)
                for i, out in enumerate(firsts):
                    for d in await apply(i, out):
                        yield _sse(d)
                    if i in pending:
                        pumps[i] = asyncio.ensure_future(pump(i))
                while pending:
                    if await request.is_disconnected():
                        logger.info("Client disconnected; aborting %s", ch.request_id)
                        return
                    i, out, err = await queue.get()
                    if err is not None:
                        raise err
                    for d in await apply(i, out):
                        yield _sse(d)
                if make_usage_chunk is not None:
                    yield _sse(make_usage_chunk(ch.usage()))
                yield "data: [DONE]\n\n"
            except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
                err = _engine_error(e, ch.request_id)
                yield _sse(err.to_response().model_dump())
                yield "data: [DONE]\n\n"
            finally:
                with anyio.CancelScope(shield=True):
                    for task in pumps.values():
                        task.cancel()
                    await asyncio.gather(*pumps.values(), return_exceptions=True)
                    await ch.close()

        return _AbortOnCloseStreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # ------------------------------------------------------------------ routes
    @app.get("/get_load")
    async def get_load(request: Request) -> JSONResponse:
        """`{"load": N}`: requests queued or running (vllm-router's power_of_two policy polls it)."""
        engine, _ = _served(request)
        return JSONResponse({"load": int(engine.num_unfinished_requests())})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's `/tokenize`: `{"prompt": str}` or `{"messages": [...]}` → `{"count", "max_model_len",
        "tokens", "token_strs"}` (vllm-router's cache_aware policy uses the token ids)."""
        engine, tokenizer = _served(request)
        body = await _parse_body(request, TokenizeRequest, max_body_bytes)
        if body.messages is not None:
            chat = ChatCompletionRequest.model_validate({"messages": body.messages})
            text = await anyio.to_thread.run_sync(
                lambda: tokenizer.apply_chat_template(_template_messages(chat), add_generation_prompt=True))
            ids = await _encode(tokenizer, text, "messages")
        elif isinstance(body.prompt, str):
            ids = await _encode(tokenizer, body.prompt, "prompt")
        else:
            raise _bad_request("Give a prompt string or messages.", "prompt")
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": None})

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 while the engine is healthy, else 503."""
        engine, _ = _served(request)
        try:
            ok = bool(engine.is_healthy())
        except Exception:  # noqa: BLE001
            logger.exception("engine.is_healthy() raised")
            ok = False
        return Response(status_code=200 if ok else 503)

    def _model_card(request: Request) -> ModelCard:
        engine, _ = _served(request)
        return ModelCard(
            id=served_model_name,
            root=getattr(engine, "model_name", None),
            max_model_len=engine.max_model_len,
        )

    @v1.get("/models")
    async def list_models(request: Request) -> JSONResponse:
        """The served model."""
        return JSONResponse(ModelList(data=[_model_card(request)]).model_dump())

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> JSONResponse:
        """The served model by name; 404 for any other name."""
        _check_model(model)
        return JSONResponse(_model_card(request).model_dump())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, streaming (SSE) or not, with `n` choices."""
        engine, tokenizer = _served(request)
        body: ChatCompletionRequest = await _parse_body(request, ChatCompletionRequest, max_body_bytes)
        _check_model(body.model)
        _reject_unsupported(body)
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(body, name)
            if value is not None and value < 1:
                raise _bad_request(f"{name} must be at least 1, got {value}.", name)

        try:
            prepared = chat_parsing.prepare(body)
        except ChatRequestError as e:
            raise _bad_request(str(e), e.param) from None
        kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise _bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets "
                "messages, tools and add_generation_prompt; a request cannot replace the chat "
                "template).",
                "chat_template_kwargs",
            )
        if body.reasoning_effort is not None:
            kwargs["reasoning_effort"] = body.reasoning_effort
        if body.tool_choice is not None:
            kwargs["tool_choice"] = body.tool_choice
        messages = _template_messages(body)
        try:
            prompt = await anyio.to_thread.run_sync(  # off the event loop, as `_encode`
                lambda: tokenizer.apply_chat_template(
                    messages, tools=prepared.tools, add_generation_prompt=True, **kwargs
                )
            )
        except Exception as e:  # noqa: BLE001 - template errors come from the request's content
            raise _bad_request(f"Could not render the chat template: {e}", "messages") from None
        prompt_ids = await _encode(tokenizer, prompt, "messages")

        if body.max_completion_tokens is not None:
            requested, param = body.max_completion_tokens, "max_completion_tokens"
        else:
            requested, param = body.max_tokens, "max_tokens"
        max_tokens = _resolve_max_tokens(
            requested, param, len(prompt_ids), engine.max_model_len, "messages"
        )
        params = _sampling_params(body, max_tokens, getattr(engine, "max_logprobs", None))
        params.data_parallel_rank = _data_parallel_rank(request)
        top_n = body.top_logprobs or 0

        def logprobs_of(lps) -> ChatChoiceLogprobs | None:
            return None if params.logprobs is None else chat_logprobs(tokenizer, lps or [], top_n)

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        ch = _Choices(engine, tokenizer, prompt_ids, params, rid)
        outputs = [prepared.new_output(prompt) for _ in range(len(ch))]  # one parser per choice

        if not body.stream:
            if not await _run_nonstream(request, ch):
                return Response(status_code=499)  # nobody is listening
            messages_out = [outputs[i].message(st.text, st.finish_reason or "abort") for i, st in enumerate(ch.states)]
            resp = ChatCompletionResponse(
                id=rid,
                created=created,
                model=served_model_name,
                choices=[
                    ChatCompletionChoice(
                        index=i,
                        message=message,
                        logprobs=logprobs_of(st.logprobs),
                        finish_reason=finish_reason,
                    )
                    for i, (st, (message, finish_reason)) in enumerate(zip(ch.states, messages_out))
                ],
                usage=ch.usage(),
                kv_transfer_params=ch.handles[0].kv_transfer_params,
            )
            return JSONResponse(_without_null_kv_params(resp.model_dump(mode="json")))

        try:
            firsts = await _first_outputs(request, ch)
        except _ClientDisconnected:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(i: int, delta: DeltaMessage, finish: str | None, lps=None) -> dict[str, Any]:
            return _chunk_dict(
                ChatCompletionStreamResponse(
                    id=rid,
                    created=created,
                    model=served_model_name,
                    choices=[ChatCompletionStreamChoice(index=i, delta=delta, logprobs=lps,
                                                        finish_reason=finish)],
                )
            )

        def make_chunks(i: int, d: TextDelta, st: RequestTextState) -> list[dict[str, Any]]:
            lps = logprobs_of(d.logprobs) if d.logprobs else None
            pairs = outputs[i].deltas(d.text, d.finish_reason)
            if not pairs and (lps is not None or d.token_ids):  # text held back: an empty delta for the step
                pairs = [(DeltaMessage(), None)]
            return [chunk(i, delta, finish, lps if k == 0 else None) for k, (delta, finish) in enumerate(pairs)]

        def usage_chunk(usage: UsageInfo) -> dict[str, Any]:
            return ChatCompletionStreamResponse(
                id=rid, created=created, model=served_model_name, choices=[], usage=usage
            ).model_dump(mode="json")

        return _stream(
            request,
            ch,
            firsts,
            make_chunks,
            usage_chunk if include_usage else None,
            opening=[chunk(i, DeltaMessage(role="assistant", content=""), None) for i in range(len(ch))],
        )

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        """OpenAI (legacy) completions with a string or token-id prompt, streaming or not."""
        engine, tokenizer = _served(request)
        body: CompletionRequest = await _parse_body(request, CompletionRequest, max_body_bytes)
        _check_model(body.model)
        _reject_unsupported(body)
        if body.max_tokens is not None and body.max_tokens < 1:
            raise _bad_request(
                f"max_tokens must be at least 1, got {body.max_tokens}.", "max_tokens"
            )

        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _bad_request(
                    "Batched prompts are not supported yet; send one prompt per request.", "prompt"
                )
            prompt = prompt[0]
        prompt_ids = await _encode(tokenizer, prompt, "prompt") if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise _bad_request("The prompt must not be empty.", "prompt")

        max_tokens = _resolve_max_tokens(
            body.max_tokens, "max_tokens", len(prompt_ids), engine.max_model_len, "prompt"
        )
        params = _sampling_params(body, max_tokens, getattr(engine, "max_logprobs", None))
        params.data_parallel_rank = _data_parallel_rank(request)
        top_n = body.logprobs or 0

        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        ch = _Choices(engine, tokenizer, prompt_ids, params, rid)

        if not body.stream:
            if not await _run_nonstream(request, ch):
                return Response(status_code=499)
            resp = CompletionResponse(
                id=rid,
                created=created,
                model=served_model_name,
                choices=[
                    CompletionChoice(
                        index=i,
                        text=st.text,
                        logprobs=None if params.logprobs is None
                        else completion_logprobs(tokenizer, st.logprobs, top_n),
                        finish_reason=st.finish_reason or "abort",
                        prompt_token_ids=list(prompt_ids) if body.return_token_ids else None,
                        token_ids=list(st.token_ids) if body.return_token_ids else None,
                    )
                    for i, st in enumerate(ch.states)
                ],
                usage=ch.usage(),
                kv_transfer_params=ch.handles[0].kv_transfer_params,
            )
            return JSONResponse(_without_null_kv_params(resp.model_dump(mode="json")))

        try:
            firsts = await _first_outputs(request, ch)
        except _ClientDisconnected:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        offsets = [0] * len(ch)
        sent_prompt = [False] * len(ch)

        def make_chunks(i: int, d: TextDelta, st: RequestTextState) -> list[dict[str, Any]]:
            lps = None
            if d.logprobs:
                lps = completion_logprobs(tokenizer, d.logprobs, top_n, offsets[i])
                offsets[i] = lps.text_offset[-1] + len(lps.tokens[-1])
            ids = {}
            if body.return_token_ids:
                ids = {"token_ids": list(d.token_ids)}
                if not sent_prompt[i]:
                    ids["prompt_token_ids"] = list(prompt_ids)
                    sent_prompt[i] = True
            return [
                _chunk_dict(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=served_model_name,
                        choices=[CompletionChoice(index=i, text=d.text, logprobs=lps,
                                                  finish_reason=d.finish_reason, **ids)],
                    )
                )
            ]

        def usage_chunk(usage: UsageInfo) -> dict[str, Any]:
            return CompletionResponse(
                id=rid, created=created, model=served_model_name, choices=[], usage=usage
            ).model_dump(mode="json")

        return _stream(
            request,
            ch,
            firsts,
            make_chunks,
            usage_chunk if include_usage else None,
            opening=[],
        )

    app.include_router(v1)
    if extra_routes is not None:
        extra_routes(app)
    return app
