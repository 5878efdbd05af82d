"""Weight bytes per device from the abstract parameter tree (glm53.weight_bytes) against the bytes of
real models: the live arrays of a model built with the same dtype and quantisation on one device,
and the addressable shards of that model placed with `sharding.rules.shard_params` on 8 simulated
CPU devices (tests/conftest.py sets the device count); plus GLM-5.3 FP8 figures checked against
bounds derived by hand from the config (docs/design.md §3.1, §3.7)."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from glm53 import capacity as cap
from glm53.config import TINY_HF_CONFIG, GlmConfig, preset
from glm53.model import GlmForCausalLM
from glm53.quant import QuantizationError, WeightQuant
from glm53.weight_bytes import (ATTENTION, EMBED_HEAD, FP8, FP8_SCALES, KINDS, PARTS, ROUTED_EXPERTS, UNQUANTISED,
                                device_parameter_bytes, device_weight_bytes, weight_bytes_breakdown)
from sharding.mesh import ATTN_HEADS, EXPERTS, MLP_COLS, ROLES, ParallelConfig, ParallelLayout
from sharding.rules import _path_str, shard_params

GIB = 2**30
TINY = preset("tiny")
# The tiny preset with 8 heads (as tests/sharding), so TP up to 4 and EP8 split it; block 16 keeps
# every TP2/TP4 shard of the FP8 weights block-aligned (q_b 8·48 columns, o_proj 8·32 rows,
# dense 256, shared and routed experts 64 columns).
TINY8 = GlmConfig.from_hf_config({**TINY_HF_CONFIG, "num_attention_heads": 8})
Q16 = WeightQuant(block=(16, 16))


def _live_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree_util.tree_leaves(nnx.state(model)))


# ----------------------------------------------------------------------------- one device

@pytest.mark.parametrize("dtype, quant", [(jnp.float32, None), (jnp.bfloat16, None), (jnp.bfloat16, Q16),
                                          (jnp.bfloat16, WeightQuant(block=(128, 128))), (jnp.float32, Q16)])
@pytest.mark.parametrize("with_mtp", [True, False])
def test_single_device_bytes_equal_the_live_arrays(dtype, quant, with_mtp):
    cfg = TINY if with_mtp else TINY.replace(num_nextn_predict_layers=0)
    model = GlmForCausalLM(cfg, dtype=dtype, quant=quant)
    assert (model.mtp is not None) == with_mtp
    got = device_weight_bytes(TINY, dtype=dtype, quant=quant, with_mtp=with_mtp)
    assert got == _live_bytes(model)
    assert got == device_weight_bytes(TINY, dtype=dtype, quant=quant, parallel=ParallelConfig(), with_mtp=with_mtp)
    # The breakdown partitions the total; the fp8 share is exactly the float8 arrays.
    kinds = weight_bytes_breakdown(TINY, dtype=dtype, quant=quant, with_mtp=with_mtp)
    parts = weight_bytes_breakdown(TINY, dtype=dtype, quant=quant, with_mtp=with_mtp, by="part")
    assert set(kinds) == set(KINDS) and set(parts) == set(PARTS)
    assert sum(kinds.values()) == sum(parts.values()) == got
    live = {_path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model))}
    assert device_parameter_bytes(TINY, dtype=dtype, quant=quant, with_mtp=with_mtp) == {
        k: x.nbytes for k, x in live.items()}
    assert kinds[FP8] == sum(x.nbytes for x in live.values() if x.dtype == jnp.float8_e4m3fn)
    scales = [x for k, x in live.items() if k.endswith("_scale_inv")]
    assert all(x.dtype == jnp.float32 for x in scales)
    assert kinds[FP8_SCALES] == sum(x.nbytes for x in scales)
    if quant is None:
        assert kinds[FP8] == kinds[FP8_SCALES] == 0
    else:
        assert kinds[FP8] > 0 and kinds[FP8_SCALES] > 0


def test_per_parameter_bytes_name_every_parameter():
    per = device_parameter_bytes(TINY, dtype=jnp.bfloat16, quant=Q16)
    assert "lm_head.weight" in per and "mtp.eh_proj.weight" in per
    assert per["embed_tokens.weight"] == TINY.vocab_size * TINY.hidden_size * 2
    assert any(k.endswith("mlp.experts.gate_proj_scale_inv") for k in per)
    assert sum(per.values()) == device_weight_bytes(TINY, dtype=jnp.bfloat16, quant=Q16)


# ----------------------------------------------------------------------------- parallel layouts

LAYOUTS = {
    "tp2": ParallelConfig(tensor_parallel_size=2),
    "tp4": ParallelConfig(tensor_parallel_size=4),
    "dp8-ep8": ParallelConfig(data_parallel_size=8, enable_expert_parallel=True),
    "dp2-tp4": ParallelConfig(data_parallel_size=2, tensor_parallel_size=4),
    "dp2-tp2-ep": ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
    "pcp2-tp4-dcp4-ep": ParallelConfig(prefill_context_parallel_size=2, tensor_parallel_size=4,
                                       decode_context_parallel_size=4, enable_expert_parallel=True),
}


@pytest.fixture(scope="module")
def tiny8_states():
    assert jax.device_count() >= 8, "needs 8 devices (tests/conftest.py sets XLA_FLAGS)"
    return {(dt, q): nnx.state(GlmForCausalLM(TINY8, dtype=dt, quant=q))
            for dt, q in ((jnp.bfloat16, Q16), (jnp.float32, None))}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("fmt", ["fp8", "fp32"])
def test_per_device_bytes_equal_the_sharded_model(tiny8_states, name, fmt):
    par = LAYOUTS[name]
    dtype, quant = (jnp.bfloat16, Q16) if fmt == "fp8" else (jnp.float32, None)
    sharded = shard_params(tiny8_states[(dtype, quant)], ParallelLayout.create(par))
    per_dev: Counter = Counter()
    for x in jax.tree_util.tree_leaves(sharded):
        for s in x.addressable_shards:
            per_dev[s.device] += s.data.nbytes
    assert len(per_dev) == par.num_devices
    got = device_weight_bytes(TINY8, dtype=dtype, quant=quant, parallel=par)
    assert got == max(per_dev.values()) == min(per_dev.values())
    total = device_weight_bytes(TINY8, dtype=dtype, quant=quant)
    assert total // par.num_devices < got < total


def test_layouts_split_what_the_rules_say():
    dt = jnp.bfloat16
    one = weight_bytes_breakdown(TINY8, dtype=dt, quant=Q16, by="part")
    tp4 = weight_bytes_breakdown(TINY8, dtype=dt, quant=Q16, parallel=LAYOUTS["tp4"], by="part")
    ep8 = weight_bytes_breakdown(TINY8, dtype=dt, quant=Q16, parallel=LAYOUTS["dp8-ep8"], by="part")
    # Routed experts: columns split over TP4, whole experts over EP8.
    assert tp4[ROUTED_EXPERTS] * 4 == one[ROUTED_EXPERTS] == ep8[ROUTED_EXPERTS] * 8
    # DP + EP replicates everything but the routed experts.
    assert {k: v for k, v in ep8.items() if k != ROUTED_EXPERTS} == {k: v for k, v in one.items()
                                                                     if k != ROUTED_EXPERTS}
    # TP: embeddings replicated, lm_head split over the vocabulary.
    emb = TINY8.vocab_size * TINY8.hidden_size * 2
    assert tp4[EMBED_HEAD] == emb + emb // 4 and one[EMBED_HEAD] == 2 * emb
    assert tp4[ATTENTION] < one[ATTENTION]


def test_layouts_that_cannot_shard_are_refused():
    # 4 heads cannot split 8 ways; shared-expert columns 64 / 8 = 8 cut the 16-wide FP8 blocks.
    # The refusal names the flag and the sizes that would work (the tiny model has 4 heads).
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 8 splits the attention heads \(4 in this model\) "
                                         r"8 ways, which does not divide them; it must divide 4: one of 1, 2, 4"):
        device_weight_bytes(TINY, dtype=jnp.float32, quant=None, parallel=ParallelConfig(tensor_parallel_size=8))
    with pytest.raises(ValueError, match=r"--data-parallel-size 3 × --tensor-parallel-size 2 splits the experts \(8 "
                                         r"in this model\) 6 ways.*that product must divide 8: one of 1, 2, 4, 8 "
                                         r"\(--enable-expert-parallel"):
        device_weight_bytes(TINY, dtype=jnp.float32, quant=None,
                            parallel=ParallelConfig(tensor_parallel_size=2, data_parallel_size=3,
                                                    enable_expert_parallel=True))
    with pytest.raises(QuantizationError, match="scale block"):
        device_weight_bytes(TINY8, dtype=jnp.bfloat16, quant=Q16, parallel=ParallelConfig(tensor_parallel_size=8))


@pytest.mark.parametrize("par", list(LAYOUTS.values()) + [ParallelConfig(tensor_parallel_size=8),
                                                          ParallelConfig(prefill_context_parallel_size=8,
                                                                         decode_context_parallel_size=8)])
def test_abstract_layout_matches_the_device_layout(par):
    """`ParallelLayout.abstract` (no devices) gives the roles, sizes and specs of the real layout."""
    real, abstract = ParallelLayout.create(par), ParallelLayout.abstract(par)
    assert dict(abstract.mesh.shape) == dict(real.mesh.shape)
    for r in ROLES:
        assert abstract.size(r) == real.size(r) and abstract.spec(r) == real.spec(r)
    assert abstract.spec(None, ATTN_HEADS) == real.spec(None, ATTN_HEADS)
    assert abstract.size(EXPERTS, MLP_COLS) == real.size(EXPERTS, MLP_COLS)


# ----------------------------------------------------------------------------- GLM-5.3 plausibility

GLM53 = preset("glm-5.3")
FP8_128 = WeightQuant(block=(128, 128))


def _glm53_expert_bytes(num_moe_layers: int) -> int:
    """Routed experts of GLM-5.3 FP8, by hand (docs/design.md §3.1): 256 experts × gate/up/down of 6144 × 2048
    e4m3 codes + one fp32 scale per 128 × 128 block (48 × 16 blocks)."""
    return num_moe_layers * 256 * 3 * (6144 * 2048 + 4 * 48 * 16)


def test_glm53_fp8_totals():
    total = device_weight_bytes(GLM53, dtype=jnp.bfloat16, quant=FP8_128)
    assert 700 * GIB < total < 708 * GIB  # ≈ 704 GiB, the FP8 checkpoint (docs/design.md §3.7)
    # The checkpoint files (another code path: the HF key list) hold the same weights to within the
    # refined kv_b scale grids and the fp32 copy of the indexer's weights_proj (< 0.1 GiB).
    assert abs(total - cap.checkpoint_weight_bytes(GLM53, "fp8").total) < 0.1 * GIB
    parts = weight_bytes_breakdown(GLM53, dtype=jnp.bfloat16, quant=FP8_128, by="part")
    assert parts[ROUTED_EXPERTS] == _glm53_expert_bytes(75 + 1)  # 75 MoE layers + the MTP layer
    kinds = weight_bytes_breakdown(GLM53, dtype=jnp.bfloat16, quant=FP8_128)
    # Scales: ≈ 4 B per 16,384 codes; unquantised: embeddings + head (2 × 154880 × 6144 bf16) and more.
    assert 3.5 / 16384 < kinds[FP8_SCALES] / kinds[FP8] < 4.5 / 16384
    assert 2 * 154880 * 6144 * 2 < kinds[UNQUANTISED] < 6 * GIB
    no_mtp = device_weight_bytes(GLM53, dtype=jnp.bfloat16, quant=FP8_128, with_mtp=False)
    assert _glm53_expert_bytes(1) < total - no_mtp < _glm53_expert_bytes(1) + 0.5 * GIB
    bf16 = device_weight_bytes(GLM53, dtype=jnp.bfloat16, quant=None)
    assert 1390 * GIB < bf16 < 1410 * GIB  # ≈ 2 B per weight (the docs' 1,403 GiB)


def test_glm53_fp8_per_device_under_tp8_and_dp8_ep8():
    total = device_weight_bytes(GLM53, dtype=jnp.bfloat16, quant=FP8_128)
    experts = _glm53_expert_bytes(76)
    tp8 = device_weight_bytes(GLM53, dtype=jnp.bfloat16, quant=FP8_128, parallel=ParallelConfig(tensor_parallel_size=8))
    # total / 8 plus the replicated parts: embeddings (1.8 GiB), q_a/kv_a, indexer, norms, routers
    # of 79 layers (≈ 33 MB each), well under 6 GiB in all.
    assert total / 8 < tp8 < total / 8 + 6 * GIB
    assert 89 * GIB < tp8 < 94 * GIB
    ep8 = ParallelConfig(data_parallel_size=8, enable_expert_parallel=True)
    dp8 = device_weight_bytes(GLM53, dtype=jnp.bfloat16, quant=FP8_128, parallel=ep8)
    assert dp8 == experts // 8 + (total - experts)  # experts split 8 ways, everything else replicated
    assert tp8 < dp8 < tp8 + (total - experts)
    parts = weight_bytes_breakdown(GLM53, dtype=jnp.bfloat16, quant=FP8_128, parallel=ParallelConfig(
        tensor_parallel_size=8), by="part")
    assert parts[ROUTED_EXPERTS] == experts // 8  # expert columns over TP8: 2048 / 8 = 256 = 2 blocks


def test_capacity_uses_the_parameter_tree():
    refs = cap.reference_deployments()
    tp8, dp8 = refs["tp8-hisparse"], refs["dp8-decode"]
    assert cap.weight_bytes_per_gpu(GLM53, tp8) == device_weight_bytes(
        GLM53, dtype=jnp.bfloat16, quant=FP8_128, parallel=ParallelConfig(tensor_parallel_size=8))
    assert cap.weight_bytes_per_gpu(GLM53, dp8) == device_weight_bytes(
        GLM53, dtype=jnp.bfloat16, quant=FP8_128,
        parallel=ParallelConfig(data_parallel_size=8, enable_expert_parallel=True))
    # The MTP layer's weights count only with MTP speculation on; DCP changes no weight.
    assert cap.weight_bytes_per_gpu(GLM53, tp8.replace(num_speculative_tokens=0)) == device_weight_bytes(
        GLM53, dtype=jnp.bfloat16, quant=FP8_128, parallel=ParallelConfig(tensor_parallel_size=8), with_mtp=False)
    assert cap.weight_bytes_per_gpu(GLM53, refs["tp8-dcp8-hisparse"]) == cap.weight_bytes_per_gpu(GLM53, tp8)
    bf16 = cap.weight_bytes_per_gpu(GLM53, tp8.replace(checkpoint_dtype="bf16"))
    assert 1.9 < bf16 / cap.weight_bytes_per_gpu(GLM53, tp8) < 2.1
    assert cap.weight_bytes_per_gpu(GLM53, tp8.replace(weight_bytes_per_gpu=GIB)) == GIB
    kinds = cap.weight_bytes_breakdown_per_gpu(GLM53, tp8)
    assert sum(kinds.values()) == cap.weight_bytes_per_gpu(GLM53, tp8)
    hbm = int(tp8.accelerator.hbm_bytes * 0.92)
    assert cap.kv_room_per_gpu(GLM53, tp8) == hbm - cap.weight_bytes_per_gpu(GLM53, tp8) - 9 * GIB
