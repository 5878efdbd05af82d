"""The offline `LLM` on the embedded tiny checkpoint, sharing the engine with the server:
logprobs against a numpy log-softmax of `glm53.api.forward` logits, prefix-cache hits against the
uncached run, n / seeds, stop strings, chat, metrics and the start-up sizing.

The engine settings equal those of test_e2e_server, so the compiled step buckets come from the
persistent compilation cache when both modules run."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.engine import CPU_KV_CACHE_BYTES, EngineArgs, num_kv_blocks
from serving.llm import LLM
from serving.metrics import LoggingStatLogger, PrometheusStatLogger, StepRecord
from serving.types import SamplingParams

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

ENGINE = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True,
              cuda_graph_sizes=[], precompile_token_paddings=[])


@pytest.fixture(scope="module")
def llm():
    llm = LLM(**ENGINE)
    llm.metrics = PrometheusStatLogger("tiny", llm.engine.gauges)
    llm.engine.stat_loggers.append(llm.metrics)
    yield llm
    assert llm.engine.audit() == []
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_free == llm.engine.pool.num_usable_blocks, "KV pages leaked"


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_are_the_log_softmax_of_the_model_logits(llm):
    """Over the tokenizer's ids: the checkpoint's padding rows (ids 496..511 of its 512) are never
    sampled nor reported (serving.sampling.mask_unreachable, docs/reliability.md)."""
    from glm53 import api
    from glm53.tiny_checkpoint import default_model_dir
    from glm53.tokenizer import tokenizer_vocab_size

    prompt = list(range(10, 26))
    out = llm.generate([prompt], greedy(max_tokens=5, logprobs=4))[0].outputs[0]
    toks = out.token_ids
    n = tokenizer_vocab_size(default_model_dir())
    ref = log_softmax(api.forward(api.load(), prompt + toks[:-1])[:, :n])[len(prompt) - 1:]
    assert len(out.logprobs) == len(toks) == 5
    for row, tok, lp in zip(ref, toks, out.logprobs):
        # fp32 on both sides; the engine prefills in a different step layout, so the sums are
        # reduced in another order: 1e-4 absolute covers that rounding for logits of order 10.
        assert tok == int(np.argmax(row)) and lp.token_id == tok
        assert abs(lp.logprob - row[tok]) < 1e-4
        top = np.argsort(-row, kind="stable")[:4]
        assert [t for t, _ in lp.top] == top.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], row[top], atol=1e-4)
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))


def test_prefix_cache_hit_skips_compute_and_matches_the_uncached_run(llm):
    engine = llm.engine
    prompt = np.random.default_rng(1).integers(10, 450, 800).tolist()
    params = greedy(max_tokens=4, logprobs=3)
    hits = llm.metrics.prefix_hits._value.get()
    s0 = engine.num_steps
    cold = llm.generate([prompt], params)[0]
    s1 = engine.num_steps
    warm = llm.generate([prompt], params)[0]
    s2 = engine.num_steps
    assert llm.metrics.prefix_hits._value.get() - hits == 768  # vllm:prefix_cache_hits counts tokens
    # 799 usable tokens -> 768 (hits in 64-token units); 768 is a whole indexer page: no copy.
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 768
    assert s1 - s0 == 13 + 3  # 800 tokens in 64-token chunks, then 3 decodes
    assert s2 - s1 == 1 + 3  # only the 32 uncached tokens are prefilled
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    for a, b in zip(warm.outputs[0].logprobs, cold.outputs[0].logprobs):
        assert a.top[0][0] == b.top[0][0]
        assert abs(a.logprob - b.logprob) < 1e-4  # same fp32 maths, other chunking
    assert engine.audit() == []


def test_partial_page_hits_copy_on_write_and_match_the_uncached_run(llm):
    """Hits of 64, 128 and 832 tokens end inside a 768-token indexer page that a running request
    still fills: each new request gets a device copy of that page (three copies in one step) and
    produces the tokens and logprobs of its uncached run."""
    engine = llm.engine
    stem = np.random.default_rng(7).integers(10, 450, 900).tolist()
    params = greedy(max_tokens=3, logprobs=5)
    engine.add_request("stem", stem, greedy(max_tokens=100))
    while engine.scheduler.get_request("stem").num_output_tokens == 0:
        engine.step()
    prompts = {n: stem[:n] + [5 + n % 7] * 8 for n in (64, 128, 832)}
    copies, hits = engine.runner.num_page_copies, engine.prefix_cache.hits
    for n, p in prompts.items():
        engine.add_request(f"warm{n}", p, params)
    warm: dict[str, list] = {}
    first = True
    while any(engine.scheduler.get_request(f"warm{n}") for n in prompts):
        for out in engine.step():
            warm.setdefault(out.request_id, []).extend(out.new_logprobs or [])
        if first:  # all three admitted in the first step, each copying the stem's indexer page
            assert engine.runner.num_page_copies - copies == 3
            first = False
    engine.abort("stem")
    assert engine.prefix_cache.hits - hits == 64 + 128 + 832
    for n, p in prompts.items():
        engine.prefix_cache.reset()  # every page is free now: nothing stays cached
        cold = llm.generate([p], params)[0]
        assert cold.num_cached_tokens == 0
        got = warm[f"warm{n}"]
        assert [lp.token_id for lp in got] == cold.outputs[0].token_ids
        for a, b in zip(got, cold.outputs[0].logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            np.testing.assert_allclose([v for _, v in a.top], [v for _, v in b.top], atol=1e-4)  # other chunking
    assert engine.audit() == []


def test_n_choices_and_seeds(llm):
    g = llm.generate("Hello there", greedy(max_tokens=6, n=2))[0].outputs
    assert len(g) == 2 and g[0].token_ids == g[1].token_ids and len(g[0].token_ids) == 6
    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=2, seed=5)
    a = llm.generate("Hello there", sampled)[0].outputs
    b = llm.generate("Hello there", sampled)[0].outputs
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # reproducible
    assert a[0].token_ids != a[1].token_ids  # independent samples
    alone = llm.generate("Hello there", SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=6))
    assert alone[0].outputs[0].token_ids == a[1].token_ids  # choice 1 samples with seed + 1


def test_stop_strings_end_the_output_before_the_match(llm):
    prompt = [30, 31, 32, 33]
    full = llm.generate([prompt], greedy(max_tokens=16))[0].outputs[0]
    text = full.text
    # A stop string made of the last character of one token's text and the first of the next.
    stop = None
    for k in range(1, len(full.token_ids)):
        head = llm.tokenizer.decode(full.token_ids[:k])
        cut = len(head)
        cand = text[cut - 1: cut + 1]
        if 0 < cut < len(text) and text.startswith(head) and len(cand) == 2 and "\ufffd" not in cand \
                and text.index(cand) == cut - 1:
            stop = cand
            break
    assert stop is not None
    before = _samples(llm)
    out = llm.generate([prompt], greedy(max_tokens=16, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    after = _samples(llm)
    for reason, n in (("stop", 1), ("abort", 0), ("length", 0)):  # the engine request is aborted at the stop
        key = ("vllm:request_success_total", (("finished_reason", reason), ("model_name", "tiny")))
        assert after.get(key, 0) - before.get(key, 0) == n, reason
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 16
    short = llm.generate([prompt], greedy(max_tokens=3))[0].outputs[0]
    assert (short.finish_reason, short.stop_reason) == ("length", None)
    # A stop token id: the engine stops at it (kept in the token ids, not in the text), named as stop_reason
    at = full.token_ids[2]
    k = full.token_ids.index(at)
    out = llm.generate([prompt], greedy(max_tokens=16, stop_token_ids=[at]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", at, full.token_ids[:k + 1])


def test_chat_renders_the_chat_template(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    chat = llm.chat(msgs, greedy(max_tokens=4))[0]
    rendered = llm.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert chat.prompt == rendered and "Be brief." in rendered
    assert chat.prompt_token_ids == llm.tokenizer.encode(rendered)
    by_ids = llm.generate([llm.tokenizer.encode(rendered)], greedy(max_tokens=4))[0]
    assert chat.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_bad_requests_leave_nothing_queued(llm):
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["a", "b"], greedy(max_tokens=2, logprobs=10_000))
    with pytest.raises(ValueError, match="maximum context"):
        llm.generate([[1] * 1024], greedy(max_tokens=2))
    # Wrong types are refused by name, not compared, rounded (max_tokens 4.5 ran 5 tokens) or
    # left to a TypeError deep inside
    for bad, field in ((dict(max_tokens="4"), "max_tokens"), (dict(max_tokens=4.5), "max_tokens"),
                       (dict(temperature=None), "temperature"), (dict(n=2.5), "n"),
                       (dict(stop_token_ids=["x"]), "stop_token_ids"), (dict(seed=1.5), "seed")):
        with pytest.raises(ValueError, match=field):
            llm.generate(["a", "b"], SamplingParams(**{"temperature": 0.0, **bad}))
    for prompts, match in (([{"foo": 1}], "'prompt' or 'prompt_token_ids'"), ([[1, 2.5]], "token ids"),
                           (np.zeros((1, 2, 2), np.int32), "1-D")):
        with pytest.raises(ValueError, match=match):
            llm.generate(prompts, greedy(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_numpy_prompts_are_token_id_prompts(llm):
    ids = [30, 31, 32, 33]
    want = llm.generate([ids], greedy(max_tokens=3))[0].outputs[0].token_ids
    for prompts in (np.array(ids), [np.int64(t) for t in ids], np.array([ids, ids]), [np.array(ids)]):
        outs = llm.generate(prompts, greedy(max_tokens=3))
        assert [o.outputs[0].token_ids for o in outs] == [want] * len(outs) and outs[0].prompt_token_ids == ids


def _samples(llm) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(llm.metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_what_the_engine_did(llm):
    m = {"model_name": "tiny"}
    lab = (("model_name", "tiny"),)
    before = _samples(llm)
    prompts = [[40 + i] * (5 + i) for i in range(3)]
    outs = llm.generate(prompts, greedy(max_tokens=3))
    outs += llm.generate([[50, 51, 52]], SamplingParams(temperature=0, max_tokens=3))  # may stop early
    after = _samples(llm)

    def delta(name, labels=lab):
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    n_gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert delta("vllm:generation_tokens_total") == n_gen
    assert delta("vllm:prompt_tokens_total") == 5 + 6 + 7 + 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 4
    assert delta("vllm:time_to_first_token_seconds_count") == 4
    assert delta("vllm:inter_token_latency_seconds_count") == n_gen - 4
    reasons = [o.outputs[0].finish_reason for o in outs]
    for r in ("stop", "length"):
        key = tuple(sorted({**m, "finished_reason": r}.items()))
        assert delta("vllm:request_success_total", key) == reasons.count(r)
    assert delta("vllm:prefix_cache_queries_total") == 5 + 6 + 7 + 3
    assert after[("vllm:num_requests_running", lab)] == 0
    assert after[("vllm:num_requests_waiting", lab)] == 0
    assert after[("vllm:kv_cache_usage_perc", lab)] == 0.0  # cached pages are free pages


def test_stat_loggers_on_records(caplog):
    from serving.metrics import EngineGauges, FinishedRequestStats

    gauges = EngineGauges(lambda: 2, lambda: 1, lambda: 0.25)
    prom = PrometheusStatLogger("m", gauges)
    rec = StepRecord(num_preemptions=2, num_prompt_tokens=7, num_generation_tokens=3, ttft_s=[0.5],
                     finished=[FinishedRequestStats("abort", 1.0, 7, 3, 0.1)], host_s=0.001, device_s=0.003)
    prom.record(rec)
    text = prom.render().decode()
    assert 'vllm:num_preemptions_total{model_name="m"} 2.0' in text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="m"} 1.0' in text
    assert 'vllm:num_requests_running{model_name="m"} 2.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    log = LoggingStatLogger(gauges, interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="serving.metrics"):
        log.record(rec)
    line = caplog.records[-1].getMessage()
    assert "Running: 2 reqs" in line and "Waiting: 1 reqs" in line and "Preemptions: 2" in line
    assert "host overhead 1.00 ms/step (25% of step time)" in line


class _Device:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_kv_arena_sizing():
    page = 1 << 20
    args = EngineArgs(gpu_memory_utilization=0.5)
    # 16 GiB x 0.5 - 3 GiB in use (weights included) = 5 GiB of 1 MiB pages.
    assert num_kv_blocks(page, args, _Device({"bytes_limit": 16 << 30, "bytes_in_use": 3 << 30}), 2 << 30) == 5120
    # No usage reported: the weights are subtracted instead.
    assert num_kv_blocks(page, args, _Device({"bytes_limit": 16 << 30}), 2 << 30) == 6144
    assert num_kv_blocks(page, args, _Device(None), 2 << 30) == CPU_KV_CACHE_BYTES // page
    assert num_kv_blocks(page, EngineArgs(num_gpu_blocks_override=7), _Device(None), 0) == 7
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        num_kv_blocks(page, args, _Device({"bytes_limit": 4 << 30, "bytes_in_use": 3 << 30}), 0)
    with pytest.raises(ValueError, match="num-gpu-blocks-override"):
        num_kv_blocks(page, EngineArgs(num_gpu_blocks_override=1), _Device(None), 0)


def test_constructor_arguments_are_checked_by_name():
    from glm53.tiny_checkpoint import default_model_dir

    with pytest.raises(ValueError, match=r"dtype 'float16' is not supported; choose one of auto, bfloat16, float32"):
        LLM(**ENGINE, dtype="float16")
    with pytest.raises(TypeError, match="tokenizer must be a directory or an object with encode and decode, got int"):
        LLM(**ENGINE, tokenizer=123)
    llm = LLM(**ENGINE, tokenizer=str(default_model_dir()))  # a directory, as vLLM takes it
    out = llm.generate(["hello"], greedy(max_tokens=3))[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == llm.tokenizer.decode(out.token_ids)


def test_default_sampling_params_come_from_the_generation_config(llm, monkeypatch):
    """vLLM's `get_default_sampling_params`: the checkpoint's generation_config.json (the tiny
    one's temperature 1.0 and top_p 0.95); `generate` without `SamplingParams` uses them."""
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.min_p, d.max_tokens) == (1.0, 0.95, 0, 0.0, SamplingParams().max_tokens)
    monkeypatch.setattr(llm, "_generation_defaults", {"temperature": 0.0, "max_tokens": 3})
    out = llm.generate(["hello"])[0].outputs[0]
    assert out.token_ids == llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids
    assert len(out.token_ids) <= 3


def test_min_tokens_bans_the_stop_ids_until_then(llm):
    """A stop token id the greedy stream reaches at position p ends it there; with min_tokens
    past p the engine cannot sample it at p, so it takes the next most likely token there (the
    unconstrained run's second alternative at p), and no stop id appears before min_tokens."""
    prompt = [31, 7, 99, 250, 18]
    ref = llm.generate([prompt], greedy(max_tokens=8, logprobs=3))[0].outputs[0]
    toks = ref.token_ids
    p = next(i for i in range(1, len(toks)) if toks[i] not in toks[:i])
    stop = toks[p]
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0].outputs[0]
    assert plain.token_ids == toks[: p + 1] and plain.finish_reason == "stop"
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop],
                                                 min_tokens=p + 2))[0].outputs[0]
    top = ref.logprobs[p].top
    assert top[0][0] == stop and top[1][1] - top[2][1] > 1e-3  # a clear second choice
    assert held.token_ids[:p] == toks[:p] and held.token_ids[p] == top[1][0]
    assert len(held.token_ids) >= p + 2 and stop not in held.token_ids[: p + 2]
