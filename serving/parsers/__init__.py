"""Output parsers for GLM chat responses, by vLLM's names.

* reasoning parsers (`--reasoning-parser`): `glm45` -> `Glm45ReasoningParser`
  (`<think>…</think>` reasoning, serving/parsers/reasoning.py);
* tool-call parsers (`--tool-call-parser`): `glm47` -> `Glm47ToolCallParser`
  (`<tool_call>NAME<arg_key>…</arg_key><arg_value>…</arg_value></tool_call>`,
  serving/parsers/tool_calls.py). `glm45` names the same parser: it accepts GLM-4.5's newlines
  between the tags.

Both are incremental: they take text deltas split anywhere (also inside a tag) and hold back
only what could still be part of a tag or of an unfinished call. They import nothing of the
HTTP layer; `serving.api.chat_output` turns their events into OpenAI messages and deltas.
"""

from serving.parsers.reasoning import Glm45ReasoningParser
from serving.parsers.tool_calls import Glm47ToolCallParser, ParsedToolCall

REASONING_PARSERS: dict[str, type[Glm45ReasoningParser]] = {"glm45": Glm45ReasoningParser}
TOOL_CALL_PARSERS: dict[str, type[Glm47ToolCallParser]] = {
    "glm47": Glm47ToolCallParser,
    "glm45": Glm47ToolCallParser,
}

__all__ = [
    "REASONING_PARSERS",
    "TOOL_CALL_PARSERS",
    "Glm45ReasoningParser",
    "Glm47ToolCallParser",
    "ParsedToolCall",
]
