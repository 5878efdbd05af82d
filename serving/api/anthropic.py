"""Anthropic's Messages API over the chat completions path: `POST /v1/messages` and
`POST /v1/messages/count_tokens` (what Claude Code and the `anthropic` SDK speak; vLLM serves the
same routes).

A Messages request is translated into a chat completion request (`to_chat_request`), served by the
server's own chat path — the chat template, the reasoning and tool-call parsers, structured tool
calls, sampling, abort on disconnect — and its answer is translated back (`to_message`, or
`StreamTranslator` for the SSE stream). So the two APIs give the same tokens for the same
conversation and sampling settings.

Request fields (docs/anthropic.md has the table): `model`, `max_tokens` (required), `messages`
(`user` / `assistant` turns whose content is a string or blocks: `text`, `tool_use`, `tool_result`,
`thinking`, `redacted_thinking`), `system` (a string or text blocks), `stop_sequences`, `stream`,
`temperature`, `top_p`, `top_k`, `tools` (custom tools: `name`, `description`, `input_schema`),
`tool_choice` (`auto`, `any`, `tool`, `none`; `disable_parallel_tool_use`), `thinking`
(`{"type": "disabled"}` closes GLM's think block in the prompt; `enabled`, `adaptive` and
`between_tools` keep the template's default, thinking on; absent, the template's default too,
except with a forced tool choice, where it is off; `budget_tokens` (with `enabled`) is the
request's `thinking_token_budget`: the think block ends once that many tokens are spent in it;
`display: "omitted"` returns thinking blocks without their text), `output_config` (`effort` →
the chat template's reasoning effort; `format` `{"type": "json_schema", "schema"}` → the answer
constrained to the schema, structured outputs), `metadata` (ignored). A last turn from the
assistant is a prefilled answer: the model continues it (the chat route's
`continue_final_message`), and the answer holds only the new text; it may not hold tool_use
blocks. `tool_result`'s `is_error` is not passed on (the result's text is). A forced tool choice
(`any`, `tool`) with `thinking` explicitly on is a 400, as Anthropic's API answers. Other
top-level keys are ignored (clients send beta fields); blocks this server cannot read (images,
documents, server tools) are a 400 naming them. `cache_control` marks are ignored: prefix caching
is automatic.

Answers: content blocks `thinking` (the reasoning parser's text; `signature` empty), `text` and
`tool_use` (`input` parsed from the call's JSON arguments); `stop_reason` `end_turn`,
`max_tokens`, `stop_sequence` (with `stop_sequence` set), `tool_use`, or null when the request was
aborted (a draining server); `usage.input_tokens` counts the prompt tokens not read from the prefix
cache and `cache_read_input_tokens` those that were (Anthropic's split; their sum is the prompt).
Errors use Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, with the chat
path's status code. With `--api-key` the key is accepted as `x-api-key` or as a bearer token.
"""

from __future__ import annotations

import json
import logging
import secrets
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from serving.api.errors import APIError
from serving.api.protocol import ChatCompletionRequest
from serving.api.streaming import named_sse_event, translated_answer
from serving.api.validation import parse_body

logger = logging.getLogger(__name__)

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                503: "overloaded_error", 529: "overloaded_error"}


class AnthropicMessage(BaseModel):
    """One `messages` entry: a user or assistant turn, its content a string or a list of blocks."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """Body of `POST /v1/messages` (and, without `max_tokens`, of `/v1/messages/count_tokens`)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def _bad(message: str) -> APIError:
    return APIError(400, message)


