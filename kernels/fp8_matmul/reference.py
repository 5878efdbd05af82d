"""Block-scaled FP8 weight matmuls — pure JAX (the CPU path and the oracle) and the quantiser.

Format (DeepSeek-V3 / GLM-5.3 FP8 checkpoints, the DeepGEMM recipe). A weight `w [K, N]` (already
transposed to [in, out]) is stored as

    w_fp8      float8_e4m3fn [K, N]                      (e4m3: max finite 448, no inf)
    scale_inv  float32       [ceil(K / bk), ceil(N / bn)]

with a static `block = (bk, bn)` (GLM-5.3: (128, 128)); the real weight is

    w[k, n] = float(w_fp8[k, n]) · scale_inv[k // bk, n // bn].

Blocks at the K and N edges may be partial (K, N need not be multiples of the block). Weights may
carry leading batch axes `[..., K, N]` with scales `[..., ceil(K/bk), ceil(N/bn)]` (stacked layers,
experts) in every function of this module.

Quantisation (`quantize_fp8_blocks`, `quantize_fp8_blocks_np`): per block, `amax = max |w|`,
`scale_inv = amax / 448` (an fp32 division, in JAX and numpy alike: the two quantisers agree bit
for bit; 1.0 for an all-zero block), `w_fp8 = clip(w / scale_inv, ±448)` rounded
to the nearest e4m3 value (ties to even). Every block's largest entry maps to ±448 exactly; the
relative error of any other entry is at most 2^-4 (half an e4m3 ulp, 3 mantissa bits) for normal
codes and `2^-10 · scale_inv` absolute for subnormal ones (|w| < 2^-6 · scale_inv).

Matmuls: `x [..., K]` (bfloat16 or float32) times the dequantised weight, which is cast to x's
dtype before the dot (a bf16 x gives a bf16 × bf16 dot; fp8 → bf16 is exact, the scale multiply
rounds once to bf16), fp32 accumulation (`preferred_element_type=float32`,
`precision=HIGHEST`), result cast to `out_dtype` (default x's dtype). The grouped form is the MoE
expert matmul with `jax.lax.ragged_dot` semantics. The Pallas kernel (`pallas_triton`) instead
applies the fp32 scale to each block's partial product (DeepGEMM's promotion); both are the same
maths up to where the rounding falls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Shape of `scale_inv` for a weight of `shape` `[..., K, N]`: `[..., ceil(K/bk), ceil(N/bn)]`."""
    *lead, K, N = shape
    bk, bn = block
    return (*lead, _cdiv(K, bk), _cdiv(N, bn))


def _check_block(block) -> tuple[int, int]:
    bk, bn = (int(b) for b in block)
    if bk <= 0 or bn <= 0:
        raise ValueError(f"block {block} must be two positive ints")
    return bk, bn


def _blocked(w, block, xp):
    """`[..., K, N]` → zero-padded `[..., Kb, bk, Nb, bn]` (xp: jnp or np)."""
    *lead, K, N = w.shape
    bk, bn = block
    Kb, Nb = _cdiv(K, bk), _cdiv(N, bn)
    pad = [(0, 0)] * len(lead) + [(0, Kb * bk - K), (0, Nb * bn - N)]
    return xp.pad(w, pad).reshape(*lead, Kb, bk, Nb, bn)


def _expand(scale_inv, K: int, N: int, block, xp):
    """`[..., Kb, Nb]` → `[..., K, N]` (each scale repeated over its block, edges cut)."""
    bk, bn = block
    s = xp.repeat(xp.repeat(scale_inv, bk, axis=-2), bn, axis=-1)
    return s[..., :K, :N]


@functools.partial(jax.jit, static_argnames=("block",))
def quantize_fp8_blocks(w: jax.Array, block: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """Quantise `w [..., K, N]` (any float dtype) to `(w_fp8 float8_e4m3fn [..., K, N],
    scale_inv float32 [..., ceil(K/bk), ceil(N/bn)])` (module docstring)."""
    block = _check_block(block)
    *lead, K, N = w.shape
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(_blocked(w32, block, jnp)), axis=(-3, -1))  # [..., Kb, Nb]
    # A true fp32 division like numpy's: XLA rewrites a division by a (broadcast) scalar as a
    # multiplication by its rounded reciprocal (1 ulp off); a full-shape divisor behind a barrier stays.
    fp8_max = lax.optimization_barrier(jnp.full(amax.shape, FP8_MAX, jnp.float32))
    scale_inv = jnp.where(amax > 0, amax / fp8_max, 1.0).astype(jnp.float32)
    divisor = lax.optimization_barrier(_expand(scale_inv, K, N, block, jnp))  # a true division here too
    q = jnp.clip(w32 / divisor, -FP8_MAX, FP8_MAX)
    return q.astype(FP8_DTYPE), scale_inv


