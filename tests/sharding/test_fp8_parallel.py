"""FP8 weights kept on the device under parallel layouts (8 simulated CPU devices), and the
streaming sharded loader.

The model is the sharding tests' random model (conftest) with its linears quantised by numpy
(tests/helpers/fp8_checkpoint.py) to 32×32 blocks, the largest block TP2 splits into whole blocks
(the shared experts' 64 columns → 32 per device). Oracle: the same FP8 weights dequantised at
load, on one device (conftest's `run_layout(…, None)`). Tolerance `TOL` (fp32, summation order).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from glm53 import loader
from glm53.loader import load_model, load_weights
from glm53.model import GlmForCausalLM
from glm53.quant import QuantizationError, WeightQuant
from glm53.safetensors_reader import InMemoryCheckpoint
from glm53.tiny_checkpoint import tiny_weights
from sharding.mesh import ParallelConfig, ParallelLayout
from sharding.rules import shard_params
from tests.helpers.fp8_checkpoint import fp8_tensors, quant_config
from tests.sharding.conftest import NUM_PROMPTS, TOL, run_layout, sharding_test_config

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

BLOCK = (32, 32)


def _fp8_config():
    return sharding_test_config().replace(quantization_config=quant_config(BLOCK))


@pytest.fixture(scope="module")
def fp8_setups(model_setup):
    """(kept setup, dequantised setup) in conftest's `(cfg, layout, graphdef, state, prompts)` form."""
    cfg0, layout, _, _, prompts = model_setup
    cfg = _fp8_config()
    ck = InMemoryCheckpoint(fp8_tensors(tiny_weights(cfg0, seed=1), BLOCK))
    kept = load_weights(GlmForCausalLM(cfg, quant=WeightQuant(BLOCK)), ck, progress=False)
    deq = load_weights(GlmForCausalLM(cfg), ck, progress=False)
    assert kept.stack.layers[1].mlp.experts.down_proj.dtype == jax.numpy.float8_e4m3fn
    return ((cfg, layout, *nnx.split(kept), prompts), (cfg, layout, *nnx.split(deq), prompts))


@pytest.mark.parametrize("name,par", [
    ("tp2", ParallelConfig(tensor_parallel_size=2)),
    ("dp2_ep2", ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)),
])
def test_fp8_kept_under_a_layout_equals_dequantised_on_one_device(name, par, fp8_setups, monkeypatch):
    """Every FP8 projection runs shard by shard (`glm53.layers._sharded_fp8_linear`, the kernel
    inside shard_map); the routed experts through their own shard_map."""
    import glm53.layers

    rules, inner = [], glm53.layers._sharded_fp8_linear
    monkeypatch.setattr(glm53.layers, "_sharded_fp8_linear", lambda *a: rules.append(a[-1]) or inner(*a))
    kept, deq = fp8_setups
    layout = ParallelLayout.create(par)
    logits, _, _ = run_layout(kept, layout)
    assert {"self_attn.q_b_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"} <= set(rules)
    for r in range(layout.dp):
        cfg, lay, g, st, prompts = deq
        ref, _, _ = run_layout((cfg, lay, g, st, [prompts[r]]), None)
        worst = float(np.abs(logits[r] - ref[0]).max())
        print(f"\n{name} replica {r}: max |Δlogit| fp8 kept vs dequantised one device = {worst:.2e}")
        assert worst <= TOL
    assert layout.dp <= NUM_PROMPTS


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    cfg = _fp8_config()
    d = tmp_path_factory.mktemp("fp8_sharded")
    save_file(fp8_tensors(tiny_weights(sharding_test_config(), seed=1), BLOCK), os.path.join(d, "model.safetensors"))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**cfg.to_hf_config(), "quantization_config": quant_config(BLOCK)}, f)
    return str(d)


def _params(model):
    return dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize("staging", [None, 4096])
def test_streaming_sharded_load_equals_load_then_shard(fp8_dir, staging, monkeypatch):
    """Each device reads its shard straight from the files (TP2 × EP4 over 8 devices; with a tiny
    staging bound the stacked parameters are assembled a part at a time) = the whole model loaded
    on one device then `shard_params`: the same values on the same shardings."""
    if staging is not None:
        monkeypatch.setattr(loader, "MAX_STAGING_BYTES", staging)
    layout = ParallelLayout.create(ParallelConfig(tensor_parallel_size=2, data_parallel_size=4,
                                                  enable_expert_parallel=True))
    streamed = load_model(fp8_dir, shardings=layout, progress=False)
    whole = load_model(fp8_dir, progress=False)
    want = shard_params(nnx.state(whole, nnx.Param), layout)
    got, ref = _params(streamed), dict(nnx.to_flat_state(want))
    assert got.keys() == ref.keys()
    for k, v in got.items():
        r = ref[k]
        assert v.sharding.is_equivalent_to(r.sharding, v.ndim), k
        assert v.dtype == r.dtype, k
        np.testing.assert_array_equal(np.asarray(v).astype(np.float32), np.asarray(r).astype(np.float32), err_msg=k)


