"""FP8 weights kept on the device (glm53/quant.py, glm53/loader.py): the kept model against the
same weights dequantised at load, online quantisation, the per-head kv_b split, parameter bytes,
and the errors of a quantisation that cannot apply.

FP8 checkpoints are made here with numpy (tests/helpers/fp8_checkpoint.py), independent of the
code under test. Oracles: the model loaded with `quantization="none"` (the FP8 weights dequantised
to the model dtype at load, the pre-FP8 path) and numpy dequantisation.
"""

from __future__ import annotations

import json
import logging
import math
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from glm53 import api
from glm53.loader import load_model
from glm53.quant import QuantizationError, WeightQuant, check_fp8_parallel_layout, resolve_weight_quant
from glm53.safetensors_reader import SafetensorsCheckpoint
from glm53.tiny_checkpoint import default_model_dir
from sharding.mesh import ATTN_HEADS, EXPERT_COLS, MLP_COLS
from tests.helpers.fp8_checkpoint import dequantise, fp8_tensors, quant_config, write_fp8_checkpoint

# The tiny checkpoint's 7-layer twin (tests/helpers/shallow_model.py): the same code paths, faster steps.
pytestmark = pytest.mark.shallow_model

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf")
# fp32 activations: the kept model dequantises each block before an fp32 dot, the same maths as
# the dequantised model up to summation order (observed: identical on XLA:CPU).
TOL_FP32 = 1e-4


@pytest.fixture(scope="module")
def fp8_golden(tmp_path_factory):
    """The `sparse` HF golden fixture (hidden 64: every 128-block is partial; kv_b_proj's 64-row
    heads put two heads in one 128-row block) quantised with 128×128 blocks."""
    return write_fp8_checkpoint(os.path.join(FIXTURES, "sparse"), str(tmp_path_factory.mktemp("fp8_sparse")))


def _ids(name="sparse", n=40):
    return np.load(os.path.join(FIXTURES, name, "golden.npz"))["input_ids"][0][:n]


def test_fp8_checkpoint_keeps_fp8_weights_and_equals_the_dequantised_model(fp8_golden):
    kept = api.load(fp8_golden)
    deq = api.load(fp8_golden, quantization="none")
    m = kept.model
    assert m.quant == WeightQuant(block=(128, 128))
    attn = m.layers[0].self_attn
    assert attn.q_b_proj.weight.dtype == jnp.float8_e4m3fn and attn.q_b_proj.weight_scale_inv.dtype == jnp.float32
    assert attn.w_uk.dtype == jnp.float8_e4m3fn and m.stack.layers[0].mlp.experts.gate_proj.dtype == jnp.float8_e4m3fn
    assert m.embed_tokens.weight.dtype == jnp.float32 and m.lm_head.weight.dtype == jnp.float32
    assert m.mtp.eh_proj.weight.dtype == jnp.float32 and attn.indexer.weights_proj.weight.dtype == jnp.float32
    assert deq.model.quant is None and deq.model.layers[0].self_attn.w_uk.dtype == jnp.float32
    ids = _ids()
    a, b = api.forward(kept, ids), api.forward(deq, ids)
    assert np.abs(a - b).max() <= TOL_FP32 * max(1.0, np.abs(b).max())


