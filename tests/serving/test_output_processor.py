"""The front end's per-request text state (`serving.output_processor.RequestTextState`) given the
engine's increments of several tokens (MTP speculation emits 1 … k + 1 per step): the output must
be what the same tokens give one at a time (the increments of decoding without speculation) — text,
token ids, logprobs, finish and stop reasons — in particular a stop string completed inside an
increment ends the output at the token that completed it."""

from __future__ import annotations

import pytest

from glm53.tokenizer import GlmTokenizer
from serving.output_processor import RequestTextState
from serving.types import RequestOutput, SamplingParams, TokenLogprobs

TEXT = " the cat sat on the mat and the dog ran off"


@pytest.fixture(scope="module")
def tok():
    from glm53.hub import resolve_model

    return GlmTokenizer.from_pretrained(resolve_model("tiny-recall"))


def run(tok, ids: list[int], sizes: list[int], params: SamplingParams):
    """Feed `ids` in increments of `sizes` (the last one finished, "length") → the state."""
    state = RequestTextState(tok, params)
    pos = 0
    for i, n in enumerate(sizes):
        chunk = ids[pos:pos + n]
        pos += n
        last = i == len(sizes) - 1
        out = RequestOutput("r", chunk, last, "length" if last else None, 5, 0, pos,
                            new_logprobs=[TokenLogprobs(t, -0.5, []) for t in chunk])
        state.add(out)
        if state.finished:
            break
    return state


def split(n: int, pattern: list[int]) -> list[int]:
    """Increment sizes summing to n, cycling through `pattern`."""
    sizes, i = [], 0
    while n > 0:
        sizes.append(min(pattern[i % len(pattern)], n))
        n -= sizes[-1]
        i += 1
    return sizes


@pytest.mark.parametrize("stop", [[" sat"], [" mat and"], ["dog"], ["zebra"]])
@pytest.mark.parametrize("min_tokens", [0, 3])
def test_increments_of_several_tokens_equal_one_at_a_time(tok, stop, min_tokens):
    ids = tok.encode(TEXT)
    params = SamplingParams(stop=stop, logprobs=0, min_tokens=min_tokens, max_tokens=len(ids))
    one = run(tok, ids, [1] * len(ids), params)
    for pattern in ([4], [3, 1, 4, 2], [len(ids)]):
        many = run(tok, ids, split(len(ids), pattern), params)
        assert many.text == one.text
        assert many.token_ids == one.token_ids
        assert [x.token_id for x in many.logprobs] == [x.token_id for x in one.logprobs]
        assert (many.finish_reason, many.stop_reason) == (one.finish_reason, one.stop_reason)
    if stop != ["zebra"] and min_tokens == 0:
        assert one.finish_reason == "stop" and len(one.token_ids) < len(ids)
