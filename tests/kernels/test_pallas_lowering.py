"""The Pallas kernels lower for CUDA without a GPU: `jax.export` for platform "cuda" with an
abstract H200 device traces each kernel through the Pallas→Triton lowering into the Triton IR that
XLA's GPU compiler consumes. Catches what interpret mode cannot: primitives without a Triton
lowering, non-power-of-two tensors, dot shapes Triton refuses. (Triton IR → PTX happens only on a
machine with a GPU; scripts/bench_kernels.py runs that.)"""

import functools

import jax
import jax.numpy as jnp
import pytest

from kernels.fp8_matmul.pallas_triton import (
    fp8_grouped_matmul_pallas_triton,
    fp8_matmul_pallas_triton,
)
from kernels.hot_resolve.pallas_triton import hot_resolve_pallas_triton
from kernels.indexer_topk.pallas_triton import indexer_topk_pallas_triton
from kernels.paged import CacheComponent, GroupLayout
from kernels.sparse_mla.pallas_triton import sparse_mla_pallas_triton
from tests.helpers.triton_lowering import (
    TRITON_CALL,
    export_cuda,
    record_triton_lowerings,
)


@pytest.fixture
def verified(monkeypatch):
    """The MLIR verifier's result on every Triton module the lowering builds."""
    return record_triton_lowerings(monkeypatch, lambda m: m.verified)


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("row_dtype,precision", [("float32", "highest"), ("bfloat16", "bf16"), ("bfloat16", "highest"),
                                                 ("fp8_ds_mla", "bf16"), ("fp8_ds_mla", "highest")])
def test_sparse_mla_lowers_for_cuda_at_production_shapes(verified, row_dtype, precision):
    rope = 64 if row_dtype == "fp8_ds_mla" else 0  # 656-byte rows: 512 e4m3, 4 fp32 scales, 64 bf16
    lay = GroupLayout("mla", 64, (CacheComponent("mla", 2, 576, row_dtype, rope_dim=rope),))
    f = functools.partial(sparse_mla_pallas_triton, layout=lay, kv_lora_rank=512, scale=576 ** -0.5,
                          precision=precision)
    text = export_cuda(f, S((4, 64, 576), jnp.bfloat16), S((64, lay.words_per_page), jnp.uint32),
                        S((4, 2048), jnp.int32), S((), jnp.int32))
    assert text.count(TRITON_CALL) == 1 and verified == [True]


@pytest.mark.parametrize("row_dtype,precision", [("float32", "highest"), ("bfloat16", "bf16"),
                                                 ("fp8_per_token", "bf16"), ("fp8_per_token_hadamard", "highest")])
def test_indexer_scores_lower_for_cuda_at_production_shapes(verified, row_dtype, precision):
    lay = GroupLayout("idx", 64, (CacheComponent("indexer", 2, 128, row_dtype),))
    f = functools.partial(indexer_topk_pallas_triton, layout=lay, topk=2048, precision=precision)
    # An arena over 4 GiB (the lowering then computes 64-bit load offsets).
    text = export_cuda(f, S((8, 32, 128), jnp.bfloat16), S((8, 32), jnp.float32),
                        S((1 << 19, lay.words_per_page), jnp.uint32), S((8, 200), jnp.int32), S((8,), jnp.int32),
                        S((8,), jnp.int32), S((), jnp.int32))
    assert text.count(TRITON_CALL) == 1 and verified == [True]


@pytest.mark.parametrize("T", [65, 4 * 65])
def test_hot_resolve_lowers_for_cuda_at_production_shapes(verified, T):
    """65 batch rows (64 requests and a padding row), K = 2048, hot state width 4096 (64 pages of
    64 tokens) of 64 state rows; decode (one query row per request) and 4 query rows per request.
    The resolver is four Triton kernels (validate, lookup, rank, assign)."""
    B, K, P, H, S_rows, M = 65, 2048, 2048, 64, 64, 4096
    f = functools.partial(hot_resolve_pallas_triton, tokens_per_page=64)
    i32 = jnp.int32
    text = export_cuda(f, S((T, K), i32), S((T,), i32), S((B, P), i32), S((B, P), i32), S((B, H), i32),
                        S((B,), i32), S((B,), i32), S((S_rows, M), i32), S((S_rows, M), i32), S((), i32))
    assert text.count(TRITON_CALL) == 4 and verified == [True] * 4


F8 = jnp.float8_e4m3fn


def _fp8_weight_untouched(text):
    """The fp8 weight reaches the Triton call as it is: no XLA op (convert, pad, copy) touches it."""
    return [line for line in text.splitlines()
            if "f8E4M3FN" in line and "stablehlo." in line and "custom_call" not in line] == []


