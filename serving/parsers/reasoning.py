"""The `glm45` reasoning parser: GLM-4.5+ / GLM-5.x `<think>REASONING</think>CONTENT` output.

What the model writes depends on how the chat template opened the assistant turn (docs/design.md §3.8):

* The GLM-5.3 generation prompt ends with `<|assistant|><think>`, so the output starts inside the
  reasoning and the first `</think>` ends it: `REASONING</think>CONTENT`.
* With `enable_thinking=False` the prompt ends with `<|assistant|><think></think>` and the whole
  output is content.
* Templates that stop at `<|assistant|>` (GLM-4.5 style) leave it to the model to open the block, so
  an output that begins with `<think>` (after optional whitespace) starts reasoning either way.

The server tells the parser which case holds (`prompt_opens_reasoning`, read off the rendered
prompt). An output that never closes the block (cut by `max_tokens`, or a model that forgot) is all
reasoning, as vLLM's reasoning parsers treat it. A `</think>` or `<think>` after the reasoning has
ended is ordinary content. Nothing is stripped here; the API layer trims channel edges.
"""

from __future__ import annotations

from serving.parsers.tags import split_held

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT = "start", "reasoning", "content"


def think_step(phase: str, t: int, opens: bool, start_id: int | None, end_id: int | None) -> tuple[str, bool]:
    """The think block's phase after output token t, as this parser reads the output, on token ids:
    "start" (nothing yet), "reasoning" or "content" (for good: a later `<think>` or `</think>` is
    content). A first `<think>` opens the block; otherwise the first token is reasoning when the
    prompt opened the block (`opens`), content when not; the first `</think>` closes it. Returns
    (phase, whether t is a reasoning token: the tags are not). (Token by token the parser also
    skips whitespace before a first `<think>`; here such a token counts as the block's first.)"""
    if phase == "start":
        if t == start_id:
            return "reasoning", False
        if not opens:
            return "content", False
        phase = "reasoning"
    if phase == "reasoning":
        return ("content", False) if t == end_id else ("reasoning", True)
    return phase, False


def count_reasoning_tokens(token_ids: list[int], opens: bool, start_id: int | None, end_id: int | None) -> int:
    """Generated tokens of the think block (`think_step`): what this parser returns as
    `reasoning_content`, counted on the token ids; an unclosed block counts to the end. (vLLM's
    count, with its fix for a block the chat template opens.)"""
    phase, n = "start", 0
    for t in token_ids:
        phase, counted = think_step(phase, int(t), opens, start_id, end_id)
        n += counted
        if phase == "content":
            break
    return n


class Glm45ReasoningParser:
    """Incremental splitter of model output text into reasoning and content.

    `feed(text)` takes the next text delta (any split, including inside a tag) and returns
    `(reasoning_delta, content_delta)`; within one call reasoning always precedes content.
    `finish()` flushes what was held back. `parse(text)` does both for a whole output. The
    concatenated reasoning deltas equal the text between the (implicit or written) `<think>` and
    the first `</think>`; the concatenated content deltas equal the text after it.
    """

    name = "glm45"

    def __init__(self, prompt_opens_reasoning: bool = True) -> None:
        """`prompt_opens_reasoning`: the prompt ends inside an open `<think>` block."""
        self._state = _START
        self._default = _REASONING if prompt_opens_reasoning else _CONTENT
        self._buf = ""
        self.reasoning_ended = False  # a `</think>` was seen

    @property
    def in_reasoning(self) -> bool:
        """True while the text being fed is (or would default to) reasoning."""
        return self._state == _REASONING or (self._state == _START and self._default == _REASONING)

    def feed(self, text: str) -> tuple[str, str]:
        """Consume a text delta; return the `(reasoning, content)` text it releases."""
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == _START:
                stripped = self._buf.lstrip()
                if stripped.startswith(THINK_START):
                    # An explicit opening tag (and whitespace before it) is markup, not text.
                    self._buf = stripped[len(THINK_START) :]
                    self._state = _REASONING
                elif THINK_START.startswith(stripped):
                    break  # only whitespace or a partial `<think>` so far: wait
                else:
                    self._state = self._default
            elif self._state == _REASONING:
                i = self._buf.find(THINK_END)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf = self._buf[i + len(THINK_END) :]
                    self._state = _CONTENT
                    self.reasoning_ended = True
                else:
                    ready, self._buf = split_held(self._buf, (THINK_END,))
                    reasoning.append(ready)
                    break
            else:
                content.append(self._buf)
                self._buf = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: release held text (an unclosed block stays reasoning)."""
        rest, self._buf = self._buf, ""
        state = self._default if self._state == _START else self._state
        self._state = state
        return (rest, "") if state == _REASONING else ("", rest)

    def parse(self, text: str) -> tuple[str, str]:
        """`(reasoning, content)` of a whole output (a fresh parser's `feed` + `finish`)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2
