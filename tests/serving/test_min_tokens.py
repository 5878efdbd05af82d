"""`serving.min_tokens`: which bits of the step's allowed-token masks a `min_tokens` request clears
(checked bit by bit against the ids it names)."""

from types import SimpleNamespace

import numpy as np

from serving.min_tokens import apply_min_tokens
from serving.types import SamplingParams

EOS = (7, 40)
W = 2  # 64 ids


def row(min_tokens, emitted=0, placeholders=0, spec=0, sample=True, **kw):
    req = SimpleNamespace(sampling_params=SamplingParams(min_tokens=min_tokens, **kw),
                          output_token_ids=[1] * emitted, num_output_placeholders=placeholders)
    return SimpleNamespace(request=req, sample=sample, num_spec_tokens=spec)


def allowed(mask_W):
    return set(np.flatnonzero(np.unpackbits(np.asarray(mask_W).view(np.uint8), bitorder="little")).tolist())


def test_the_ids_are_cleared_until_min_tokens_and_nowhere_else():
    sched = SimpleNamespace(scheduled=[
        row(3, emitted=1, stop_token_ids=[33]),        # 1 emitted: its next token (index 1) is banned
        row(3, emitted=2, placeholders=1),             # 3 emitted counting the one in flight: free
        row(5, ignore_eos=True, stop_token_ids=[2]),   # ignore_eos: only its stop id
        row(2, sample=False),                          # a prefill chunk that samples nothing
        row(0),
        row(3, emitted=1, spec=2),                     # verification rows 0, 1 banned, row 2 free
    ])
    out = apply_min_tokens(sched, None, 7, 3, W, EOS)
    everything = set(range(64))
    assert allowed(out[0, 0]) == everything - {7, 40, 33}
    assert allowed(out[1, 0]) == everything
    assert allowed(out[2, 0]) == everything - {2}
    assert allowed(out[3, 0]) == allowed(out[4, 0]) == allowed(out[6, 0]) == everything
    assert [allowed(out[5, j]) for j in range(3)] == [everything - {7, 40}, everything - {7, 40}, everything]
    # a position whose grammar already allows only the banned ids keeps them
    grammar = np.zeros((7, 3, W), np.int32)
    grammar[0, 0, 0] = 1 << 7
    assert allowed(apply_min_tokens(sched, grammar, 7, 3, W, EOS)[0, 0]) == {7}


def test_no_mask_without_a_ban():
    sched = SimpleNamespace(scheduled=[row(0), row(2, emitted=2)])
    assert apply_min_tokens(sched, None, 3, 1, W, EOS) is None
    grammar = np.full((3, 1, W), -1, np.int32)
    assert apply_min_tokens(sched, grammar, 3, 1, W, EOS) is grammar
