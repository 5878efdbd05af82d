"""OpenAI's Responses API over the chat completions path: `POST /v1/responses`, streamed or not
(what the OpenAI Agents SDK and Codex-style clients speak; vLLM serves it too).

As for Anthropic's Messages API (`serving/api/anthropic.py`), a request is translated into a chat
completion request (`to_chat_request`), served by the server's own chat path (chat template,
reasoning and tool-call parsers, structured outputs, sampling, abort on disconnect) and its answer
translated back (`to_response`, or `ResponseStreamTranslator` for the event stream). The two APIs
give the same tokens for the same conversation.

This module translates; the routes and the stored responses (`previous_response_id`, whose
conversation reaches `to_chat_request` as `context` items; retrieval; background runs) are in
`serving/api/responses_routes.py` and `response_store.py`. docs/responses.md has the field table.

Input: a string (one user message) or a list of items — messages (`role` user / system /
developer / assistant; content a string or `input_text` / `output_text` parts), `function_call`
(`call_id`, `name`, `arguments`: the assistant's call) and `function_call_output` (`call_id`,
`output`: the result, a `tool` message), `reasoning` (its `reasoning_text` content becomes the
next assistant turn's `reasoning_content`). `instructions` is a system message first.

Output items: `reasoning` (`content` one `reasoning_text`; `summary` empty), `message` (one
`output_text`) and `function_call` (`call_id` the chat path's `call_…` id, `arguments` JSON).
`status` "completed", or "incomplete" with `incomplete_details.reason` "max_output_tokens" when
the token limit cut the answer (null when the server aborted it, draining). Usage: `input_tokens`
(with `input_tokens_details.cached_tokens`), `output_tokens`, `total_tokens`;
`output_tokens_details.reasoning_tokens` (the chat usage's, counted with a reasoning parser; else 0).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from serving.api.chat_output import REASONING_EFFORTS
from serving.api.errors import APIError
from serving.api.protocol import ChatCompletionRequest
from serving.api.streaming import named_sse_event


class ResponsesRequest(BaseModel):
    """Body of `POST /v1/responses` (other keys are ignored: clients send many optional ones)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    thinking_token_budget: int | None = None  # vLLM's extension, as on chat: tokens inside the think block at most
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param)


def _parts_text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts (`input_text`, `output_text`, `text`) joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: expected a string or a list of content parts.", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise _bad(f"{where}.{j}: a {kind!r} part is not supported (text parts are).", f"{where}.{j}")
        texts.append(part["text"])
    return "\n".join(texts)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message item)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": body.input}]}]
    return list(body.input)