def _text_of(blocks: Any, where: str) -> str:
    """The text of a string or of a list of text blocks (a tool result's content, `system`)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where}: expected a string or a list of text blocks.")
    parts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise _bad(f"{where}.{j}: only text blocks are supported here, got {kind!r}.")
        parts.append(b["text"])
    return "\n".join(parts)


def _chat_messages(body: MessagesRequest) -> list[dict[str, Any]]:
    """Anthropic turns as chat messages: tool results become `tool` messages (in their order
    among the user's text), an assistant's `thinking` its `reasoning_content`, its `tool_use`
    blocks its `tool_calls`."""
    out: list[dict[str, Any]] = []
    if body.system is not None:
        system = _text_of(body.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, msg in enumerate(body.messages):
        if isinstance(msg.content, str):
            out.append({"role": msg.role, "content": msg.content})
            continue
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(msg.content):
            where = f"messages.{i}.content.{j}"
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_result" and msg.role == "user":
                if texts:  # text before a result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                if not isinstance(b.get("tool_use_id"), str):
                    raise _bad(f"{where}.tool_use_id: a string is required.")
                out.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                            "content": _text_of(b.get("content", ""), f"{where}.content")})
            elif kind == "tool_use" and msg.role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise _bad(f"{where}: a tool_use block needs a string `name` and an object `input`.")
                calls.append({"id": str(b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))}})
            elif kind == "thinking" and msg.role == "assistant" and isinstance(b.get("thinking"), str):
                reasoning.append(b["thinking"])
            elif kind == "redacted_thinking" and msg.role == "assistant":
                continue  # opaque to this server
            else:
                raise _bad(f"{where}: a {kind!r} block is not supported in a {msg.role} turn "
                           f"(text, tool_use, tool_result, thinking and redacted_thinking are).")
        if msg.role == "user":
            if texts or not out or out[-1]["role"] != "tool":
                out.append({"role": "user", "content": "\n".join(texts)})
        else:
            turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) if texts else None}
            if reasoning:
                turn["reasoning_content"] = "\n".join(reasoning)
            if calls:
                turn["tool_calls"] = calls
            out.append(turn)
    return out


def _chat_tools(body: MessagesRequest) -> tuple[list[dict[str, Any]] | None, Any, bool | None]:
    """(`tools`, `tool_choice`, `parallel_tool_calls`) of the chat request."""
    tools = None
    if body.tools is not None:
        tools = []
        for k, t in enumerate(body.tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
                kind = t.get("type") if isinstance(t, dict) else None
                raise _bad(f"tools.{k}: only custom tools (`name`, `description`, `input_schema`) are supported, "
                           f"got type {kind!r}.")
            fn: dict[str, Any] = {"name": t["name"]}  # OpenAI's key order: the template dumps it as JSON
            if t.get("description") is not None:
                fn["description"] = t["description"]
            fn["parameters"] = t.get("input_schema") or {"type": "object"}
            tools.append({"type": "function", "function": fn})
    choice, parallel = None, None
    tc = body.tool_choice
    if tc is not None:
        kind = tc.get("type")
        if kind == "auto":
            choice = "auto"
        elif kind == "any":
            choice = "required"
        elif kind == "none":
            choice = "none"
        elif kind == "tool" and isinstance(tc.get("name"), str):
            choice = {"type": "function", "function": {"name": tc["name"]}}
        else:
            raise _bad(f"tool_choice: type must be auto, any, tool (with a name) or none, got {kind!r}.")
        if tc.get("disable_parallel_tool_use"):
            parallel = False
    return tools, choice, parallel


def to_chat_request(body: MessagesRequest, count_only: bool = False) -> ChatCompletionRequest:
    """The chat completion request that serves `body`. Raises APIError (400) naming what cannot be
    translated (a missing `max_tokens` unless `count_only`, an unsupported block or tool)."""
    if not count_only and body.max_tokens is None:
        raise _bad("max_tokens: Field required.")
    tools, tool_choice, parallel = _chat_tools(body)
    kwargs: dict[str, Any] = {}
    forced = isinstance(tool_choice, dict) or tool_choice == "required"
    if body.thinking is None and forced:
        kwargs["enable_thinking"] = False  # no thinking asked for (Anthropic's default) and a forced call
    if body.thinking is not None:
        kind = body.thinking.get("type")
        if kind == "disabled":
            kwargs["enable_thinking"] = False
        elif kind not in ("enabled", "adaptive", "between_tools"):
            raise _bad(f"thinking.type: expected enabled, adaptive, between_tools or disabled, got {kind!r}.")
        elif forced:
            # Anthropic's rule too: a forced call is a constraint on the answer after the thinking,
            # which the model may never end
            raise _bad("thinking may not be enabled when tool_choice forces tool use (any or tool); "
                       "send thinking {\"type\": \"disabled\"} or tool_choice auto.")
    out_cfg = body.output_config or {}
    response_format = None
    fmt = out_cfg.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("output_config.format: expected {\"type\": \"json_schema\", \"schema\": {...}}.")
        response_format = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    chat: dict[str, Any] = {
        "model": body.model, "messages": _chat_messages(body), "max_tokens": body.max_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "stop": body.stop_sequences or None, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "chat_template_kwargs": kwargs or None, "stream": body.stream,
        "reasoning_effort": out_cfg.get("effort"), "response_format": response_format,
    }
    budget = (body.thinking or {}).get("budget_tokens")
    if (body.thinking or {}).get("type") == "enabled" and budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise _bad(f"thinking.budget_tokens: expected an integer >= 0, got {budget!r}.")
        chat["thinking_token_budget"] = budget  # enforced: </think> once the budget is spent
    if body.messages[-1].role == "assistant":  # a prefilled answer: the model continues it
        if chat["messages"][-1].get("tool_calls"):
            raise _bad(f"messages.{len(body.messages) - 1}: a last assistant turn with tool_use blocks needs their "
                       "tool_result blocks in a following user turn (a prefilled answer may hold text only).")
        chat["continue_final_message"], chat["add_generation_prompt"] = True, False
    if body.stream:  # usage on every chunk: message_start needs the prompt's, message_delta the output's
        chat["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        raise _bad(f"{'.'.join(str(x) for x in first['loc'])}: {first['msg']}") from None


def _stop_reason(finish: str | None, stop_reason: Any, stop_sequences: list[str] | None) -> tuple[str | None, str | None]:
    """(Anthropic `stop_reason`, `stop_sequence`) of a chat choice's finish."""
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if finish == "stop":
        if isinstance(stop_reason, str) and stop_reason in (stop_sequences or []):
            return "stop_sequence", stop_reason
        return "end_turn", None
    return None, None  # aborted


def _usage(usage: dict[str, Any] | None) -> dict[str, int]:
    usage = usage or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": prompt - cached, "output_tokens": int(usage.get("completion_tokens") or 0),
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"_arguments": arguments}  # what the model wrote, kept rather than dropped
    return value if isinstance(value, dict) else {"_arguments": value}