def quantize_fp8_blocks_np(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """`quantize_fp8_blocks` in numpy for host-side use (the checkpoint loader quantises bf16
    tensors one by one): `(w_fp8 ml_dtypes.float8_e4m3fn [..., K, N], scale_inv float32 [..., Kb, Nb])`.
    Same values as the JAX version (fp32 division, round to nearest even, clip to ±448)."""
    block = _check_block(block)
    w32 = np.asarray(w).astype(np.float32)
    *lead, K, N = w32.shape
    amax = np.max(np.abs(_blocked(w32, block, np)), axis=(-3, -1))
    scale_inv = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = np.clip(w32 / _expand(scale_inv, K, N, block, np), -FP8_MAX, FP8_MAX)
    return q.astype(ml_dtypes.float8_e4m3fn), scale_inv


@functools.partial(jax.jit, static_argnames=("block", "dtype"))
def dequantize_fp8_blocks(w_fp8: jax.Array, scale_inv: jax.Array, block: tuple[int, int],
                          dtype=jnp.float32) -> jax.Array:
    """`w_fp8 [..., K, N]`, `scale_inv [..., Kb, Nb]` → the real weight `[..., K, N]` in `dtype`
    (the product is formed in fp32, then cast)."""
    block = _check_block(block)
    *_, K, N = w_fp8.shape
    if scale_inv.shape != scale_shape(w_fp8.shape, block):
        raise ValueError(f"scale_inv {scale_inv.shape} != {scale_shape(w_fp8.shape, block)} for w {w_fp8.shape}, "
                         f"block {block}")
    w = w_fp8.astype(jnp.float32) * _expand(scale_inv.astype(jnp.float32), K, N, block, jnp)
    return w.astype(dtype)


@functools.partial(jax.jit, static_argnames=("block", "out_dtype"))
def fp8_matmul_reference(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array, *, block: tuple[int, int],
                         out_dtype=None) -> jax.Array:
    """`x @ dequantise(w_fp8, scale_inv)` with fp32 accumulation.

    Args:
      x: `[..., K]` bfloat16 or float32.
      w_fp8: float8_e4m3fn `[K, N]`, or `[..., K, N]` with leading batch axes (then x is
        `[..., M, K]` and the batch axes broadcast as in `jnp.matmul`).
      scale_inv: float32 `[ceil(K/bk), ceil(N/bn)]` (with the same leading axes as w_fp8).
      block: `(bk, bn)`, static.
      out_dtype: result dtype (default x.dtype).
    Returns:
      `[..., N]` (2-D weight) or the `jnp.matmul` shape `[..., M, N]` (batched weight).
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    w = dequantize_fp8_blocks(w_fp8, scale_inv, block).astype(x.dtype)
    if w.ndim == 2:
        y = lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
    else:
        y = jnp.matmul(x, w, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("block",))
def fp8_grouped_matmul_reference(x: jax.Array, w_fp8: jax.Array, scale_inv: jax.Array, group_sizes: jax.Array, *,
                                 block: tuple[int, int]) -> jax.Array:
    """MoE expert matmul over fp8 expert weights, `jax.lax.ragged_dot` semantics.

    Args:
      x: `[M, K]` bfloat16 or float32, rows sorted by expert: rows `[G_e, G_e + group_sizes[e])`
        (G_e = Σ_{e' < e} group_sizes[e']) belong to expert e.
      w_fp8: float8_e4m3fn `[E, K, N]`; scale_inv: float32 `[E, ceil(K/bk), ceil(N/bn)]`.
      group_sizes: int32 `[E]` (traced; zeros allowed; Σ may be < M: rows past the sum give 0).
      block: `(bk, bn)`, static.
    Returns:
      float32 `[M, N]`: row r of group e is `x[r] @ w_e` (w_e dequantised and cast to x's dtype,
      fp32 accumulation, HIGHEST precision).
    """
    w = dequantize_fp8_blocks(w_fp8, scale_inv, block).astype(x.dtype)
    return lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
