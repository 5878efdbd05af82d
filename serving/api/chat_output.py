"""Chat output parsing for the API: reasoning, tool calls and content of one chat completion.

The server builds one `ChatParsing` from its flags (`--reasoning-parser`, `--tool-call-parser`,
`--enable-auto-tool-choice`). For each chat request:

    prepared = parsing.prepare(body)          # validates tools / tool_choice / reasoning_effort
    prompt = tokenizer.apply_chat_template(messages, tools=prepared.tools, ...)
    output = prepared.new_output(prompt)      # one per choice
    output.deltas(text, finish)               # streaming: (DeltaMessage, finish_reason) pairs
    output.message(text, finish)              # or, for the whole text: (message, finish_reason)

Request rules (anything else is a 400 naming the field, raised as `ChatRequestError`):

* `tools`: OpenAI function tools, `{"type": "function", "function": {"name", "description"?,
  "parameters"?}}`; an empty list means none.
* `tool_choice`: `"auto"` (the default when tools are given) needs a server started with
  `--enable-auto-tool-choice --tool-call-parser glm47`; the model then decides and its
  `<tool_call>` blocks become `tool_calls`. `"none"` leaves the tools out of the prompt (as vLLM's
  `--exclude-tools-when-tool-choice-none`) and parses no calls. `"required"` and a named function
  constrain the output to glm47 tool calls (any of the tools, or the named one; one call when
  `parallel_tool_calls` is false or a function is named) whose arguments match the tool's
  parameter schema (`serving.structured_outputs.tool_grammar`); they need no server flag.
* `parallel_tool_calls: false`: only the first parsed call is returned (later ones are dropped).
* `reasoning_effort`: none, minimal, low, medium, high, xhigh or max (case-insensitive); the chat
  template maps them to GLM's Low/High/Max. Thinking itself is switched off with
  `chat_template_kwargs: {"enable_thinking": false}`.

Output rules. With no parser in play (no reasoning parser, no tool parsing for this request) the
text is returned as `content` unchanged. Otherwise:

* the reasoning parser (when configured) splits the text into `reasoning_content` and the rest;
  whether the output starts inside the reasoning is read off the rendered prompt (it ends with
  an open `<think>`), so `enable_thinking=false` and templates that let the model open the block
  both work;
* the tool parser (when tools are in play) takes `<tool_call>` blocks out of the rest;
* each of the two text channels has its surrounding whitespace trimmed (the chat template strips
  both when it renders the turn back into a prompt); in a stream, trailing whitespace is held
  until more text follows it, so the concatenated deltas equal the non-streamed message;
* `content` (and `reasoning_content`) is null when empty and the turn has reasoning or calls;
* `finish_reason` becomes `"tool_calls"` when calls were parsed and the model stopped by itself
  (a `"length"` or `"abort"` finish is kept: the output was cut).

Streamed tool calls follow OpenAI's chunk shape: a first delta with `index`, `id`, `type` and
`function.name` (and empty `arguments`), then one with `function.arguments` (the whole JSON
object; a call is sent once its `</tool_call>` has arrived).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving.api.protocol import (
    ChatCompletionMessage,
    ChatCompletionRequest,
    DeltaMessage,
)
from serving.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    Glm45ReasoningParser,
    Glm47ToolCallParser,
    ParsedToolCall,
)
from serving.parsers.reasoning import THINK_START

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


class ChatRequestError(ValueError):
    """A chat request that the output-parsing rules refuse; `param` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ChatParsing:
    """Server-wide output parsing settings.

    reasoning_parser: a `serving.parsers.REASONING_PARSERS` name ("glm45") or None.
    tool_call_parser: a `serving.parsers.TOOL_CALL_PARSERS` name ("glm47") or None.
    enable_auto_tool_choice: let the model decide to call tools (`tool_choice="auto"`).
    Raises ValueError for an unknown parser name, or auto tool choice without a tool parser.
    """

    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {self.reasoning_parser!r} (known: {sorted(REASONING_PARSERS)})"
            )
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"unknown tool call parser {self.tool_call_parser!r} (known: {sorted(TOOL_CALL_PARSERS)})"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser")

    def prepare(self, body: ChatCompletionRequest) -> PreparedChat:
        """Check the request's `tools`, `tool_choice` and `reasoning_effort` against these
        settings; raise `ChatRequestError` (a 400) when they cannot be honoured."""
        effort = body.reasoning_effort
        if effort is not None and effort.strip().lower() not in REASONING_EFFORTS:
            raise ChatRequestError(
                f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}.",
                "reasoning_effort",
            )
        tools = _check_tools(body.tools)
        choice = body.tool_choice
        if isinstance(choice, Mapping) or choice == "required":
            return self._forced_tool_calls(body, tools, choice)
        if choice not in (None, "auto", "none"):
            raise ChatRequestError(f'tool_choice must be "auto", "none", "required" or a named function, got '
                                   f'{choice!r}.', "tool_choice")
        if not tools or choice == "none":
            return PreparedChat(self, tools=None, parse_tools=False, max_calls=None)
        if not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise ChatRequestError(
                '"auto" tool choice requires the server to be started with --enable-auto-tool-choice '
                "and --tool-call-parser.",
                "tool_choice",
            )
        max_calls = 1 if body.parallel_tool_calls is False else None
        return PreparedChat(self, tools=tools, parse_tools=True, max_calls=max_calls)


    def _forced_tool_calls(self, body: ChatCompletionRequest, tools, choice) -> PreparedChat:
        """`tool_choice` "required" or `{"type": "function", "function": {"name": ...}}`: the output
        is constrained to glm47 tool calls (`serving.structured_outputs.tool_grammar`), parsed with
        the glm47 parser whatever `--tool-call-parser` says."""
        from serving.structured_outputs.tool_grammar import tool_call_lark

        if not tools:
            raise ChatRequestError("tool_choice \"required\" or a named function needs tools.", "tool_choice")
        name = None
        if isinstance(choice, Mapping):
            fn = choice.get("function")
            if choice.get("type", "function") != "function" or not isinstance(fn, Mapping) \
                    or not isinstance(fn.get("name"), str):
                raise ChatRequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}.',
                                       "tool_choice")
            name = fn["name"]
        parallel = body.parallel_tool_calls is not False and name is None
        _check_tool_schemas(tools, name)
        try:
            grammar = tool_call_lark(tools, name, parallel)
        except ValueError as e:
            raise ChatRequestError(str(e), "tool_choice") from None
        return PreparedChat(self, tools=tools, parse_tools=True, max_calls=None if parallel else 1,
                            tool_grammar=grammar)