def test_kept_weights_dequantise_to_the_checkpoint_values(fp8_golden):
    """Every kept weight × its scale equals numpy's dequantisation of the checkpoint tensor,
    including the per-head kv_b split whose refined scale rows (g = gcd(128, 32, 32) = 32) cut
    the 128-row blocks."""
    m = api.load(fp8_golden).model
    ck = SafetensorsCheckpoint(fp8_golden)
    cfg = m.cfg
    N, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim

    def deq(key):
        return dequantise(np.asarray(ck.get(key)), np.asarray(ck.get(key + "_scale_inv")), (128, 128))

    got_q = np.asarray(m.layers[1].self_attn.q_b_proj.dense_weight())
    np.testing.assert_array_equal(got_q, deq("model.layers.1.self_attn.q_b_proj.weight").T)
    kvb = deq("model.layers.1.self_attn.kv_b_proj.weight").reshape(N, dn + dv, -1)
    w_uk, w_uv = (np.asarray(w) for w in m.layers[1].self_attn.absorbed_weights())
    np.testing.assert_array_equal(w_uk, kvb[:, :dn, :])
    np.testing.assert_array_equal(w_uv, np.swapaxes(kvb[:, dn:, :], 1, 2))
    assert m.layers[1].self_attn.w_uk_scale_inv.shape == (N, dn // 32, 1)
    # Routed expert 3 of the stacked IndexShare group's full layer (layer 6).
    layer = cfg.layer_plan.stacked_layer(0, 0)
    e = m.stack.layers[0].mlp.experts
    from kernels.fp8_matmul import dequantize_fp8_blocks

    got_e = np.asarray(dequantize_fp8_blocks(e.down_proj[...][0, 3], e.down_proj_scale_inv[...][0, 3], (128, 128)))
    np.testing.assert_array_equal(got_e, deq(f"model.layers.{layer}.mlp.experts.3.down_proj.weight").T)


def test_bf16_activations_stay_within_a_stated_bound(fp8_golden):
    """bf16 activations. Per layer, an FP8 projection and an FP8 MoE block against the same weights
    dequantised to bf16 at load and against float64 numpy. Bound: bf16 rounding of the weights
    (2^-9 relative: the kept path may round w·scale where the dequantised one did, or apply the
    scale after the dot as the GPU kernel does) and of the output (2^-8), so
    |kept − dequantised| ≤ 2^-7 · (|x| @ |W|). Whole model: the kept and dequantised bf16 logits
    within 2 % of the logit range (identical on XLA:CPU, where both run the reference)."""
    ids = _ids()
    whole_k = api.forward(api.load(fp8_golden, dtype=jnp.bfloat16), ids)
    whole_d = api.forward(api.load(fp8_golden, dtype=jnp.bfloat16, quantization="none"), ids)
    assert np.abs(whole_k - whole_d).max() <= 0.02 * np.abs(whole_d).max()
    kept = load_model(fp8_golden, dtype=jnp.bfloat16, progress=False)
    deq = load_model(fp8_golden, dtype=jnp.bfloat16, quantization="none", progress=False)
    rng = np.random.default_rng(0)
    proj_k, proj_d = kept.layers[1].self_attn.q_b_proj, deq.layers[1].self_attn.q_b_proj
    x = jnp.asarray(rng.standard_normal((6, proj_k.weight.shape[0])), jnp.bfloat16)
    a, b = np.asarray(proj_k(x), np.float64), np.asarray(proj_d(x), np.float64)
    w = np.asarray(proj_k.dense_weight(), np.float64)
    xa = np.abs(np.asarray(x, np.float64))
    assert np.all(np.abs(a - b) <= 2.0 ** -7 * (xa @ np.abs(w)) + 1e-6)
    assert np.all(np.abs(a - np.asarray(x, np.float64) @ w) <= 2.0 ** -7 * (xa @ np.abs(w)) + 1e-6)
    moe_k, moe_d = kept.layers[4].mlp, deq.layers[4].mlp  # routed (grouped matmul) + shared experts
    h = jnp.asarray(rng.standard_normal((6, kept.cfg.hidden_size)), jnp.bfloat16)
    ya, yb = np.asarray(moe_k(h), np.float64), np.asarray(moe_d(h), np.float64)
    assert np.abs(ya - yb).max() <= 2.0 ** -6 * np.abs(yb).max()


def test_online_quantisation_of_a_bf16_checkpoint(tmp_path):
    """`quantization="fp8"` on a bf16 checkpoint = the checkpoint quantised by numpy (128×128)."""
    src = os.path.join(FIXTURES, "dense")
    online = api.load(src, quantization="fp8")
    assert online.model.quant == WeightQuant(block=(128, 128), online=True)
    assert online.model.layers[3].mlp.experts.up_proj.dtype == jnp.float8_e4m3fn
    offline = api.load(write_fp8_checkpoint(src, str(tmp_path / "fp8")))
    ids = _ids("dense", 24)
    a, b = api.forward(online, ids), api.forward(offline, ids)
    assert np.abs(a - b).max() <= TOL_FP32 * max(1.0, np.abs(b).max())
    plain = api.forward(api.load(src), ids)
    assert np.abs(a - plain).max() > 0  # it really was quantised


def test_device_parameter_bytes_are_fp8_codes_scales_and_the_rest(fp8_golden):
    """Live arrays: 1 B per FP8 code + 4 B per scale (the kv_b scales refined to 32-row blocks) +
    the unquantised tensors in the model dtype (router and its bias fp32), counted from the
    checkpoint's own header."""
    m = api.load(fp8_golden).model
    ck = SafetensorsCheckpoint(fp8_golden)
    cfg = m.cfg
    N, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    want = 0
    for k in ck.keys():
        n = math.prod(ck.shape(k))
        if ck.dtype(k) == "F8_E4M3":
            want += n
        elif k.endswith("kv_b_proj.weight_scale_inv"):
            want += 4 * N * (dn + dv) // 32 * ck.shape(k)[1]  # one scale per 32 rows instead of 128
        else:
            want += 4 * n  # scales fp32; everything else loaded as fp32 (dtype of api.load)
    if not cfg.tie_word_embeddings and "lm_head.weight" not in ck:
        want += 4 * cfg.vocab_size * cfg.hidden_size
    live = sum(x.nbytes for x in _leaves(m))
    assert live == want
    from glm53.weight_bytes import device_weight_bytes

    assert device_weight_bytes(cfg, dtype=jnp.float32, quant=m.quant, parallel=None) == want


def _leaves(model):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model, nnx.Param))