def _thinking_omitted(body: MessagesRequest) -> bool:
    return (body.thinking or {}).get("display") == "omitted"


def to_message(chat: dict[str, Any], body: MessagesRequest) -> dict[str, Any]:
    """A non-streaming chat completion body as an Anthropic `message`."""
    choice = chat["choices"][0]
    msg = choice["message"]
    content: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        thinking = "" if _thinking_omitted(body) else msg["reasoning_content"]
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for tc in msg.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                        "input": _tool_input(tc["function"].get("arguments", ""))})
    if not content:
        content.append({"type": "text", "text": ""})
    stop_reason, stop_sequence = _stop_reason(choice.get("finish_reason"), choice.get("stop_reason"),
                                              body.stop_sequences)
    return {"id": _message_id(chat["id"]), "type": "message", "role": "assistant", "model": chat["model"],
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(chat.get("usage"))}


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def _event(kind: str, data: dict[str, Any]) -> str:
    return named_sse_event(kind, {"type": kind, **data})


class StreamTranslator:
    """Chat completion stream chunks (dicts, in order) → Anthropic SSE events.

    `message_start` with the first chunk (its usage gives `input_tokens`); one content block per
    run of reasoning (`thinking`), text (`text`) or per tool call (`tool_use`, its JSON arguments as
    one `input_json_delta`), each closed before the next opens; after the stream's end,
    `message_delta` (stop reason, output tokens) and `message_stop`. An error chunk becomes an
    `error` event and ends the stream."""

    def __init__(self, body: MessagesRequest) -> None:
        self.body = body
        self.started = False
        self.index = -1  # the open block's index, -1 before the first
        self.open: str | None = None  # "thinking", "text", "tool_use" or None
        self.finish: tuple[str | None, Any] = (None, None)
        self.usage: dict[str, Any] | None = None
        self.failed = False
        self.omit_thinking = _thinking_omitted(body)

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def _start_block(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """Events for one chat chunk."""
        if "error" in chunk:
            self.failed = True
            err = chunk["error"]
            status = int(err.get("code") or 500) if str(err.get("code") or "").isdigit() else 500
            return [_event("error", {"error": {"type": _ERROR_TYPES.get(status, "api_error"),
                                               "message": err.get("message", "")}})]
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if not self.started:
            self.started = True
            usage = _usage(self.usage)
            out.append(_event("message_start", {"message": {
                "id": _message_id(chunk["id"]), "type": "message", "role": "assistant", "model": chunk["model"],
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {**usage, "output_tokens": 0}}}))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    out += self._start_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                if not self.omit_thinking:
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "thinking_delta", "thinking": delta["reasoning_content"]}}))
            if delta.get("content"):
                if self.open != "text":
                    out += self._start_block("text", {"type": "text", "text": ""})
                out.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "text_delta", "text": delta["content"]}}))
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id"):
                    out += self._start_block("tool_use", {"type": "tool_use", "id": tc["id"],
                                                          "name": fn.get("name", ""), "input": {}})
                if fn.get("arguments"):
                    out.append(_event("content_block_delta", {"index": self.index, "delta": {
                        "type": "input_json_delta", "partial_json": fn["arguments"]}}))
            if choice.get("finish_reason"):
                self.finish = (choice["finish_reason"], choice.get("stop_reason"))
        return out

    def end(self) -> list[str]:
        """The events after the last chunk (none after an error)."""
        if self.failed or not self.started:
            return []
        out = []
        if self.index < 0:  # nothing was said: one empty text block, as the non-streamed answer has
            out += self._start_block("text", {"type": "text", "text": ""})
        out += self._close()
        stop_reason, stop_sequence = _stop_reason(*self.finish, self.body.stop_sequences)
        # the final usage whole: message_start's could not know the prefix-cache split yet
        out.append(_event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                            "usage": _usage(self.usage)}))
        out.append(_event("message_stop", {}))
        return out


