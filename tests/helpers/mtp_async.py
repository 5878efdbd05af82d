"""Asynchronous scheduling under MTP speculation against the synchronous engine: the trained
`tiny-recall` checkpoint's copy prompts (its MTP drafts are accepted 0 … k times from step to step)
and a driver that runs a workload both ways (tests/serving/test_spec_decode_async.py,
tests/sharding/test_spec_decode_async_parallel.py)."""

from __future__ import annotations

import numpy as np

from glm53 import recall_tasks
from glm53.hub import resolve_model
from glm53.tokenizer import GlmTokenizer
from tests.helpers.engine_drive import drive as drive_events

K = 3  # drafts per step
MAX_MODEL_LEN = 128


def mtp_engine(max_model_len: int = MAX_MODEL_LEN, **kw):
    """An MTP engine (k = `K`) on `tiny-recall`: `max_model_len`, 4 sequences, one 64-token bucket,
    bf16 cache; `kw`: more `EngineArgs` fields."""
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine

    return build_engine(EngineArgs(model=resolve_model("tiny-recall"), max_model_len=max_model_len, max_num_seqs=4,
                                   max_num_batched_tokens=64, cuda_graph_sizes=[], precompile_token_paddings=[],
                                   kv_cache_dtype="bfloat16", compile_progress=False, disable_log_stats=True,
                                   speculative_config={"method": "mtp", "num_speculative_tokens": K}, **kw))


def copy_prompts(n: int, max_len: int = MAX_MODEL_LEN - 60) -> list[list[int]]:
    """n chat-templated "Repeat: …" prompts of 8 items (glm53/recall_tasks.py), each at most
    `max_len` tokens (AssertionError otherwise)."""
    tok = GlmTokenizer.from_pretrained(resolve_model("tiny-recall"))
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 777)
    out = [tok.encode(tok.apply_chat_template(recall_tasks.copy_sample(rng, tok, 8).messages, enable_thinking=False))
           for _ in range(n)]
    assert all(len(p) <= max_len for p in out)
    return out


def copy_conversations(turns: list[int], n_items: int = 12) -> list[list[int]]:
    """One chat-templated conversation per entry of `turns`: that many "Repeat: …" turns of
    `n_items` items, each answered by its span, the last one unanswered (the `copy` training
    sequences' shape, glm53/recall_tasks.py; ≈ 80 tokens a turn)."""
    tok = GlmTokenizer.from_pretrained(resolve_model("tiny-recall"))
    rng = np.random.default_rng(recall_tasks.EVAL_SEED_BASE + 778)
    out = []
    for n in turns:
        msgs = []
        for t in range(n):
            span = recall_tasks.copy_span(rng, n_items)
            msgs.append({"role": "user", "content": f"Repeat: {span}"})
            if t < n - 1:
                msgs.append({"role": "assistant", "content": span})
        out.append(tok.encode(tok.apply_chat_template(msgs, enable_thinking=False)))
    return out


def drive(e, requests: dict, async_scheduling: bool, aborts: dict | None = None, hot_fed: list | None = None):
    """`tests.helpers.engine_drive.drive` of `requests` ({id: (prompt, SamplingParams)}), all added
    before the first `step()`; `aborts` maps a `step()` call index to ids aborted before it. →
    ({id: tokens}, {id: finish reason}, {id: [TokenLogprobs]}, fed steps: the drafts verified in each
    step whose rows came from the step in flight). An asynchronous run must not compile a step
    program: its fed steps run the programs the synchronous run of the same workload used (a fed
    input's sharding is the host input's). `hot_fed`: when given, one bool per fed step is appended
    to it: whether the step ran the HiSparse hot program (some request resolved through a hot
    lease)."""
    events = {0: [("add", rid) for rid in requests]}
    for call, rids in (aborts or {}).items():
        events.setdefault(call, []).extend(("abort", rid) for rid in rids)
    fed = []
    orig = e.runner._spec_inputs

    def spy(placed, steps_B, sp, feed):
        out = orig(placed, steps_B, sp, feed)
        if feed is not None:
            fed.append(int(np.asarray(out[2].num_draft_B).sum()))
            if hot_fed is not None:
                hot_fed.append(placed.hot is not None)
        return out

    e.runner._spec_inputs = spy
    programs = e.runner._step._cache_size()
    try:
        toks, reasons, lps, _ = drive_events(e, requests, async_scheduling, events)
    finally:
        e.runner._spec_inputs = orig
        e.set_async_scheduling(False)
    if async_scheduling:
        assert e.runner._step._cache_size() == programs
    return toks, reasons, lps, fed


def assert_same(sync, asyn):
    """Tokens and finish reasons equal; logprobs within 1e-4 relative: the asynchronous run's batches
    are not the synchronous run's (a request that stopped is computed once more), and a row's last
    bits depend on its batch (docs/async_scheduling.md)."""
    assert asyn[0] == sync[0]
    assert asyn[1] == sync[1]
    for rid, lp in sync[2].items():
        assert [x.token_id for x in asyn[2][rid]] == [x.token_id for x in lp]
        np.testing.assert_allclose([x.logprob for x in asyn[2][rid]], [x.logprob for x in lp], rtol=1e-4, atol=1e-6)