def test_checkpoint_quantisation_methods_and_flags():
    from glm53.config import GlmConfig

    cfg = GlmConfig.from_pretrained(os.path.join(FIXTURES, "dense"))
    assert resolve_weight_quant(cfg, None) is None
    with pytest.raises(QuantizationError, match="--quantization 'awq'"):
        resolve_weight_quant(cfg, "awq")
    awq = cfg.replace(quantization_config={"quant_method": "awq"})
    with pytest.raises(QuantizationError, match="quant_method is 'awq'"):
        resolve_weight_quant(awq, None)
    no_block = cfg.replace(quantization_config={"quant_method": "fp8"})
    with pytest.raises(QuantizationError, match="weight_block_size"):
        resolve_weight_quant(no_block, None)
    fp8 = cfg.replace(quantization_config=quant_config((128, 128)))
    assert resolve_weight_quant(fp8, "fp8") == resolve_weight_quant(fp8, None) == WeightQuant((128, 128))
    assert resolve_weight_quant(fp8, "none") is None
    from serving.cli_args import make_arg_parser

    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["--quantization", "awq"])
    assert make_arg_parser().parse_args(["--quantization", "fp8"]).quantization == "fp8"


def test_a_tensor_parallel_split_that_cuts_a_scale_block_is_refused():
    """GLM-5.3 is aligned at TP8 and TP16; the tiny fixture's q_b_proj (4 heads × 48 = 192
    columns) split 2 ways gives 96 columns, not a multiple of 128."""
    from glm53.config import GLM53_HF_CONFIG, GlmConfig

    tiny = GlmConfig.from_pretrained(os.path.join(FIXTURES, "dense"))
    sizes = {ATTN_HEADS: 2, MLP_COLS: 2, EXPERT_COLS: 2}.get
    with pytest.raises(QuantizationError, match="q_b_proj.*--tensor-parallel-size"):
        check_fp8_parallel_layout(tiny, WeightQuant((128, 128)), lambda r: sizes(r, 1))
    check_fp8_parallel_layout(tiny, None, lambda r: sizes(r, 1))  # unquantised: any split
    check_fp8_parallel_layout(tiny, WeightQuant((8, 8)), lambda r: sizes(r, 1))
    glm = GlmConfig.from_hf_config(GLM53_HF_CONFIG)
    for tp in (8, 16):
        check_fp8_parallel_layout(glm, WeightQuant((128, 128)), lambda r: tp if r in (ATTN_HEADS, MLP_COLS,
                                                                                         EXPERT_COLS) else 1)
    with pytest.raises(QuantizationError, match="routed expert"):
        check_fp8_parallel_layout(glm, WeightQuant((128, 128)), lambda r: 32 if r == EXPERT_COLS else 1)


