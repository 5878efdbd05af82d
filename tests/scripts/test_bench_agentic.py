"""The pure parts of scripts/bench_agentic.py: the scaled workload, the pool sizing, and the per-point
summary (occupancy, throughput, both interactivity definitions, TTFT, HiSparse counters, the
equality verdict) on synthetic turn results. The sweep itself (servers and clients) is a script."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_agentic.py"
spec = importlib.util.spec_from_file_location("bench_agentic_script", SCRIPT)
ba = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = ba  # its dataclasses look their module up
spec.loader.exec_module(ba)


def test_workload_keeps_the_reference_proportions():
    wl = ba.Workload.scaled(16)
    assert (wl.first, wl.later, wl.out, wl.turns) == (4635, 47, 14, 13)  # 74,160 : 753 : 220 / 16
    assert wl.final_context == 4635 + 12 * (47 + 14) + 14
    assert ba.user_tokens(3, 2, 5, 400) == ba.user_tokens(3, 2, 5, 400) != ba.user_tokens(3, 3, 5, 400)


def test_pools_hold_the_stated_number_of_final_contexts():
    wl = ba.Workload.scaled(32)
    cfg, layout, per, small, ample = ba.pool_sizes(wl, 2, 10, "float32")
    L = wl.final_context
    assert per == -(-L // 64) + -(-L // layout.group("indexer").tokens_per_page)
    assert small == 2 * per + 1 and ample >= 20 * per
    assert ba.predicted("preemption", layout, small, wl, {}, 10, 10, 0) == 2
    assert ba.predicted("ample", layout, ample, wl, {}, 10, 10, 0) == 10  # capped by the concurrency


def _turn(conv, turn, out, t0, ttft, gap=0.1, prompt_tokens=100, cached=60):
    r = ba.TurnResult(conv, turn, [1, 2, 3], list(out), [0.5] * len(out))
    r.t_send, r.t_first, r.t_last = t0, t0 + ttft, t0 + ttft + gap * (len(out) - 1)
    r.prompt_tokens, r.cached_tokens = prompt_tokens, cached
    return r


def test_summary_metrics():
    ref = [_turn(0, 0, [5, 6, 7, 8], 0.0, 0.2), _turn(1, 0, [9, 9], 0.0, 0.4, gap=0.3)]
    got = [_turn(0, 0, [5, 6, 7, 8], 0.0, 0.2), _turn(1, 0, [9, 9], 0.0, 0.4, gap=0.3)]
    before = {"vllm:num_preemptions_total": 1, "vllm:hisparse_cache_hits_total": 10,
              "vllm:hisparse_cache_misses_total": 5, "vllm:hisparse_host_to_device_bytes_total": 0}
    after = {"vllm:num_preemptions_total": 3, "vllm:hisparse_cache_hits_total": 40,
             "vllm:hisparse_cache_misses_total": 15, "vllm:hisparse_host_to_device_bytes_total": 4096}
    samples = [(0, 0), (2, 1), (1, 0), (0, 0), (3, 2)]  # (running, waiting) per scrape
    row = ba.summarize("hisparse", 2, got, samples, before, after, 2.0, 3, ref)
    assert row["mean_running"] == 2.0  # the non-zero samples 2, 1, 3
    assert row["mean_running_while_waiting"] == 2.5  # the samples with a waiting request: 2, 3
    assert row["share_waiting"] == 0.4
    assert row["logical_throughput_tok_s"] == (104 + 102) / 2.0  # cached prompt tokens included
    assert row["interactivity"] == pytest.approx(1 / ((0.1 + 0.3) / 2), abs=1e-3)  # 1000 / mean TPOT (ms)
    # AgentX: 1 / P90 over requests of (e2e latency / output tokens)
    per_token = sorted([(0.2 + 0.3) / 4, (0.4 + 0.3) / 2])
    assert row["agentx_tok_s_per_user"] == pytest.approx(1 / (per_token[0] + 0.9 * (per_token[1] - per_token[0])),
                                                         abs=1e-3)
    assert (row["ttft_p50_s"], row["preemptions"], row["h2d_bytes"]) == (0.3, 2, 4096)
    assert row["hot_hit_rate"] == pytest.approx(30 / 40)
    assert row["greedy_identical"] and row["divergences"] == 0
    assert row["equal_under_rule"] and row["equality"] == "strict: every turn identical"
    # A divergence where the reference's top-2 gap is large is not explained: not identical.
    bad = [_turn(0, 0, [5, 6, 1, 1], 0.0, 0.2), got[1]]
    row = ba.summarize("preemption", 2, bad, [(1, 0)], before, after, 2.0, 2, ref)
    assert row["divergences"] == 1 and not row["greedy_identical"] and not row["equal_under_rule"]
    assert row["equality"].startswith("1 unexplained divergence(s)")
    # No ample run in the invocation (no reference turns): nothing is claimed.
    row = ba.summarize("hisparse", 2, got, samples, before, after, 2.0, 3, [])
    assert row["equal_under_rule"] is None and row["greedy_identical"] is None
    assert row["equality"].startswith("not compared")


def test_summary_connector_metrics():
    """The offload mode's host-tier hit rate and bytes come from vLLM's connector counters (Δ over
    the point); without the connector they are None / 0."""
    turns = [_turn(0, 0, [5, 6], 0.0, 0.2)]
    before = {"vllm:external_prefix_cache_queries_total": 100, "vllm:external_prefix_cache_hits_total": 10,
              "vllm:kv_offload_total_bytes_total{gpu_to_cpu}": 1000, "vllm:kv_offload_total_bytes_total{cpu_to_gpu}": 0}
    after = {"vllm:external_prefix_cache_queries_total": 500, "vllm:external_prefix_cache_hits_total": 110,
             "vllm:kv_offload_total_bytes_total{gpu_to_cpu}": 9000, "vllm:kv_offload_total_bytes_total{cpu_to_gpu}": 64}
    row = ba.summarize("offload", 1, turns, [(1, 0)], before, after, 1.0, 1, None)
    assert row["host_tier_hit_rate"] == pytest.approx(100 / 400)
    assert (row["offload_to_host_bytes"], row["offload_to_device_bytes"]) == (8000, 64)
    row = ba.summarize("preemption", 1, turns, [(1, 0)], {}, {}, 1.0, 1, None)
    assert row["host_tier_hit_rate"] is None and row["offload_to_host_bytes"] == 0


def test_turns_after_an_explained_divergence_are_not_compared():
    """Turn 0 of conversation 0 diverges at a near-tie (accepted by the logit rule); its turn 1
    then has another prompt than the reference's and is counted apart, not as a divergence."""
    ref = [_turn(0, 0, [5, 6, 7], 0.0, 0.2), _turn(0, 1, [1, 1], 1.0, 0.2)]
    ref[0].top2_gaps = [0.5, 1e-6, 0.5]
    ref[1].prompt = [1, 2, 3, 5, 6, 7, 9]
    got = [_turn(0, 0, [5, 8, 8], 0.0, 0.2), _turn(0, 1, [4, 4], 1.0, 0.2)]
    got[1].prompt = [1, 2, 3, 5, 8, 8, 9]
    row = ba.summarize("hisparse", 1, got, [(1, 0)], {}, {}, 1.0, 1, ref)
    assert row["divergences"] == 1 and row["turns_after_a_divergence"] == 1
    # equal under the rule, but not strictly identical, and the row says so
    assert row["equal_under_rule"] and not row["greedy_identical"]
    assert row["equality"] == "under the rule: 1 accepted divergence(s), 1 turn(s) not compared"
    assert row["divergence_details"][0]["accepted_by"] == "logit"