def _check_tools(tools: Any) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if tool.get("type", "function") != "function":
            raise ChatRequestError(f'{where}.type must be "function", got {tool.get("type")!r}.', "tools")
        fn = tool.get("function")
        if not isinstance(fn, Mapping):
            raise ChatRequestError(f"{where}.function must be an object.", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise ChatRequestError(f"{where}.function.name must be a non-empty string.", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise ChatRequestError(f"{where}.function.parameters must be a JSON schema object.", "tools")
        kind = (params or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            # the arguments are a JSON object (OpenAI's API refuses such a schema the same way)
            raise ChatRequestError(f'{where}.function.parameters must be a JSON schema of type "object", got type '
                                   f"{kind!r}.", "tools")
    return list(tools)


def _check_tool_schemas(tools: list[dict[str, Any]], name: str | None) -> None:
    """A forced tool call's grammar embeds only the parameters' property schemas, so each tool the
    call may name has its whole `parameters` schema compiled here: an invalid one (`{"type":
    "bogus"}`) is a 400 naming `tools`, as an invalid `structured_outputs.json` is."""
    from serving.structured_outputs.params import (
        StructuredOutputsError,
        json_schema_error,
    )

    for i, tool in enumerate(tools):
        fn = tool["function"]
        if name is not None and fn["name"] != name or not fn.get("parameters"):
            continue
        try:
            err = json_schema_error(fn["parameters"])
        except StructuredOutputsError as e:
            err = str(e)
        if err:
            raise ChatRequestError(f"tools[{i}].function.parameters is not a valid JSON schema: {err}", "tools")


@dataclass(frozen=True)
class PreparedChat:
    """A validated chat request's parsing plan: `tools` to render, whether to parse calls, and
    how many calls to return at most (None: all)."""

    parsing: ChatParsing
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    max_calls: int | None = None
    tool_grammar: str | None = None  # a forced tool_choice's Lark grammar (structured outputs)

    def opens_reasoning(self, prompt: str) -> bool:
        """The rendered prompt ends inside an open `<think>` block."""
        return prompt.rstrip().endswith(THINK_START)

    def new_output(self, prompt: str) -> ChatOutput:
        """A fresh output parser for one choice; `prompt` is the rendered prompt text."""
        opens = self.opens_reasoning(prompt)
        reasoning = self.parsing.reasoning_parser
        return ChatOutput(
            reasoning=REASONING_PARSERS[reasoning](opens) if reasoning else None,
            tool_parser=TOOL_CALL_PARSERS[self.parsing.tool_call_parser or "glm47"](self.tools)
            if self.parse_tools
            else None,
            max_calls=self.max_calls,
        )


class _EdgeTrim:
    """Trims one text channel's leading and trailing whitespace as its text streams by."""

    def __init__(self) -> None:
        self.started = False
        self._held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        return body


class ChatOutput:
    """Turns one choice's output text into reasoning, content and tool calls (see module doc).

    Feed it either incrementally (`deltas`) or once (`message`), not both.
    """

    def __init__(
        self,
        reasoning: Glm45ReasoningParser | None = None,
        tool_parser: Glm47ToolCallParser | None = None,
        max_calls: int | None = None,
    ) -> None:
        """`reasoning`: a reasoning parser or None; `tool_parser`: a tool-call parser or None;
        `max_calls`: calls past this many are dropped (None: keep all)."""
        self._max_calls = max_calls
        self._reasoning = reasoning
        self._tools = tool_parser
        self._raw = reasoning is None and tool_parser is None
        self._trim_reasoning = _EdgeTrim()
        self._trim_content = _EdgeTrim()
        self._calls: list[tuple[str, ParsedToolCall]] = []

    # ------------------------------------------------------------------ events
    def _events(self, text: str, final: bool) -> list[tuple[str, Any]]:
        """("reasoning" | "content", text) and ("call", (index, id, ParsedToolCall)) in output order."""
        if self._raw:
            return [("content", text)] if text else []
        if self._reasoning is not None:
            r, c = self._reasoning.feed(text)
            if final:
                r2, c2 = self._reasoning.finish()
                r, c = r + r2, c + c2
        else:
            r, c = "", text
        out: list[tuple[str, Any]] = []
        r = self._trim_reasoning.push(r)
        if r:
            out.append(("reasoning", r))
        if self._tools is None:
            pieces: list[Any] = [c] if c else []
        else:
            pieces = self._tools.feed(c)
            if final:
                pieces += self._tools.finish()
        for p in pieces:
            if isinstance(p, str):
                p = self._trim_content.push(p)
                if p:
                    if out and out[-1][0] == "content":
                        out[-1] = ("content", out[-1][1] + p)
                    else:
                        out.append(("content", p))
            elif self._max_calls is None or len(self._calls) < self._max_calls:
                call_id = f"call_{uuid.uuid4().hex[:24]}"
                out.append(("call", (len(self._calls), call_id, p)))
                self._calls.append((call_id, p))
        return out

    def _finish_reason(self, finish: str | None) -> str | None:
        if finish == "stop" and self._calls:
            return "tool_calls"
        return finish

    # ------------------------------------------------------------------ streaming
    def deltas(self, text: str, finish: str | None = None) -> list[tuple[DeltaMessage, str | None]]:
        """Stream deltas for the next output `text`; `finish` (the engine's finish reason) marks
        the last call and flushes everything held. Returns `(delta, finish_reason)` pairs, the
        finish reason set on the last pair only; [] when nothing can be sent yet."""
        out: list[tuple[DeltaMessage, str | None]] = []
        for kind, value in self._events(text, final=finish is not None):
            if kind == "reasoning":
                out.append((DeltaMessage(reasoning_content=value), None))
            elif kind == "content":
                out.append((DeltaMessage(content=value), None))
            else:
                index, call_id, call = value
                head = {"index": index, "id": call_id, "type": "function",
                        "function": {"name": call.name, "arguments": ""}}
                args = {"index": index, "function": {"arguments": call.arguments_json}}
                out.append((DeltaMessage(tool_calls=[head]), None))
                out.append((DeltaMessage(tool_calls=[args]), None))
        if finish is not None:
            reason = self._finish_reason(finish)
            if out:
                out[-1] = (out[-1][0], reason)
            else:
                out.append((DeltaMessage(), reason))
        return out

    # ------------------------------------------------------------------ whole output
    def message(self, text: str, finish: str) -> tuple[ChatCompletionMessage, str]:
        """The non-streamed message for the whole output `text` and the finish reason to report."""
        if self._raw:
            return ChatCompletionMessage(content=text), finish
        reasoning: list[str] = []
        content: list[str] = []
        for kind, value in self._events(text, final=True):
            if kind == "reasoning":
                reasoning.append(value)
            elif kind == "content":
                content.append(value)
        tool_calls = [
            {"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments_json}}
            for cid, c in self._calls
        ]
        r = "".join(reasoning)
        c = "".join(content)
        has_more = bool(r) or bool(tool_calls)
        return (
            ChatCompletionMessage(
                content=c if c or not has_more else None,
                reasoning_content=r or None,
                tool_calls=tool_calls,
            ),
            self._finish_reason(finish),
        )