def _chat_messages(body: ResponsesRequest, context: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The chat messages of `instructions`, then the `context` items (a stored conversation's, see
    serving/api/response_store.py) and the input items (see the module docstring)."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str) and not context:
        return [*out, {"role": "user", "content": body.input}]
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they precede

    def assistant_turn(new: bool = False) -> dict[str, Any]:
        """The assistant message an assistant text or call joins: the last one, unless a reasoning
        item came after it (reasoning opens the next turn), something else did, or `new`."""
        nonlocal reasoning
        if reasoning or new or not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": None})
            if reasoning:
                out[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
        return out[-1]

    items = [(f"previous_response_id.{i}", item) for i, item in enumerate(context)]
    items += [(f"input.{i}", item) for i, item in enumerate(input_items(body))]
    for where, item in items:
        if not isinstance(item, dict):
            raise _bad(f"{where}: expected an object.", where)
        kind = item.get("type", "message")
        if kind == "message" and "role" in item:
            role = item["role"]
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad(f"{where}.role: expected user, system, developer or assistant, got {role!r}.",
                           f"{where}.role")
            text = _parts_text(item.get("content", ""), f"{where}.content")
            if role == "assistant":
                last = out[-1] if out else {}
                # a second assistant message after text or calls: a turn of its own
                assistant_turn(new=last.get("role") == "assistant" and bool(last.get("content") or
                                                                         last.get("tool_calls")))["content"] = text
            else:
                reasoning = []  # reasoning with no answer after it belongs to no later turn
                out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str) or not isinstance(
                    item.get("arguments", ""), str):
                raise _bad(f"{where}: a function_call item needs string `call_id`, `name` and `arguments`.", where)
            turn = assistant_turn()
            turn.setdefault("tool_calls", []).append({
                "id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"{where}.call_id: a string is required.", f"{where}.call_id")
            reasoning = []
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_text(item.get("output", ""), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                      for p in parts):
                raise _bad(f"{where}.content: a list of reasoning_text parts with string `text` is expected.",
                           f"{where}.content")
            if parts:
                reasoning.append("\n".join(p["text"] for p in parts))
        else:
            raise _bad(f"{where}: a {kind!r} item is not supported (messages, function_call, function_call_output "
                       "and reasoning are).", f"{where}.type")
    return out


def _chat_tools(body: ResponsesRequest) -> tuple[list[dict[str, Any]] | None, Any]:
    tools = None
    if body.tools is not None:
        tools = []
        for k, t in enumerate(body.tools):
            if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("name"), str):
                kind = t.get("type") if isinstance(t, dict) else None
                raise _bad(f"tools.{k}: only function tools are supported, got type {kind!r}.", f"tools.{k}")
            fn = {"name": t["name"]}
            if t.get("description") is not None:
                fn["description"] = t["description"]
            fn["parameters"] = t.get("parameters") or {"type": "object", "properties": {}}
            tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _bad("tool_choice: expected auto, none, required or {\"type\": \"function\", \"name\": ...}.",
                       "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools, choice


def to_chat_request(body: ResponsesRequest, context: list[dict[str, Any]] = (),
                    stream: bool | None = None) -> ChatCompletionRequest:
    """The chat completion request that serves `body` after the `context` items (the conversation
    of its `previous_response_id`; the route resolves it), streamed when `stream` (default
    `body.stream`). Raises APIError (400) naming what cannot be translated or what this server
    does not do (`top_logprobs`, ...)."""
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise _bad(f"max_output_tokens must be at least 1, got {body.max_output_tokens}.", "max_output_tokens")
    if isinstance(body.input, list) and not body.input:
        raise _bad("input: give at least one item.", "input")
    effort = (body.reasoning or {}).get("effort")
    if isinstance(effort, str):
        effort = effort.strip().lower()  # as the chat route reads it
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _bad(f"reasoning.effort: expected one of {', '.join(REASONING_EFFORTS)}, got {effort!r}.",
                   "reasoning.effort")
    if body.top_logprobs:
        raise _bad("top_logprobs is not supported on /v1/responses (chat completions has logprobs).", "top_logprobs")
    if body.truncation not in (None, "disabled"):
        raise _bad("truncation: only \"disabled\" is supported (a prompt past the context is a 400).", "truncation")
    tools, tool_choice = _chat_tools(body)
    kwargs: dict[str, Any] = {}
    if effort == "none":  # no reasoning: GLM's think block closed in the prompt
        kwargs["enable_thinking"], effort = False, None
    response_format = None
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise _bad("text.format.schema: a json_schema format needs its schema object.", "text.format.schema")
            response_format = {"type": "json_schema", "json_schema": {
                k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
        elif kind == "json_object":
            response_format = {"type": "json_object"}
        elif kind != "text":
            raise _bad("text.format: expected text, json_object or json_schema.", "text.format")
    stream = body.stream if stream is None else stream
    chat: dict[str, Any] = {
        "model": body.model, "messages": _chat_messages(body, context), "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": body.parallel_tool_calls, "reasoning_effort": effort,
        "chat_template_kwargs": kwargs or None, "response_format": response_format, "stream": stream,
        "thinking_token_budget": body.thinking_token_budget,
    }
    if stream:
        chat["stream_options"] = {"include_usage": True}  # the final usage, for response.completed
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise _bad(f"{loc}: {first['msg']}", loc) from None


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    reasoning = int((usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _status(finish: str | None) -> tuple[str, dict[str, Any] | None]:
    if finish == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish in ("stop", "tool_calls"):
        return "completed", None
    return "incomplete", None  # aborted by the server


def response_envelope(body: ResponsesRequest, rid: str, created: int, model: str, store: bool = False) -> dict[str, Any]:
    """The response object's fields that echo the request (`store`: whether it is stored)."""
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "error": None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id, "background": bool(body.background), "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
        "store": store, "temperature": body.temperature, "text": body.text or {"format": {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
        "truncation": "disabled", "user": body.user,
    }


def _reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []}


def _message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def response_id(chat_id: str) -> str:
    """The Responses id of a chat completion's (`chatcmpl-X` → `resp_X`)."""
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def to_response(chat: dict[str, Any], body: ResponsesRequest, store: bool = False) -> dict[str, Any]:
    """A non-streaming chat completion body as a Responses `response` object (`store`: it is stored)."""
    choice = chat["choices"][0]
    msg = choice["message"]
    output: list[dict[str, Any]] = []
    if msg.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs"), msg["reasoning_content"]))
    if msg.get("content") or not msg.get("tool_calls"):
        output.append(_message_item(_new_id("msg"), msg.get("content") or ""))
    for tc in msg.get("tool_calls") or []:
        output.append(_call_item(_new_id("fc"), tc["id"], tc["function"]["name"], tc["function"].get("arguments", "")))
    status, details = _status(choice.get("finish_reason"))
    if status == "incomplete":  # the item being written when the answer was cut
        output[-1]["status"] = "incomplete"
    return {**response_envelope(body, response_id(chat["id"]), chat["created"], chat["model"], store), "status": status,
            "incomplete_details": details, "output": output, "usage": _usage(chat.get("usage"))}


class ResponseStreamTranslator:
    """Chat completion stream chunks (dicts, in order) → Responses API SSE events.

    `response.created` and `response.in_progress` first; one output item per run of reasoning
    (`response.reasoning_text.delta` / `.done`), text (`response.content_part.added`,
    `response.output_text.delta` / `.done`, `response.content_part.done`) or per tool call
    (`response.function_call_arguments.delta` / `.done`), each between its
    `response.output_item.added` and `.done` and closed before the next opens; then
    `response.completed` (or `response.incomplete`) with the whole response. Every event has a
    `sequence_number` from 0. An error chunk becomes an `error` event and ends the stream.

    rid / created: the response's id and creation time (default: from the first chunk's, as the
        non-streamed response's); store: whether it is stored (echoed as `store`);
    sink: called with `(type, event dict, SSE text)` for every event as it is made (the store
        follows a response's progress with it); first_seq: the first event's sequence number (a
        background stream's 0 is its `response.queued`)."""

    def __init__(self, body: ResponsesRequest, rid: str | None = None, created: int | None = None,
                 store: bool = False, sink: Callable[[str, dict[str, Any], str], None] | None = None,
                 first_seq: int = 0) -> None:
        self.body = body
        self.rid, self.created, self.store, self.sink = rid, created, store, sink
        self.seq = first_seq
        self.env: dict[str, Any] | None = None
        self.output: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # its text (reasoning, output text or arguments)
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.failed = False

    def _event(self, kind: str, **data: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        text = named_sse_event(kind, payload)
        if self.sink is not None:
            self.sink(kind, payload, text)
        return text

    def _index(self) -> int:
        return len(self.output)

    def _close(self, status: str = "completed") -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        i, out = self._index(), []
        if item["type"] == "reasoning":
            done = _reasoning_item(item["id"], self.text, status)
            out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                   content_index=0, text=self.text))
        elif item["type"] == "message":
            done = _message_item(item["id"], self.text, status)
            part = done["content"][0]
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                   text=self.text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0,
                                   part=part))
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], self.text, status)
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   name=item["name"], arguments=self.text))
        out.append(self._event("response.output_item.done", output_index=i, item=done))
        self.output.append(done)
        self.text = ""
        return out

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self._close()
        self.open = item
        out.append(self._event("response.output_item.added", output_index=self._index(), item=item))
        if item["type"] == "message":
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._index(),
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                          "logprobs": []}))
        return out

    def _response(self, status: str, details: dict[str, Any] | None = None, output: list | None = None) -> dict:
        return {**self.env, "status": status, "incomplete_details": details,
                "output": self.output if output is None else output, "usage": _usage(self.usage) if self.usage else None}

    def feed(self, chunk: dict[str, Any]) -> list[str]:
        """Events for one chat chunk."""
        if "error" in chunk:
            self.failed = True
            err = chunk["error"]
            return [self._event("error", code=str(err.get("code") or "server_error"), message=err.get("message", ""),
                                param=err.get("param"))]
        out: list[str] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if self.env is None:
            self.env = response_envelope(self.body, self.rid or response_id(chunk["id"]), self.created or chunk["created"],
                                 chunk["model"], self.store)
            start = self._response("in_progress", output=[])
            start["usage"] = None
            out.append(self._event("response.created", response=start))
            out.append(self._event("response.in_progress", response=start))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._open(_reasoning_item(_new_id("rs"), "", status="in_progress"))
                self.text += delta["reasoning_content"]
                out.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                       output_index=self._index(), content_index=0, delta=delta["reasoning_content"]))
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._open(_message_item(_new_id("msg"), None, status="in_progress"))
                self.text += delta["content"]
                out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                       output_index=self._index(), content_index=0, delta=delta["content"], logprobs=[]))
            for tc in delta.get("tool_calls") or []:
                fn = tc.get("function") or {}
                if tc.get("id"):
                    out += self._open(_call_item(_new_id("fc"), tc["id"], fn.get("name", ""), "", status="in_progress"))
                if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
                    self.text += fn["arguments"]
                    out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                           output_index=self._index(), delta=fn["arguments"]))
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> list[str]:
        """The events after the last chunk (none after an error)."""
        if self.failed or self.env is None:
            return []
        status, details = _status(self.finish)
        said = [*self.output, *([self.open] if self.open is not None else [])]
        if any(item["type"] in ("message", "function_call") for item in said):
            out = self._close(status)  # the last item is incomplete when the answer was cut
        else:  # no text and no call: one empty message last, as the non-streamed response has
            out = self._close()
            out += self._open(_message_item(_new_id("msg"), None, status="in_progress"))
            out += self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self._event(kind, response=self._response(status, details)))
        return out

