"""The engine's own jitted step programs through the Pallas kernels (kernels/mode.py, mode
"interpret": the GPU code path run on CPU), against the same engine on the pure-JAX references.

For each configuration — one device with FP8 weights, TP2 × DCP2, MTP speculation — the traced
step calls the expected Pallas kernels (checked on its jaxpr, so a silent fallback fails the test),
and the greedy streams equal the reference engine's under the equality rule (docs/design.md §10,
`glm53.equality`). Hybrid HiSparse on a pool far too small (the hot-buffer resolver's kernels,
the callback host mechanism) is the same comparison in `scripts/gpu_check.py`'s serve part, which
tests/scripts/test_gpu_check.py runs in interpret mode. On the FP8
KV cache each sparse-MLA call of the step is checked against the reference on its own inputs
instead (the cache's rounding makes streams the wrong check there: see that test). Interpret mode is slow on CPU: few requests, few tokens, one step bucket.
Kernel configurations the Pallas kernels cannot take (the tiny model's K = 64 / 96 FP8 matmuls:
partial 128-wide K blocks) fall back to the reference with a warning (kernels/mode.py), which the
one-device case checks too.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import pytest

from glm53 import api
from glm53.equality import compare_streams
from kernels.introspect import pallas_kernels
from kernels.mode import use_kernels
from serving.engine import EngineArgs
from serving.engine_factory import build_engine
from serving.types import SamplingParams
from sharding.mesh import ParallelConfig

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

SHORT = {"a": list(range(5, 100)), "b": [(7 * i) % 300 + 4 for i in range(40)]}

CASES = {
    # name: (EngineArgs overrides, prompts, Pallas kernels the step must call)
    "one_device_fp8_weights": (dict(quantization="fp8"), SHORT,
                               {"sparse_mla", "indexer_scores", "fp8_matmul", "fp8_grouped_matmul"}),
    "tp2_dcp2": (dict(parallel=ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)), SHORT,
                 {"sparse_mla", "indexer_scores"}),
    "mtp": (dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}), SHORT,
            {"sparse_mla", "indexer_scores"}),
}


def serve(mode: str, overrides: dict, prompts: dict):
    """Build the engine under kernel `mode`, serve `prompts` greedily (4 tokens, top-2 logprobs)
    → (engine, streams, logprobs)."""
    args = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32, cuda_graph_sizes=[],
                precompile_token_paddings=[], compile_progress=False, disable_log_stats=True, skip_precompile=True)
    with use_kernels(mode):
        e = build_engine(EngineArgs(**{**args, **overrides}))
    assert e.runner.kernel_mode == mode
    for rid, p in prompts.items():
        e.add_request(rid, p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2))
    streams, lps = {r: [] for r in prompts}, {r: [] for r in prompts}
    while e.has_unfinished_requests():
        for o in e.step():
            streams[o.request_id] += o.new_token_ids
            lps[o.request_id] += o.new_logprobs or []
        assert e.audit() == []
    return e, streams, lps


def step_kernels(e) -> set[str]:
    """The Pallas kernels the engine's step program calls."""
    return set(pallas_kernels(e.runner.trace_step(hot=e.hisparse is not None)))


@pytest.mark.parametrize("name", list(CASES))
def test_the_step_through_the_pallas_kernels_serves_the_reference_streams(name, caplog, monkeypatch):
    from kernels import mode

    monkeypatch.setattr(mode, "_warned", set())  # each case logs its own fallbacks
    overrides, prompts, kernels = CASES[name]
    _, ref, ref_lp = serve("reference", overrides, prompts)
    with caplog.at_level(logging.WARNING, logger="kernels.mode"):
        e, got, _ = serve("interpret", overrides, prompts)
    used = step_kernels(e)
    print(f"\n{name}: Pallas kernels in the step: {sorted(used)}; fallbacks: "
          f"{[r.getMessage() for r in caplog.records]}")
    assert kernels <= used, f"expected Pallas kernels missing from the step: {kernels - used}"
    if name == "one_device_fp8_weights":  # the tiny model's partial-K FP8 matmuls fall back, saying so
        assert any("partial K block" in r.getMessage() for r in caplog.records)
    compare_streams(ref, got, ref_lp, prompts, api.load(cache_dtype="bfloat16"))