def is_anthropic_path(path: str) -> bool:
    """Whether errors on `path` take Anthropic's body (the routes under `/v1/messages`)."""
    return path.startswith("/v1/messages")


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error body for an HTTP status."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status_code, "api_error"), "message": message}}


def error_response(exc: APIError) -> JSONResponse:
    """An APIError in Anthropic's error body, with its status."""
    return JSONResponse(error_body(exc.status_code, exc.message), status_code=exc.status_code)


def add_anthropic_routes(
    app: FastAPI,
    chat_response: Callable[..., Awaitable[Response]],
    render_chat: Callable[[Request, ChatCompletionRequest], Awaitable[Any]],
    api_key: str | None,
    max_body_bytes: int,
) -> None:
    """Add `POST /v1/messages` and `POST /v1/messages/count_tokens` to `app`. `chat_response(request,
    chat_body, frames)` serves a chat completion request (the server's chat route's work; a stream's
    events from `frames`) and
    `render_chat(request, chat_body)` renders its prompt (`server.RenderedChat`: `.prompt_ids`)."""

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("x-api-key")
        if given is None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else None
        if given is None or not secrets.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "Invalid or missing API key (expected an 'x-api-key' header or "
                                "'Authorization: Bearer <key>').")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        """Anthropic's Messages API (see the module docstring)."""
        try:
            check_key(request)
            body = await parse_body(request, MessagesRequest, max_body_bytes)
            inner = await chat_response(request, to_chat_request(body), StreamTranslator(body) if body.stream else None)
        except APIError as e:
            return error_response(e)
        return translated_answer(inner, body.stream, lambda chat: to_message(chat, body))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        """`{"input_tokens": N}`: the prompt tokens the request would take (tools and system included)."""
        try:
            check_key(request)
            body = await parse_body(request, MessagesRequest, max_body_bytes)
            rendered = await render_chat(request, to_chat_request(body, count_only=True))
        except APIError as e:
            return error_response(e)
        return JSONResponse({"input_tokens": len(rendered.prompt_ids)})
