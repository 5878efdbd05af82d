"""Incremental detokenization for streamed responses, built on `tokenizer.decode` alone.

A byte-level BPE token can end in the middle of a UTF-8 character; decoding such a prefix yields a
trailing U+FFFD. The detokenizer holds that text back until the character completes (or the
request finishes), so that the concatenated deltas equal the text of the whole output.

Rather than decoding every output id at every step (quadratic in the output length), it decodes a
window that starts at the last position where text was emitted (`prefix_offset`) and emits what
the newly read tokens add to it; for a byte-level BPE tokenizer the concatenation of the deltas is
exactly `decode(all_ids)`.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT_CHAR = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Usage: call `step(new_ids)` for every engine increment and send the returned text; on the last
    increment call `step(new_ids, final=True)`, which also flushes held-back text (including an
    incomplete trailing character, as U+FFFD).
    """

    def __init__(self, tokenizer: _Decoder, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # the window's text up to this token is already emitted
        self._held_emitted = 0  # characters emitted beyond that while a character is incomplete
        self.text = ""  # everything emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def step(self, new_token_ids: list[int], final: bool = False) -> str:
        """Append `new_token_ids` and return the text they complete (possibly "")."""
        self.token_ids.extend(new_token_ids)
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window_text = self._decode(self.token_ids[self._prefix_offset :])
        incomplete = not final and window_text.endswith(_REPLACEMENT_CHAR)
        visible = window_text.rstrip(_REPLACEMENT_CHAR) if incomplete else window_text
        delta = visible[len(prefix_text) + self._held_emitted :]
        if incomplete:
            # Emit the complete characters, keep the window open until the last one completes.
            self._held_emitted += len(delta)
        else:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self._held_emitted = 0
        self.text += delta
        return delta