def test_on_the_fp8_cache_each_sparse_mla_call_in_the_step_equals_the_reference(monkeypatch):
    """The FP8 KV cache (`fp8_ds_mla` rows, `fp8_per_token_hadamard` keys) through the Pallas kernels
    inside the engine's step. Streams are not the check here: a rounding-level difference upstream
    (the kernels agree with the references to ~1e-6) can move a value across an e4m3 rounding
    boundary when it is written to the cache — one fp8 step is ~6 % of the value — and the
    sparse selection can amplify that into a different token. Instead every Pallas sparse-MLA call
    of the served steps is compared, in the same program and on the same inputs, with the
    reference (fp32 tolerance), and the step must call both fp8-reading kernels."""
    from kernels.sparse_mla import api as sparse_api
    from kernels.sparse_mla.reference import sparse_mla_reference

    pallas = sparse_api.IMPLEMENTATIONS["pallas_triton"]
    diffs = []

    def checked(q, arena, topk, layer, **kw):
        o, lse = pallas(q, arena, topk, layer, **kw)
        ro, rlse = sparse_mla_reference(q, arena, topk, layer, layout=kw["layout"], component=kw["component"],
                                        kv_lora_rank=kw["kv_lora_rank"], scale=kw["scale"])
        live = jnp.isfinite(rlse)
        d = jnp.maximum(jnp.max(jnp.where(live[..., None], jnp.abs(o - ro), 0.0)),
                        jnp.max(jnp.where(live, jnp.abs(lse - rlse), 0.0)))
        jax.debug.callback(lambda d, n: diffs.append((float(d), int(n))), d, jnp.sum(topk >= 0))
        return o, lse

    monkeypatch.setitem(sparse_api.IMPLEMENTATIONS, "pallas_triton", checked)
    e, got, got_lp = serve("interpret", dict(kv_cache_dtype="fp8"), SHORT)
    assert {"sparse_mla", "indexer_scores"} <= step_kernels(e)
    assert all(len(v) == 4 for v in got.values())
    assert len(diffs) >= 14 * 3 and sum(n for _, n in diffs) > 0  # every layer of several steps, real keys
    worst = max(d for d, _ in diffs)
    monkeypatch.setitem(sparse_api.IMPLEMENTATIONS, "pallas_triton", pallas)
    _, ref, ref_lp = serve("reference", dict(kv_cache_dtype="fp8"), SHORT)  # for the record only (see above)
    differ = {r: next((i for i, (a, b) in enumerate(zip(ref[r], got[r])) if a != b), None) for r in SHORT}
    dlp = max(abs(a.logprob - b.logprob) for r in SHORT for a, b in zip(ref_lp[r], got_lp[r]) if a.token_id == b.token_id)
    print(f"\nfp8 cache: {len(diffs)} sparse-MLA calls, largest difference from the reference {worst:.2e}; against "
          f"the reference engine: first differing output token {differ}, largest sampled-token logprob "
          f"difference {dlp:.1e}")
    assert worst < 2e-5


def test_kernel_mode_choices(monkeypatch):
    from kernels import mode as km
    from kernels.sparse_mla import api as sparse_api

    monkeypatch.delenv(km.KERNEL_MODE_ENV, raising=False)
    on_gpu = jax.default_backend() == "gpu"
    assert km.choose(None, False) == (("pallas_triton", False) if on_gpu else ("xla", False))
    assert km.choose("xla", False) == ("xla", False) and km.choose(None, True) == ("pallas_triton", True)
    with km.use_kernels("reference"):
        assert km.choose(None, False) == ("xla", False) and sparse_api.default_implementation() == "xla"
    with km.use_kernels("interpret"):
        assert km.choose(None, False) == ("pallas_triton", True)
    with km.use_kernels("pallas"):
        assert km.choose(None, False) == ("pallas_triton", not on_gpu)
    monkeypatch.setenv(km.KERNEL_MODE_ENV, "reference")
    assert km.kernel_mode() == "reference"
    with km.use_kernels("interpret"):  # a block wins over the variable
        assert km.kernel_mode() == "interpret"
    with km.use_kernels("triton"):  # the GPU kernels without interpret mode, on any backend (export)
        assert km.choose(None, False) == ("pallas_triton", False)
    monkeypatch.setenv(km.KERNEL_MODE_ENV, "fast")
    with pytest.raises(ValueError, match="GLM53_KERNELS"):
        km.kernel_mode()
    with pytest.raises(ValueError, match="kernel mode"):
        with km.use_kernels("fast"):
            pass