# GLM-5.3 (block 128 × 128): q_b_proj TP8 [2048, 2048], kv_a_proj [6144, 576] (a partial N block),
# o_proj TP8 [2048, 6144]; decode M = 1, 128 (split K at small M) and prefill M = 4096.
@pytest.mark.parametrize("M", [1, 128, 4096])
@pytest.mark.parametrize("K,N", [(2048, 2048), (6144, 576), (2048, 6144)])
def test_fp8_matmul_lowers_for_cuda_at_production_shapes(verified, M, K, N):
    f = functools.partial(fp8_matmul_pallas_triton, block=(128, 128))
    text = export_cuda(f, S((M, K), jnp.bfloat16), S((K, N), F8), S((K // 128, -(-N // 128)), jnp.float32))
    assert text.count(TRITON_CALL) == 1 and verified == [True]
    assert _fp8_weight_untouched(text)


def test_fp8_matmul_lowers_with_fp32_activations(verified):
    f = functools.partial(fp8_matmul_pallas_triton, block=(128, 128), out_dtype=jnp.bfloat16)
    text = export_cuda(f, S((16, 6144), jnp.float32), S((6144, 576), F8), S((48, 5), jnp.float32))
    assert text.count(TRITON_CALL) == 1 and verified == [True]


# MoE experts, 256 experts / EP8 = 32 per rank, 128 tokens × 8 experts = 1024 rows: the gate/up
# projection [32, 6144, 2048] and the down projection [32, 2048, 6144].
@pytest.mark.parametrize("K,N", [(6144, 2048), (2048, 6144)])
def test_fp8_grouped_matmul_lowers_for_cuda_at_production_shapes(verified, K, N):
    f = functools.partial(fp8_grouped_matmul_pallas_triton, block=(128, 128))
    text = export_cuda(f, S((1024, K), jnp.bfloat16), S((32, K, N), F8), S((32, K // 128, N // 128), jnp.float32),
                        S((32,), jnp.int32))
    assert text.count(TRITON_CALL) == 1 and verified == [True]
    assert _fp8_weight_untouched(text)


# ---------------------------------------------------------------- 32- vs 64-bit element offsets
# JAX 0.11.2's Pallas→Triton lowering addresses an operand with 64-bit element offsets only when it
# is over 2**32 bytes. These tests pin that rule at GLM-5.3's sizes (an upgrade that changes it
# fails here): the KV arena of a 29 GiB budget (9,508 pages of 818,688 words for the fp8 cache) is
# read with 64-bit offsets by the sparse-MLA and indexer kernels, and a one-byte FP8 weight of
# 2–4 GiB — whose element offsets would wrap in 32 bits — is refused by the FP8 matmul's
# `unsupported_reason` (the dispatcher then runs the reference).


@pytest.fixture
def triton_modules(monkeypatch):
    """The text of every Triton module the lowering builds during the test."""
    return record_triton_lowerings(monkeypatch, lambda m: m.text)


def _offset_types(text: str, pointee: str) -> set[str]:
    """Element types of the offsets added (`tt.addptr`) to pointers to `pointee` (e.g. "i32", "f8E4M3FN")."""
    import re

    pat = r"tt\.addptr[^\n]*?:\s*tensor<[^>]*!tt\.ptr<" + pointee + r"[^>]*>>\s*,\s*tensor<([^>]*)>"
    return {m.split("x")[-1] for m in re.findall(pat, text)}


GLM53_ARENA_PAGES = 9_508  # a 29 GiB KV budget on one H200 at the fp8 cache's 3,274,752-byte pages


@pytest.mark.parametrize("pages,want", [(64, {"i32"}), (GLM53_ARENA_PAGES, {"i64"})])
def test_the_attention_kernels_address_a_production_arena_with_64_bit_offsets(triton_modules, pages, want):
    from glm53.config import preset
    from glm53.kv_layout import build_kv_layout

    lay = build_kv_layout(preset("glm-5.3"), "fp8")
    assert GLM53_ARENA_PAGES * lay.page_words * 4 > 2**32 > 64 * lay.page_words * 4  # over / under 4 GiB
    mla = functools.partial(sparse_mla_pallas_triton, layout=lay.group("mla"), kv_lora_rank=512,
                            scale=576 ** -0.5, precision="bf16")
    export_cuda(mla, S((4, 64, 576), jnp.bfloat16), S((pages, lay.page_words), jnp.uint32),
                 S((4, 2048), jnp.int32), S((), jnp.int32))
    idx = functools.partial(indexer_topk_pallas_triton, layout=lay.group("indexer"), topk=2048, precision="bf16")
    export_cuda(idx, S((4, 32, 128), jnp.bfloat16), S((4, 32), jnp.float32), S((pages, lay.page_words), jnp.uint32),
                 S((2, 911), jnp.int32), S((4,), jnp.int32), S((4,), jnp.int32), S((), jnp.int32))
    arena_offsets = set().union(*(_offset_types(t, "i32") for t in triton_modules))  # the arena is read as words
    assert triton_modules and want <= arena_offsets, arena_offsets
    if want == {"i64"}:
        # every kernel that reads the arena addresses it in 64 bits
        assert all("i64" in _offset_types(t, "i32") for t in triton_modules if _offset_types(t, "i32"))


@pytest.mark.parametrize("experts,wraps", [(32, False), (128, True), (256, False)])
def test_fp8_weights_of_2_to_4_gib_are_refused_where_32_bit_offsets_would_wrap(triton_modules, experts, wraps):
    """Grouped FP8 weights [E, 6144, 4096]: E = 32 (one GPU's share at EP8, 0.8 GB) and 256 (6.4 GB,
    over 4 GiB: 64-bit offsets) lower; E = 128 (3.2 GB: 2**31 < elements ≤ 2**32 bytes) is refused."""
    from kernels.fp8_matmul.pallas_triton import unsupported_reason

    K, N = 6144, 4096
    specs = (S((1024, K), jnp.bfloat16), S((experts, K, N), jnp.float8_e4m3fn),
             S((experts, K // 128, N // 128), jnp.float32), S((experts,), jnp.int32))
    reason = unsupported_reason(specs[0], specs[1], specs[2], block=(128, 128), grouped=True)
    if wraps:
        assert reason is not None and "32-bit element offsets" in reason
        return
    assert reason is None
    export_cuda(functools.partial(fp8_grouped_matmul_pallas_triton, block=(128, 128)), *specs)
    weight_offsets = set().union(*(_offset_types(t, "f8E4M3FN") for t in triton_modules))
    assert weight_offsets == ({"i64"} if experts * K * N > 2**32 else {"i32"}), weight_offsets