def _no_mtp_checkpoint(dst: str) -> str:
    """The tiny checkpoint as HF transformers' `save_pretrained` writes it: no MTP tensors, no
    `num_nextn_predict_layers` in config.json."""
    src = str(default_model_dir())
    os.makedirs(dst, exist_ok=True)
    ck = SafetensorsCheckpoint(src)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    mtp = f"model.layers.{cfg['num_hidden_layers']}."
    from safetensors.numpy import save_file

    save_file({k: np.array(ck.get(k)) for k in ck.keys() if not k.startswith(mtp)}, os.path.join(dst, "model.safetensors"))
    cfg.pop("num_nextn_predict_layers")
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in os.listdir(src):
        if name not in ("config.json", "model.safetensors") and os.path.isfile(os.path.join(src, name)):
            with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
                b.write(a.read())
    return dst


def test_a_checkpoint_without_mtp_loads_serves_and_refuses_mtp(tmp_path, caplog):
    from serving.engine import EngineArgs
    from serving.engine_factory import build_engine
    from serving.llm import LLM
    from serving.types import SamplingParams

    path = _no_mtp_checkpoint(str(tmp_path / "no_mtp"))
    with caplog.at_level(logging.INFO, logger="glm53.loader"):
        model = load_model(path, progress=False)
    assert model.mtp is None
    lines = [r.getMessage() for r in caplog.records if "without MTP" in r.getMessage()]
    assert len(lines) == 1 and "--speculative-config" in lines[0]
    # Serving: the same greedy tokens as the full checkpoint (MTP plays no part without speculation).
    engine = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, cuda_graph_sizes=[], precompile_token_paddings=[])
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = LLM(path, **engine).generate([[5, 6, 7, 8, 9]], params)[0].outputs[0].token_ids
    want = LLM(str(default_model_dir()), **engine).generate([[5, 6, 7, 8, 9]], params)[0].outputs[0].token_ids
    assert got == want and len(got) == 6
    with pytest.raises(ValueError, match="--speculative-config.*MTP layer"):
        build_engine(EngineArgs(model=path, speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                                       **engine))


def test_served_greedy_streams_equal_with_fp8_kept_and_dequantised(tmp_path):
    """The engine on the FP8 copy of the tiny checkpoint, weights kept vs dequantised at load:
    the same greedy streams (docs/design.md §10's rule: a divergence must sit at a top-2 near-tie)."""
    from glm53.equality import compare_streams
    from serving.llm import LLM
    from serving.types import SamplingParams

    path = write_fp8_checkpoint(str(default_model_dir()), str(tmp_path / "fp8"))
    engine = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, cuda_graph_sizes=[], precompile_token_paddings=[])
    rng = np.random.default_rng(3)
    prompts = [rng.integers(4, 500, n).tolist() for n in (9, 40, 70)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    ref = LLM(path, quantization="none", **engine).generate(prompts, params)
    got = LLM(path, **engine).generate(prompts, params)
    assert all(o.outputs[0].token_ids for o in got)
    compare_streams({i: o.outputs[0].token_ids for i, o in enumerate(ref)},
                    {i: o.outputs[0].token_ids for i, o in enumerate(got)},
                    {i: o.outputs[0].logprobs for i, o in enumerate(ref)}, {})


def test_in_memory_fp8_tensors_match_the_file_loader(tmp_path):
    """`fp8_tensors` through `InMemoryCheckpoint` gives the same model as the same tensors on disk."""
    from flax import nnx

    from glm53.config import GlmConfig
    from glm53.loader import load_weights
    from glm53.model import GlmForCausalLM
    from glm53.safetensors_reader import InMemoryCheckpoint

    d = write_fp8_checkpoint(os.path.join(FIXTURES, "dense"), str(tmp_path / "d"), block=(32, 16))
    cfg = GlmConfig.from_pretrained(d)
    ck = SafetensorsCheckpoint(os.path.join(FIXTURES, "dense"))
    tensors = fp8_tensors({k: np.array(ck.get(k)) for k in ck.keys()}, (32, 16))
    a = load_weights(GlmForCausalLM(cfg, quant=WeightQuant((32, 16))), InMemoryCheckpoint(tensors), progress=False)
    b = load_model(d, progress=False)
    for x, y in zip(_leaves(a), _leaves(b)):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x).astype(np.float32), np.asarray(y).astype(np.float32))
    assert any(x.dtype == ml_dtypes.float8_e4m3fn for x in jax_leaves_np(nnx.state(b, nnx.Param)))


def jax_leaves_np(state):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(state)]
