"""The OpenAI-compatible HTTP server: `build_app(engine, tokenizer, served_model_name)`.

This module holds the app and its routes; the request checks are in `serving/api/validation.py`,
the error bodies in `serving/api/errors.py`, and the plumbing between an HTTP request and its
engine requests (abort on disconnect, `n` choices, SSE) in `serving/api/streaming.py`.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (and vLLM's `.../render` of each, the
prompt's token ids without generating: `serving/api/render.py`), `GET /v1/models`,
`GET /v1/models/{model}`, `GET /health`, `POST /tokenize`, `POST /detokenize`, `GET /get_load`, and for
routers `GET /get_server_info` and `GET /kv_event_sources` (`serving/api/discovery.py`); OpenAI's
Responses API (`POST /v1/responses` and its stored responses' routes,
`serving/api/responses_routes.py`) and Anthropic's `POST /v1/messages` and
`POST /v1/messages/count_tokens` (`serving/api/anthropic.py`) translate to and from the chat route. `/metrics` and other routes are added by the caller
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
  (`max_tokens` < 1, `temperature` < 0, `top_p` outside (0, 1], `top_k` < -1, `min_p` outside
  [0, 1], `n` outside [1, 128], empty stop strings, `top_logprobs` without `logprobs`), features
  this build does not support yet (`best_of`, `suffix`, `prompt_logprobs` with `stream`), a prompt
  that does not fit `max_model_len` (alone or with
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
(fp32 log-softmax of the raw logits) and are formatted by `serving.api.logprobs`, as are vLLM's
`prompt_logprobs` and an echoed prompt's entries (completions' `echo`; `max_tokens: 0` with `echo` is
the prompt alone; `serving/prompt_logprobs.py`). Usage counts
the prompt once and the completion tokens of all choices; `prompt_tokens_details.cached_tokens`
is the prefix-cache hit of choice 0.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, NamedTuple

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from serving.api.anthropic import add_anthropic_routes, is_anthropic_path
from serving.api.anthropic import error_response as anthropic_error
from serving.api.chat_output import ChatParsing, ChatRequestError
from serving.api.discovery import add_discovery_routes
from serving.api.errors import (
    APIError,
    bad_request,
    engine_error,
    error_json,
    validation_error,
)
from serving.api.logprobs import (
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from serving.api.protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UsageInfo,
)
from serving.api.render import add_render_routes
from serving.api.response_store import ResponseStore
from serving.api.responses_routes import add_responses_routes
from serving.api.streaming import (
    AbortOnCloseStreamingResponse,
    Choices,
    ClientDisconnected,
    SSEFrames,
    StreamFrames,
    chunk_dict,
    race_disconnect,
    without_null_kv_params,
)
from serving.api.structured import request_constraint, single_token_id
from serving.api.validation import (
    RESERVED_TEMPLATE_KWARGS,
    budget_tags,
    build_sampling_params,
    completion_prompts,
    continue_final_message,
    default_max_body_bytes,
    encode_text,
    header_data_parallel_rank,
    parse_body,
    reject_unsupported,
    requested_max_tokens,
    resolve_max_tokens,
    template_messages,
)
from serving.output_processor import RequestTextState, TextDelta
from serving.parsers.reasoning import THINK_END, THINK_START, count_reasoning_tokens
from serving.types import EngineClient, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- the app


_NOT_YET = object()  # a choice whose first output has not been awaited before the stream starts


class _UnhandledErrors:
    """ASGI middleware: an exception that escapes a route before its response started becomes
    the OpenAI-style JSON 500 here. (Starlette's outermost error middleware would send the same
    body from the `Exception` handler but then re-raise, so uvicorn logged two tracebacks and
    reset the keep-alive connection, failing the client's next request on it.) A client that
    disconnected while its body was being read gets nothing and is logged at INFO."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except ClientDisconnect:
            logger.info("Client disconnected before its request body arrived (%s)", scope.get("path"))
        except Exception as exc:
            if started:
                raise
            logger.exception("Unhandled error", exc_info=exc)
            await error_json(APIError(500, f"Internal server error: {type(exc).__name__}"))(scope, receive, send)


class RenderedChat(NamedTuple):
    """A chat request's prompt (`build_app`'s `_render_chat`): the output parsing prepared for it,
    the messages as the template got them, the prompt text and its token ids."""

    prepared: Any
    messages: list[dict[str, Any]]
    prompt: str
    prompt_ids: list[int]


class PreparedCompletion(NamedTuple):
    """A completions request ready for the engine (`build_app`'s `_prepare_completion`): its
    prompts as given, their token ids, `(token ids, sampling parameters)` per prompt, and whether
    it asks for the prompt alone (echo with max_tokens 0)."""

    prompts: list[Any]
    prompt_ids: list[list[int]]
    batch: list[tuple[list[int], Any]]
    echo_only: bool


class PreparedChat(NamedTuple):
    """A chat request ready for the engine (`build_app`'s `_prepare_chat`): its prompt, its
    sampling parameters (token limit, data-parallel rank, output constraint and think-block tags
    resolved) and whether the prompt opened the think block."""

    rendered: RenderedChat
    params: Any
    opens_reasoning: bool


def build_app(
    engine: EngineClient,
    tokenizer: Any,
    served_model_name: str,
    api_key: str | None = None,
    extra_routes: Callable[[FastAPI], None] | None = None,
    chat_parsing: ChatParsing | None = None,
    max_body_bytes: int | None = None,
    model_root: str | None = None,
    default_sampling: dict[str, Any] | None = None,
    model_aliases: Sequence[str] = (),
    responses_store_size: int = 1000,
    responses_store_max_bytes: int = 256 << 20,
) -> FastAPI:
    """Build the OpenAI-compatible FastAPI app over `engine`.

    engine: an `EngineClient` (generate / abort / is_healthy, `model_name`, `max_model_len`; an
        optional `max_logprobs` attribute makes the server refuse larger `logprobs` requests itself).
    tokenizer: provides `encode`, `decode`, `apply_chat_template` (see the module docstring).
    served_model_name: the accepted value of a request's `model` (an absent `model` means this
        one), the `model` of every answer; listed by `/v1/models`.
    model_aliases: more names a request's `model` may give (vLLM's `--served-model-name A B ...`:
        every name is accepted and listed, answers carry the first).
    api_key: when set, every `/v1/*` route requires `Authorization: Bearer <api_key>` (`/v1/messages`
        also takes it as `x-api-key`, as Anthropic's clients send it).
    extra_routes: called with the app before it is returned, to add routes or mounts such as
        `/metrics`; those are outside `/v1` and so not behind the API key.
    chat_parsing: reasoning / tool-call parsing of chat outputs (`serving.api.chat_output`);
        default none (the text is returned as content).
    max_body_bytes: larger request bodies get a 413 (default `default_max_body_bytes`).
    model_root: what `/v1/models` lists as `root`: the checkpoint path, hub id or preset name the
        server was started with (vLLM's `--model`); default `served_model_name`.
    default_sampling: `SamplingParams` fields for requests that leave them out (`temperature`,
        `top_p`, `top_k`, `min_p`, and `max_tokens` as a cap on the room left), from the
        checkpoint's generation config (`serving.generation_defaults`); default none.
    responses_store_size / responses_store_max_bytes: the Responses API's store of responses
        (`previous_response_id`, retrieval, background runs; `serving/api/response_store.py`):
        responses kept at most, and their conversations' size as JSON at most; size 0 keeps none
        (stateless: `store` answered as false).
    """
    chat_parsing = chat_parsing or ChatParsing()
    if max_body_bytes is None:
        max_body_bytes = default_max_body_bytes(engine.max_model_len)
    app = FastAPI(title="GLM-5.3 OpenAI-compatible server", docs_url=None, redoc_url=None)
    app.add_middleware(_UnhandledErrors)
    app.state.engine = engine
    app.state.tokenizer = tokenizer
    app.state.served_model_name = served_model_name
    app.state.default_sampling = dict(default_sampling or {})
    app.state.responses_store = (ResponseStore(responses_store_size, responses_store_max_bytes)
                                 if responses_store_size > 0 else None)
    # The routes reach both through `request.app.state`, never through their closures: FastAPI
    # keeps route callables in process-wide caches, and a closure over the engine would keep a
    # shut-down engine (its weights and KV arena) alive after its app is gone.
    del engine, tokenizer

    def _served(request: Request) -> tuple[EngineClient, Any]:
        return request.app.state.engine, request.app.state.tokenizer

    # ------------------------------------------------------------------ exception handlers
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_json(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_json(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if is_anthropic_path(request.url.path):  # an unknown path or method there: Anthropic's body
            resp = anthropic_error(APIError(exc.status_code, str(exc.detail)))
            resp.headers.update(getattr(exc, "headers", None) or {})  # e.g. a 405's Allow
            return resp
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail)).to_response().model_dump(),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(Exception)
    async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("Unhandled error", exc_info=exc)
        err = APIError(500, f"Internal server error: {type(exc).__name__}")
        return anthropic_error(err) if is_anthropic_path(request.url.path) else error_json(err)

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

    names = tuple(dict.fromkeys((served_model_name, *model_aliases)))  # in order, each once

    def _think_ids(request: Request) -> tuple[int | None, int | None]:
        """The tokenizer's `<think>` and `</think>` ids (None where one is not a single token),
        encoded once per app."""
        state = request.app.state
        if getattr(state, "think_ids", None) is None:
            _, tokenizer = _served(request)
            state.think_ids = (single_token_id(tokenizer, THINK_START), single_token_id(tokenizer, THINK_END))
        return state.think_ids

    def _check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    async def _first_outputs(request: Request, ch: Choices) -> list[RequestOutput | None | object]:
        """Wait for the first choice's first output before answering, so that an engine
        rejection (the same for every choice of a prompt: they share it and its parameters) is a
        clean HTTP error; the client leaving meanwhile aborts the requests. The other choices'
        entries are `_NOT_YET` (their outputs stream as they come: with `n` above --max-num-seqs
        some choices wait for others to finish, and the headers must not). A batched completions
        request whose later prompt the engine refuses gets the error in the stream, after the
        200 status line."""
        try:
            first = await race_disconnect(request, ch.handles[0].next())
            return [first] + [_NOT_YET] * (len(ch.handles) - 1)
        except ClientDisconnected:
            await ch.close()
            raise
        except BaseException as e:
            await ch.close()
            if isinstance(e, Exception):
                raise engine_error(e, ch.request_id) from None
            raise

    async def _run_nonstream(request: Request, ch: Choices) -> bool:
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
            await race_disconnect(request, asyncio.gather(*(consume(i) for i in range(len(ch)))))
        except ClientDisconnected:
            logger.info("Client disconnected; aborted %s", ch.request_id)
            return False
        except Exception as e:
            raise engine_error(e, ch.request_id) from None
        finally:
            await ch.close()
        return True

    def _stream(
        request: Request,
        ch: Choices,
        firsts: list[RequestOutput | None | object],
        make_chunks: Callable[[int, TextDelta, RequestTextState], list[dict[str, Any]]],
        make_usage_chunk: Callable[[UsageInfo], dict[str, Any]] | None,
        opening: list[dict[str, Any]],
        continuous_usage: bool = False,
        frames: StreamFrames | None = None,
    ) -> StreamingResponse:
        """SSE over all choices: their outputs interleave as the engine produces them; a choice
        stops at its stop string (and is aborted in the engine); then the usage chunk (when
        asked) and `[DONE]`. `continuous_usage` (vLLM's `stream_options.continuous_usage_stats`):
        every choice's chunk also carries that choice's usage so far (`Choices.choice_usage`).
        `frames` turns the chunk dicts into the events sent (default `SSEFrames`, OpenAI's; a
        translated route passes its own, serving/api/anthropic.py, responses.py)."""
        frames = frames or SSEFrames()

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
                    if continuous_usage:
                        usage = ch.choice_usage(i).model_dump(mode="json")
                        for d in chunks:
                            d["usage"] = usage
                if st.finished:
                    pending.discard(i)
                    if not ch.handles[i].finished:
                        await stop_choice(i)
                return chunks

            try:
                for d in opening:
                    if continuous_usage and d.get("choices"):
                        d["usage"] = ch.choice_usage(d["choices"][0]["index"]).model_dump(mode="json")
                    for e in frames.feed(d):
                        yield e
                for i, out in enumerate(firsts):
                    if out is not _NOT_YET:
                        for d in await apply(i, out):
                            for e in frames.feed(d):
                                yield e
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
                        for e in frames.feed(d):
                            yield e
                if make_usage_chunk is not None:
                    for e in frames.feed(make_usage_chunk(ch.usage())):
                        yield e
                for e in frames.end():
                    yield e
            except Exception as e:  # noqa: BLE001 - the status line is gone; report in-band
                err = engine_error(e, ch.request_id)
                for e in [*frames.feed(err.to_response().model_dump()), *frames.end()]:
                    yield e
            finally:
                with anyio.CancelScope(shield=True):
                    for task in pumps.values():
                        task.cancel()
                    await asyncio.gather(*pumps.values(), return_exceptions=True)
                    await ch.close()

        return AbortOnCloseStreamingResponse(
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
        body = await parse_body(request, TokenizeRequest, max_body_bytes)
        _check_model(body.model)
        if body.messages is not None:
            try:
                chat = ChatCompletionRequest.model_validate({"messages": body.messages})
            except ValidationError as e:
                raise validation_error(e) from None
            try:
                text = await anyio.to_thread.run_sync(
                    lambda: tokenizer.apply_chat_template(template_messages(chat),
                                                          add_generation_prompt=body.add_generation_prompt))
            except Exception as e:  # noqa: BLE001 - template errors come from the request's content
                raise bad_request(f"Could not render the chat template: {e}", "messages") from None
            ids = await encode_text(tokenizer, text, "messages")
        elif isinstance(body.prompt, str):
            ids = await encode_text(tokenizer, body.prompt, "prompt")
        else:
            raise bad_request("Give a prompt string or messages.", "prompt")
        strs = [tokenizer.decode([t], skip_special_tokens=False) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's `/detokenize`: `{"tokens": [ids]}` → `{"prompt": text}` (400 for an id outside
        the vocabulary)."""
        _, tokenizer = _served(request)
        body = await parse_body(request, DetokenizeRequest, max_body_bytes)
        _check_model(body.model)
        vocab = len(tokenizer)
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (0 … {vocab - 1}).", "tokens")
        text = await anyio.to_thread.run_sync(lambda: tokenizer.decode(body.tokens, skip_special_tokens=False))
        return JSONResponse({"prompt": text})

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

    def _model_card(request: Request, name: str) -> ModelCard:
        engine, _ = _served(request)
        return ModelCard(
            id=name,
            root=model_root or served_model_name,
            max_model_len=engine.max_model_len,
        )

    @v1.get("/models")
    async def list_models(request: Request) -> JSONResponse:
        """The served model, one card per served name."""
        return JSONResponse(ModelList(data=[_model_card(request, n) for n in names]).model_dump())

    @v1.get("/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> JSONResponse:
        """The served model by name; 404 for any other name."""
        _check_model(model)
        return JSONResponse(_model_card(request, model).model_dump())

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, streaming (SSE) or not, with `n` choices."""
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, max_body_bytes)
        return await _chat_response(request, body)

    async def _render_chat(request: Request, body: ChatCompletionRequest) -> RenderedChat:
        """A chat request's prompt. Raises APIError (400) for what the model, the output parsing or
        the template refuse."""
        _, tokenizer = _served(request)
        _check_model(body.model)
        reject_unsupported(body)
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(body, name)
            if value is not None and value < 1:
                raise bad_request(f"{name} must be at least 1, got {value}.", name)

        try:
            prepared = chat_parsing.prepare(body)
        except ChatRequestError as e:
            raise bad_request(str(e), e.param) from None
        kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {', '.join(reserved)} (the server sets "
                "messages and tools, add_generation_prompt and continue_final_message are request "
                "fields of their own, and a request cannot replace the chat template).",
                "chat_template_kwargs",
            )
        if body.reasoning_effort is not None:
            kwargs["reasoning_effort"] = body.reasoning_effort
        if body.tool_choice is not None:
            kwargs["tool_choice"] = body.tool_choice
        messages = template_messages(body)
        if body.continue_final_message and (body.add_generation_prompt or messages[-1]["role"] != "assistant"):
            raise bad_request("continue_final_message needs add_generation_prompt=false and a last message from "
                              "the assistant (vLLM's rule).", "continue_final_message")
        try:
            prompt = await anyio.to_thread.run_sync(  # off the event loop, as `encode_text`
                lambda: tokenizer.apply_chat_template(
                    messages, tools=prepared.tools, add_generation_prompt=body.add_generation_prompt, **kwargs
                )
            )
        except Exception as e:  # noqa: BLE001 - template errors come from the request's content
            raise bad_request(f"Could not render the chat template: {e}", "messages") from None
        if body.continue_final_message:
            prompt = continue_final_message(prompt, messages[-1]["content"])
        prompt_ids = await encode_text(tokenizer, prompt, "messages")
        return RenderedChat(prepared, messages, prompt, prompt_ids)

    async def _engine_checks(request: Request, batch: list[tuple[list[int], SamplingParams]]) -> None:
        """The engine's own checks of prepared requests (vocabulary, lengths, constraint compile)
        without submitting them, where the engine offers them (`AsyncEngine.check_request`): for
        what answers without generating (render) or before generating (a background response)."""
        engine, _ = _served(request)
        check = getattr(engine, "check_request", None)
        if check is None:
            return
        for ids, params in batch:
            try:
                await check(ids, params)
            except ValueError as e:
                raise engine_error(e, "check") from None

    async def _prepare_chat(request: Request, body: ChatCompletionRequest, check: bool = False) -> PreparedChat:
        """Render a chat request and resolve its sampling parameters: every 400 a chat request can
        get before it reaches the engine is raised here (APIError); with `check`, also the
        engine's (`_engine_checks`)."""
        engine, _ = _served(request)
        rendered = await _render_chat(request, body)
        defaults = request.app.state.default_sampling
        max_tokens = resolve_max_tokens(
            *requested_max_tokens(body), len(rendered.prompt_ids), engine.max_model_len, "messages",
            note=getattr(engine, "max_model_len_note", ""), default=defaults.get("max_tokens"),
        )
        params = build_sampling_params(body, max_tokens, getattr(engine, "max_logprobs", None), defaults)
        params.data_parallel_rank = header_data_parallel_rank(request)
        opens = rendered.prepared.opens_reasoning(rendered.prompt)
        start_id, end_id = _think_ids(request)
        think_end = end_id if chat_parsing.reasoning_parser and opens else None
        params.structured_outputs = request_constraint(body, rendered.prepared.tool_grammar, think_end)
        if params.thinking_token_budget is not None:
            params.reasoning_tags = budget_tags(start_id, end_id, opens)
        if check:
            await _engine_checks(request, [(rendered.prompt_ids, params)])
        return PreparedChat(rendered, params, opens)

    async def _chat_response(request: Request, body: ChatCompletionRequest,
                             frames: StreamFrames | None = None, ready: PreparedChat | None = None) -> Response:
        """The chat completion of a parsed request body (the `/v1/chat/completions` route's work;
        `/v1/responses` and `/v1/messages` translate their requests into one, and their streams'
        events come from `frames`). `ready`: the request already prepared (`_prepare_chat`)."""
        engine, tokenizer = _served(request)
        (prepared, messages, prompt, prompt_ids), params, opens = ready or await _prepare_chat(request, body)
        top_n = body.top_logprobs or 0

        def logprobs_of(lps) -> ChatChoiceLogprobs | None:
            return None if params.logprobs is None else chat_logprobs(tokenizer, lps or [], top_n)

        # vLLM's `echo`: the last message's content opens every choice's content when it is the
        # response's role (the assistant's: an answer continued with continue_final_message, or
        # a prefilled assistant turn with add_generation_prompt false).
        echo_text = ""
        if body.echo and messages[-1]["role"] == "assistant" and not body.add_generation_prompt:
            echo_text = messages[-1].get("content") or ""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        count_reasoning = None
        if chat_parsing.reasoning_parser:  # usage.completion_tokens_details.reasoning_tokens, as vLLM
            start_id, end_id = _think_ids(request)
            count_reasoning = functools.partial(count_reasoning_tokens, opens=opens, start_id=start_id, end_id=end_id)
        ch = Choices(engine, tokenizer, prompt_ids, params, rid, count_reasoning=count_reasoning)
        outputs = [prepared.new_output(prompt) for _ in range(len(ch))]  # one parser per choice

        if not body.stream:
            if not await _run_nonstream(request, ch):
                return Response(status_code=499)  # nobody is listening
            messages_out = [outputs[i].message(st.text, st.finish_reason or "abort") for i, st in enumerate(ch.states)]
            if echo_text:
                messages_out = [(m.model_copy(update={"content": echo_text + (m.content or "")}), f)
                                for m, f in messages_out]
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
                        stop_reason=st.stop_reason,
                    )
                    for i, (st, (message, finish_reason)) in enumerate(zip(ch.states, messages_out))
                ],
                usage=ch.usage(),
                kv_transfer_params=ch.handles[0].kv_transfer_params,
                prompt_logprobs=None if body.prompt_logprobs is None
                else prompt_logprobs_body(tokenizer, ch.states[0].prompt_logprobs),
            )
            return JSONResponse(without_null_kv_params(resp.model_dump(mode="json")))

        try:
            firsts = await _first_outputs(request, ch)
        except ClientDisconnected:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's rule: per-chunk usage only together with the final usage chunk
        continuous_usage = include_usage and body.stream_options.continuous_usage_stats

        def chunk(i: int, delta: DeltaMessage, finish: str | None, lps=None, stop_reason=None) -> dict[str, Any]:
            return chunk_dict(
                ChatCompletionStreamResponse(
                    id=rid,
                    created=created,
                    model=served_model_name,
                    choices=[ChatCompletionStreamChoice(index=i, delta=delta, logprobs=lps,
                                                        finish_reason=finish, stop_reason=stop_reason)],
                )
            )

        def make_chunks(i: int, d: TextDelta, st: RequestTextState) -> list[dict[str, Any]]:
            lps = logprobs_of(d.logprobs) if d.logprobs else None
            pairs = outputs[i].deltas(d.text, d.finish_reason)
            if not pairs and (lps is not None or d.token_ids):  # text held back: an empty delta for the step
                pairs = [(DeltaMessage(), None)]
            return [chunk(i, delta, finish, lps if k == 0 else None, d.stop_reason if finish else None)
                    for k, (delta, finish) in enumerate(pairs)]

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
            opening=[chunk(i, DeltaMessage(role="assistant", content=""), None) for i in range(len(ch))]
            + ([chunk(i, DeltaMessage(content=echo_text), None) for i in range(len(ch))] if echo_text else []),
            continuous_usage=continuous_usage,
            frames=frames,
        )

    async def _prepare_completion(request: Request, body: CompletionRequest, check: bool = False) -> PreparedCompletion:
        """A completions request's prompts tokenized and each one's sampling parameters resolved:
        every 400 it can get before it reaches the engine is raised here (APIError); with `check`,
        also the engine's (`_engine_checks`)."""
        engine, tokenizer = _served(request)
        _check_model(body.model)
        reject_unsupported(body)
        requested, requested_param = requested_max_tokens(body)
        # echo with max_tokens 0: the prompt alone (its logprobs: a scoring request); the engine
        # generates one token, which the response leaves out (vLLM's way).
        echo_only = bool(body.echo) and requested == 0
        if echo_only and body.stream:
            raise bad_request(f"{requested_param}=0 with echo (the prompt alone) is not supported with stream=true.",
                              requested_param)
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(body, name)
            if value is not None and value < 1 and not (echo_only and name == requested_param):
                raise bad_request(f"{name} must be at least 1, got {value}.", name)

        prompts = completion_prompts(body.prompt, body.n or 1)
        if len(prompts) > 1 and (body.model_extra or {}).get("kv_transfer_params") is not None:
            raise bad_request("kv_transfer_params cannot be combined with batched prompts.", "prompt")
        batch: list[tuple[list[int], SamplingParams]] = []
        prompt_ids_of: list[list[int]] = []
        for pi, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt[{pi}]"
            ids = await encode_text(tokenizer, prompt, name) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise bad_request(f"The {'prompt' if len(prompts) == 1 else name} must not be empty.", "prompt")
            prompt_ids_of.append(ids)

        defaults = request.app.state.default_sampling
        rank = header_data_parallel_rank(request)
        constraint = request_constraint(body)  # one for every prompt, as for every choice of one
        for ids in prompt_ids_of:  # each prompt's own room below --max-model-len
            max_tokens = resolve_max_tokens(
                1 if echo_only else requested, requested_param, len(ids), engine.max_model_len, "prompt",
                note=getattr(engine, "max_model_len_note", ""), default=defaults.get("max_tokens"),
            )
            params = build_sampling_params(body, max_tokens, getattr(engine, "max_logprobs", None), defaults)
            params.data_parallel_rank = rank
            params.structured_outputs = constraint
            if params.thinking_token_budget is not None:  # the block is open when the prompt ends with <think>
                tail = tokenizer.decode(ids[-8:], skip_special_tokens=False)  # (as the chat route reads its prompt)
                params.reasoning_tags = budget_tags(*_think_ids(request), tail.rstrip().endswith(THINK_START))
            batch.append((ids, params))
        if check:
            await _engine_checks(request, batch)
        return PreparedCompletion(prompts, prompt_ids_of, batch, echo_only)

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        """OpenAI (legacy) completions with a string or token-id prompt, streaming or not."""
        engine, tokenizer = _served(request)
        body: CompletionRequest = await parse_body(request, CompletionRequest, max_body_bytes)
        prompts, prompt_ids_of, batch, echo_only = await _prepare_completion(request, body)
        params = batch[0][1]
        top_n = body.logprobs or 0
        echo = bool(body.echo)
        prompt_texts = [(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False)) if echo else ""
                        for p, ids in zip(prompts, prompt_ids_of)]

        def choice_logprobs(pi: int, prompt_lps, lps, offset: int) -> CompletionLogprobs | None:
            """The choice's (or chunk's) logprobs: with echo, the prompt's entries first (when
            `prompt_lps`, this choice's prompt logprobs of its prompt `pi`, are given), then the
            output's from `offset`."""
            if params.logprobs is None:
                return None
            lead = (prompt_ids_of[pi], prompt_lps) if echo and prompt_lps is not None else None
            return completion_logprobs(tokenizer, lps, top_n, offset, echo=lead)

        def prompt_lps_of(entries):
            return None if body.prompt_logprobs is None else prompt_logprobs_body(tokenizer, entries)

        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        ch = Choices(engine, tokenizer, None, None, rid, batch=batch)
        prompt_of = ch.prompt_of

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
                        text=prompt_texts[prompt_of[i]] + ("" if echo_only else st.text),
                        logprobs=choice_logprobs(prompt_of[i], st.prompt_logprobs, [] if echo_only else st.logprobs,
                                                 0),
                        finish_reason=st.finish_reason or "abort",
                        stop_reason=st.stop_reason,
                        prompt_token_ids=list(prompt_ids_of[prompt_of[i]]) if body.return_token_ids else None,
                        token_ids=(list(st.token_ids) if not echo_only else []) if body.return_token_ids else None,
                        prompt_logprobs=prompt_lps_of(st.prompt_logprobs),
                    )
                    for i, st in enumerate(ch.states)
                ],
                usage=ch.usage(),
                kv_transfer_params=ch.handles[0].kv_transfer_params,
            )
            return JSONResponse(without_null_kv_params(resp.model_dump(mode="json")))

        try:
            firsts = await _first_outputs(request, ch)
        except ClientDisconnected:
            return Response(status_code=499)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        # vLLM's rule: per-chunk usage only together with the final usage chunk
        continuous_usage = include_usage and body.stream_options.continuous_usage_stats
        offsets = [0] * len(ch)
        sent_prompt = [False] * len(ch)
        echoed = [not echo] * len(ch)

        def make_chunks(i: int, d: TextDelta, st: RequestTextState) -> list[dict[str, Any]]:
            lps = None
            text = d.text
            pi = prompt_of[i]
            if not echoed[i]:  # echo: the prompt's text (and logprobs) open the choice's first chunk
                echoed[i] = True
                text = prompt_texts[pi] + text
                lps = choice_logprobs(pi, d.prompt_logprobs or [], d.logprobs or [], 0)
            elif d.logprobs:
                lps = completion_logprobs(tokenizer, d.logprobs, top_n, offsets[i])
            if lps is not None and lps.tokens:
                offsets[i] = lps.text_offset[-1] + len(lps.tokens[-1])
            ids = {}
            if body.return_token_ids:
                ids = {"token_ids": list(d.token_ids)}
                if not sent_prompt[i]:
                    ids["prompt_token_ids"] = list(prompt_ids_of[pi])
                    sent_prompt[i] = True
            return [
                chunk_dict(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=served_model_name,
                        choices=[CompletionChoice(index=i, text=text, logprobs=lps,
                                                  finish_reason=d.finish_reason, stop_reason=d.stop_reason,
                                                  prompt_logprobs=prompt_lps_of(d.prompt_logprobs)
                                                  if d.prompt_logprobs is not None else None, **ids)],
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
            continuous_usage=continuous_usage,
        )

    checked_chat = functools.partial(_prepare_chat, check=True)
    add_responses_routes(v1, _chat_response, checked_chat, max_body_bytes)
    add_render_routes(v1, checked_chat, functools.partial(_prepare_completion, check=True), max_body_bytes)
    app.include_router(v1)
    add_anthropic_routes(app, _chat_response, _render_chat, api_key, max_body_bytes)
    add_discovery_routes(app, model_root)
    if extra_routes is not None:
        extra_routes(app)
    return app
