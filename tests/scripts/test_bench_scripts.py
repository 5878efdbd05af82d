"""The pure parts of the benchmark scripts: the evalscope multi-turn data set and result checks
(scripts/evalscope_multiturn.py) and the workload/agreement helpers of scripts/bench_decode.py.
The runs themselves (server + evalscope, engine + HF) are scripts, not tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tokenizers import Tokenizer

from glm53.tiny_checkpoint import default_model_dir

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


evs = _load("evalscope_multiturn")
bench = _load("bench_decode")


# ----------------------------------------------------------------------------------- data set
def test_dataset_is_evalscope_custom_multi_turn_format(tmp_path):
    path = tmp_path / "d.jsonl"
    assert evs.write_dataset(str(path), conversations=3, turns=4, first_turn_words=300, user_words=20, seed=1) == 12
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    firsts = set()
    for line in lines:
        msgs = json.loads(line)
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in msgs)
        roles = [m["role"] for m in msgs]
        # evalscope splits at assistant messages: [system, user], [user], [user], [user]
        assert roles == ["system", "user", "assistant", "user", "assistant", "user", "assistant", "user"]
        firsts.add(msgs[1]["content"])
    assert len(firsts) == 3  # conversations differ: cache hits can only come from their own history


def test_first_turn_covers_a_whole_page_of_every_cache_group(tmp_path):
    """A prefix hit needs 768 shared tokens on the tiny checkpoint (its indexer pages hold 768)."""
    path = tmp_path / "d.jsonl"
    evs.write_dataset(str(path), conversations=2, turns=2, first_turn_words=300, user_words=60, seed=0)
    tok = Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))
    for line in path.read_text().splitlines():
        system, user = json.loads(line)[:2]
        assert len(tok.encode(system["content"] + user["content"]).ids) > 768


# ----------------------------------------------------------------------------------- checks
def _write_results(d: Path, *, success: int, failed: int, eligible: list[float]) -> Path:
    d.mkdir(parents=True)
    (d / "benchmark_summary.json").write_text(json.dumps(
        {"Total Requests": success + failed, "Success Requests": success, "Failed Requests": failed,
         "KV Cache Hit Rate (%)": 0.0}))
    row = {"metric": "Eligible Cache Hit Rate (%)", "mean": sum(eligible) / len(eligible),
           "min": min(eligible), "p50": sorted(eligible)[len(eligible) // 2], "max": max(eligible)}
    (d / "trace_summary.json").write_text(json.dumps(
        {"n_traces": len(eligible), "rows": [{"metric": "Latency (s)", "mean": 1.0, "min": 1.0, "max": 1.0}, row]}))
    return d


def test_estimated_cached_tokens_are_caught(tmp_path):
    # A server without usage.prompt_tokens_details: evalscope counts the whole previous context.
    d = _write_results(tmp_path / "r", success=24, failed=0, eligible=[100.0] * 8)
    res = evs.check_results(str(d), 24, prefix_caching=True)
    assert not res["ok"]
    failed = {c["check"] for c in res["checks"] if not c["ok"]}
    assert "eligible cache hit rate is not the estimate's 100.00%" in failed


def test_real_zero_without_prefix_caching_passes_and_fails_with_it(tmp_path):
    d = _write_results(tmp_path / "r", success=24, failed=0, eligible=[0.0] * 8)
    assert evs.check_results(str(d), 24, prefix_caching=False)["ok"]
    res = evs.check_results(str(d), 24, prefix_caching=True)
    assert [c["check"] for c in res["checks"] if not c["ok"]] == ["prefix caching hits (eligible rate > 0)"]


def test_real_hits_pass_and_failed_turns_fail(tmp_path):
    ok = _write_results(tmp_path / "a", success=24, failed=0, eligible=[60.3, 61.2, 62.9])
    assert evs.check_results(str(ok), 24, prefix_caching=True)["ok"]
    bad = _write_results(tmp_path / "b", success=23, failed=1, eligible=[60.3, 61.2, 62.9])
    res = evs.check_results(str(bad), 24, prefix_caching=True)
    assert [c["check"] for c in res["checks"] if not c["ok"]] == ["every turn succeeded"]


# ----------------------------------------------------------------------------------- bench_decode
def test_prompts_are_deterministic_and_in_the_regular_vocabulary():
    a = bench.make_prompts(8, 32, 460, seed=0)
    assert a == bench.make_prompts(8, 32, 460, seed=0)
    assert len(a) == 8 and all(len(p) == 32 for p in a)
    assert all(0 <= t < 460 for p in a for t in p)
    assert len({tuple(p) for p in a}) == 8
    assert bench.regular_vocab_size(str(default_model_dir())) == 460


def test_greedy_agreement_helpers():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    hf = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    assert bench.check_tokens(ours, hf, 2) == (2, 3)
    assert bench.check_tokens(ours, hf, 4) == (1, 3)
    assert bench.first_divergence(ours, hf) == [None, 2, 0]


def test_divergences_apply_the_near_tie_rule():
    ours = [[1, 2, 3], [5, 6, 7], [9, 9, 9]]
    ref = [[1, 2, 3], [5, 0, 7], [0, 9, 9]]
    gaps = [[1.0, 1.0, 1.0], [1.0, 3e-5, 1.0], [0.5, 1.0, 1.0]]
    assert bench.divergences(ours, ref, gaps) == [
        None,
        {"token": 1, "ref_top2_gap": 3e-5, "near_tie": True},
        {"token": 0, "ref_top2_gap": 0.5, "near_tie": False},
    ]


def test_tables_mark_skipped_baselines_instead_of_printing_nan():
    ours = {"decode_tok_s": 120.0, "step_ms": 8.0, "device_ms": 6.0, "host_ms": 2.0, "host_share": 0.25,
            "prefill_s": 0.05}
    skipped = {"batch": 1, "ours": ours}  # --skip-hf --skip-jit: no HF row, no generate_batch row
    measured = {"batch": 8, "ours": ours, "generate_batch": {"decode_tok_s": 60.0},
                "hf": {"decode_tok_s": 40.0, "prefill_s": 0.1}, "ratio": 3.0}
    text = bench.table([skipped, measured])
    assert "nan" not in text
    row1, row8 = text.splitlines()[2:]
    assert row1.count("–") == 4 and "–" not in row8
    assert "3.0x" in row8 and "40.0" in row8 and "100.0" in row8
    asy = {**ours, "step_ms": 5.0, "host_share": 0.1}
    text = bench.async_table([{**skipped, "ours_async": asy, "async_rows_equal_sync": 1},
                              {**measured, "ours_async": asy, "async_rows_equal_sync": 8}])
    assert "nan" not in text
    row1, row8 = text.splitlines()[2:]
    assert row1.count("–") == 3 and "2.00x" in row8
