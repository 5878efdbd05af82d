"""Front-end output processing shared by the HTTP server and the offline `LLM`: incremental
detokenization, stop strings, accumulated tokens, logprobs and usage of one request.

Stop strings are matched on the detokenized text, host-side. Text is emitted only once it can no
longer be the start of a stop string, so a stream never shows text past a stop, and a stop split
across several tokens (or several stream increments) is still found. The stop string itself is
not part of the output. Once a stop matches, the request is finished with reason "stop" and the
caller must abort it in the engine (`RequestTextState.stopped`). A request the engine ended with a
stop token (EOS or a `stop_token_ids` entry) keeps that token in its token ids but not its text,
as vLLM's detokenizer does (`skip_special_tokens` false would otherwise show `<|endoftext|>`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.detokenize import IncrementalDetokenizer
from serving.types import RequestOutput, SamplingParams, TokenLogprobs


class StopStringMatcher:
    """Finds the first occurrence of any stop string in a growing text.

    `feed(delta)` returns `(emit, stopped)`: the text that is safe to show now and whether a
    stop string was found (then `emit` ends right before it; `matched` is that stop string, the
    first in `stop` among those starting there). Text that could be the beginning of a stop string
    is held back until it is decided; `feed("", final=True)` releases it.
    """

    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self._text = ""
        self._emitted = 0
        self.stopped = False
        self.matched: str | None = None

    def skip(self, delta: str) -> str:
        """Append `delta` without looking for stop strings in it (or in the text held back before
        it) → all of it to show; later matches start after it."""
        self._text += delta
        start, self._emitted = self._emitted, len(self._text)
        return self._text[start:]

    def feed(self, delta: str, final: bool = False) -> tuple[str, bool]:
        """Append `delta`; see the class docstring. After a stop, further input is ignored."""
        if self.stopped:
            return "", True
        self._text += delta
        text, start = self._text, self._emitted
        if not self.stop:
            self._emitted = len(text)
            return text[start:], False
        # Any match starts at or after `start` (earlier starts were held back or already found).
        hits = [(i, s) for s, i in ((s, text.find(s, start)) for s in self.stop) if i >= 0]
        if hits:
            end = min(i for i, _ in hits)
            self.matched = next(s for i, s in hits if i == end)
            self.stopped = True
            self._emitted = end
            return text[start:end], True
        safe = len(text)
        if not final:
            longest = max(len(s) for s in self.stop)
            for p in range(max(start, len(text) - longest + 1), len(text)):
                tail = text[p:]
                if any(s.startswith(tail) for s in self.stop):
                    safe = p
                    break
        self._emitted = safe
        return text[start:safe], False


@dataclass
class TextDelta:
    """What one engine increment adds to a request's visible output."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the increment that brought them


@dataclass
class RequestTextState:
    """Accumulated output of one request (one choice).

    tokenizer: has `decode(ids, skip_special_tokens=...)`. params: the request's sampling
    params (`stop`, `stop_token_ids`, `logprobs`, `skip_special_tokens` are used).

    `stop_reason` (vLLM's): the stop string that ended the output, or the `stop_token_ids` entry
    the engine stopped at; None for EOS, the length limit or an abort.
    """

    tokenizer: Any
    params: SamplingParams
    prompt_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int | None = None
    num_cached_tokens: int = 0
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # `RequestOutput.prompt_logprobs`

    def __post_init__(self) -> None:
        self._detok = IncrementalDetokenizer(self.tokenizer, self.params.skip_special_tokens)
        self._stops = StopStringMatcher(list(self.params.stop or []))

    @property
    def stopped(self) -> bool:
        """True when a stop string ended the output (the engine request must be aborted)."""
        return self._stops.stopped

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated (up to and including the one that completed a stop string)."""
        return len(self.token_ids)

    def add(self, out: RequestOutput) -> TextDelta:
        """Apply one engine increment (ignored once finished)."""
        if self.finished:
            return TextDelta("", [], None, True, self.finish_reason, self.stop_reason)
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_cached_tokens = out.num_cached_tokens
        new = list(out.new_token_ids)
        ids = new
        if out.finished and out.finish_reason == "stop" and ids:
            ids = ids[:-1]  # the stop token: in the token ids, not in the text
        # An increment of several tokens (MTP speculation) is matched a token at a time when stop
        # strings are set, so the output ends at the token that completed one: the tokens after
        # it are not part of the output (ids, logprobs, usage), as without speculation.
        chunks = [[t] for t in ids] if self.params.stop and len(ids) > 1 else [ids]
        base, used, emit, stopped = len(self.token_ids), 0, "", False
        for i, chunk in enumerate(chunks):
            last = i == len(chunks) - 1
            raw = self._detok.step(chunk, final=out.finished and last)
            used += len(chunk)
            if (base + (len(new) if last else used)) <= self.params.min_tokens:
                emit += self._stops.skip(raw)  # no stop string before min_tokens (vLLM's rule)
            else:
                part, stopped = self._stops.feed(raw, final=out.finished and last)
                emit += part
            if stopped:
                break
        kept = used if stopped and used < len(ids) else len(new)  # (a stop token after the text stays)
        new = new[:kept]
        self.token_ids.extend(new)
        new_lps = list(out.new_logprobs[:kept]) if out.new_logprobs else None
        if new_lps:
            self.logprobs.extend(new_lps)
        self.text += emit
        if stopped:
            self.finished, self.finish_reason, self.stop_reason = True, "stop", self._stops.matched
        elif out.finished:
            self.finished, self.finish_reason = True, out.finish_reason
            last = out.new_token_ids[-1] if out.new_token_ids else None
            if out.finish_reason == "stop" and last in (self.params.stop_token_ids or ()):
                self.stop_reason = last
        lps = new_lps if new_lps else ([] if self.params.logprobs is not None else None)
        return TextDelta(emit, new, lps, self.finished, self.finish_reason, self.stop_reason, out.prompt_logprobs)

    def finish(self, reason: str = "abort") -> TextDelta:
        """End the output without a final engine increment (the stream ended early)."""
        if self.finished:
            return TextDelta("", [], None, True, self.finish_reason, self.stop_reason)
        tail = self._detok.step([], final=True)
        emit, stopped = self._stops.feed(tail, final=True)
        self.text += emit
        self.finished = True
        self.finish_reason = "stop" if stopped else reason
        self.stop_reason = self._stops.matched if stopped else None
        return TextDelta(emit, [], None, True, self.finish_reason, self.stop_reason)