def test_a_layout_that_cuts_scale_blocks_fails_at_load(fp8_dir):
    """TP4 splits the shared experts' 64 columns into 16, half a 32-column block."""
    layout = ParallelLayout.create(ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(QuantizationError, match="--tensor-parallel-size"):
        load_model(fp8_dir, shardings=layout, progress=False)


def test_the_engine_refuses_a_tensor_parallel_size_that_cuts_scale_blocks(tmp_path):
    """`serving.run`'s start-up path: the tiny checkpoint in FP8 (128-blocks) under TP2 — its
    q_b_proj's 192 columns would split into 96 — fails before anything compiles, naming the flag."""
    from glm53.tiny_checkpoint import default_model_dir
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from tests.helpers.fp8_checkpoint import write_fp8_checkpoint

    path = write_fp8_checkpoint(str(default_model_dir()), str(tmp_path / "fp8"))
    with pytest.raises(ValueError, match="q_b_proj.*--tensor-parallel-size"):
        build_engine(EngineArgs(model=path, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32,
                                       parallel=ParallelConfig(tensor_parallel_size=2)))


def test_served_fp8_streams_under_tp2_equal_the_dequantised_single_device_engine(tmp_path):
    """The engine (`serving.run`'s path: streaming sharded load, runner, step) on the tiny
    checkpoint in FP8 with 32×32 blocks (TP2-aligned): TP2 with FP8 kept gives the greedy streams
    of one device with the weights dequantised (docs/design.md §10's rule: a divergence must sit at a
    top-2 near-tie of the reference's logits)."""
    from glm53.equality import compare_streams
    from glm53.tiny_checkpoint import default_model_dir
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.types import SamplingParams
    from tests.helpers.fp8_checkpoint import write_fp8_checkpoint

    path = write_fp8_checkpoint(str(default_model_dir()), str(tmp_path / "fp8"), block=BLOCK)
    prompts = {"a": list(range(5, 25)), "b": [(7 * i) % 300 + 4 for i in range(70)]}

    def serve(parallel, quantization):
        engine = build_engine(EngineArgs(
            model=path, dtype="float32", max_model_len=192, max_num_seqs=4, max_num_batched_tokens=64,
            num_gpu_blocks_override=24, compile_progress=False, parallel=parallel, cuda_graph_sizes=[], precompile_token_paddings=[],
            quantization=quantization))
        assert (engine.runner.state["layers"][0]["self_attn"]["q_b_proj"]["weight"].dtype
                == (jax.numpy.float32 if quantization == "none" else jax.numpy.float8_e4m3fn))
        for rid, p in prompts.items():
            engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2))
        streams, lps = {rid: [] for rid in prompts}, {rid: [] for rid in prompts}
        while engine.has_unfinished_requests():
            for out in engine.step():
                streams[out.request_id].extend(out.new_token_ids)
                lps[out.request_id].extend(out.new_logprobs or [])
        assert engine.audit() == []
        return streams, lps

    ref, ref_lps = serve(None, "none")
    got, _ = serve(ParallelConfig(tensor_parallel_size=2), None)
    assert all(len(v) == 6 for v in got.values())
    compare_streams(ref, got, ref_lps, {})


def test_an_orbax_checkpoint_loads_onto_a_parallel_layout(tmp_path):
    """`load_model(orbax_dir, shardings=ParallelLayout)` (what the engine passes) reads each
    parameter onto its partition-rule sharding: the same values and shardings as the HF checkpoint
    streamed onto that layout."""
    from glm53.tiny_checkpoint import default_model_dir
    from scripts.convert_checkpoint import main as convert

    src, dst = str(default_model_dir()), str(tmp_path / "orbax")
    assert convert([src, dst, "--dtype", "float32", "--no-progress"]) == 0
    layout = ParallelLayout.create(ParallelConfig(tensor_parallel_size=2, data_parallel_size=2,
                                                  enable_expert_parallel=True))
    got, want = _params(load_model(dst, shardings=layout, progress=False)), _params(
        load_model(src, shardings=layout, progress=False))
    assert got.keys() == want.keys()
    for k, v in got.items():
        assert v.sharding.is_equivalent_to(want[k].sharding, v.ndim), k
        np.testing.assert_array_equal(np.asarray(v), np.asarray(want[k]), err_msg=k)
