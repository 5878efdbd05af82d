"""The `glm47` tool-call parser: GLM-4.7 / GLM-5.x `<tool_call>` blocks in the content.

Format (docs/design.md §3.8, and the instruction our chat template gives the model):

    <tool_call>NAME<arg_key>K1</arg_key><arg_value>V1</arg_value><arg_key>K2</arg_key>...</tool_call>

A call may have no arguments (`<tool_call>NAME</tool_call>`) and a turn may hold several calls.
Whitespace around the name and between the tags is allowed (GLM-4.5 put newlines there), so the
same parser also reads GLM-4.5 output. Values are typed from the tool's JSON schema
(`serving.parsers.arg_types.coerce_argument`).

Malformed markup never raises: a block that does not parse (no name, a name with spaces or angle
brackets, a key without a value, stray text between arguments, arg tags inside a key or value),
a `<tool_call>` followed by another `<tool_call>` before its `</tool_call>`, and a block still open
when the output ends are all returned as content, verbatim. Calls to tools the request did not
declare are returned as calls (the client decides); their values are parsed as untyped JSON.

Streaming holds back a trailing partial `<tool_call>` and the whole of an open block until its
`</tool_call>` arrives, so a streamed turn yields exactly the calls and content of the same text
parsed at once. Text inside the reasoning is never given to this parser.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from serving.parsers.arg_types import RawNumber, coerce_argument, parameter_schemas
from serving.parsers.tags import split_held

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
ARG_TAGS = ("<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_BAD_NAME = re.compile(r"[\s<>]")


@dataclass(frozen=True)
class ParsedToolCall:
    """One complete tool call: the function `name` and its typed `arguments` object."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def arguments_json(self) -> str:
        """`arguments` as the JSON string OpenAI's `function.arguments` carries (numbers too
        large for a float, `arg_types.RawNumber`, written as the model wrote them)."""
        raws: list[str] = []

        def swap(x):
            if isinstance(x, RawNumber):
                raws.append(str(x))
                return f"\x00raw{len(raws) - 1}\x00"
            if isinstance(x, dict):
                return {k: swap(v) for k, v in x.items()}
            if isinstance(x, list):
                return [swap(v) for v in x]
            return x

        text = json.dumps(swap(self.arguments), ensure_ascii=False, allow_nan=False)
        for i, raw in enumerate(raws):
            text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
        return text


ToolEvent = str | ParsedToolCall  # a content text piece or a complete call, in output order


class Glm47ToolCallParser:
    """Incremental extractor of `<tool_call>` blocks from content text.

    `feed(text)` takes the next content delta and returns the events it completes: content
    strings and `ParsedToolCall`s in output order (consecutive strings merged). `finish()` flushes
    held text at the end of the output. `parse(text)` does both for a whole output.
    """

    name = "glm47"

    def __init__(self, tools: Any = None) -> None:
        """`tools`: the request's OpenAI `tools` list (for argument typing); may be None."""
        self._schemas = parameter_schemas(tools)
        self._buf = ""
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        """Consume a content delta; return the content pieces and calls it completes."""
        self._buf += text
        events: list[ToolEvent] = []
        while self._buf:
            if not self._in_call:
                i = self._buf.find(CALL_START)
                if i < 0:
                    ready, self._buf = split_held(self._buf, (CALL_START,))
                    _add(events, ready)
                    break
                _add(events, self._buf[:i])
                self._buf = self._buf[i + len(CALL_START) :]
                self._in_call = True
                continue
            end = self._buf.find(CALL_END)
            again = self._buf.find(CALL_START)
            if again >= 0 and (end < 0 or again < end):
                # A new block opens before this one closed: this one is not a call.
                _add(events, CALL_START + self._buf[:again])
                self._buf = self._buf[again + len(CALL_START) :]
                continue
            if end < 0:
                break  # hold the open block until `</tool_call>` arrives
            body = self._buf[:end]
            self._buf = self._buf[end + len(CALL_END) :]
            self._in_call = False
            call = self.parse_block(body)
            if call is None:
                _add(events, CALL_START + body + CALL_END)
            else:
                self.num_calls += 1
                events.append(call)
        return events

    def finish(self) -> list[str]:
        """End of output: held text, and an unclosed block verbatim, as content."""
        rest = (CALL_START if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        return [rest] if rest else []

    def parse(self, text: str) -> list[ToolEvent]:
        """All events of a whole output (a fresh parser's `feed` + `finish`)."""
        events = self.feed(text)
        for text in self.finish():
            _add(events, text)
        return events

    def parse_block(self, body: str) -> ParsedToolCall | None:
        """The call written between `<tool_call>` and `</tool_call>`, or None when malformed."""
        first = body.find("<arg_key>")
        name = (body if first < 0 else body[:first]).strip()
        if not name or _BAD_NAME.search(name) or any(t in name for t in ARG_TAGS):
            return None
        schema = self._schemas.get(name, {})
        args: dict[str, Any] = {}
        pos = 0 if first < 0 else first
        while first >= 0:
            m = _ARG.match(body, pos)
            if m is None:
                break
            key, raw = m.group(1).strip(), m.group(2)
            if not key or any(t in key or t in raw for t in ARG_TAGS):
                return None
            args[key] = coerce_argument(raw, schema.get(key))
            pos = m.end()
        if first >= 0 and body[pos:].strip():
            return None
        return ParsedToolCall(name, args)


def _add(events: list[ToolEvent], text: str) -> None:
    """Append content `text`, merging with a preceding content piece; skip empty text."""
    if not text:
        return
    if events and isinstance(events[-1], str):
        events[-1] += text
    else:
        events.append(text)
