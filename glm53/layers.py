"""Small building blocks: linear projections, norms, interleaved RoPE.

Every module accepts `stack=(G,)` to create its parameters with leading stacked axes (the
IndexShare groups scanned over, docs/design.md §3.4); the forward code never sees the stacked axis.
Linear weights are stored `[in, out]` (the HF checkpoint's `[out, in]` transposed at load).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from glm53.quant import scale_shape
from kernels.fp8_matmul import dequantize_fp8_blocks, fp8_matmul


def mm(x: jax.Array, w: jax.Array) -> jax.Array:
    """`x [..., in] @ w [in, out]` with fp32 accumulation, returned in x's dtype."""
    y = jnp.einsum("...i,io->...o", x, w.astype(x.dtype), preferred_element_type=jnp.float32,
                   precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


class Linear(nnx.Module):
    """Bias-free projection. weight `[*stack, in, out]` in `dtype`, or with `block=(bk, bn)` FP8
    kept on the device: weight float8_e4m3fn `[*stack, in, out]` and `weight_scale_inv` fp32
    `[*stack, ceil(in/bk), ceil(out/bn)]` (glm53/quant.py), multiplied by `kernels.fp8_matmul`."""

    def __init__(self, d_in: int, d_out: int, *, dtype, stack: tuple[int, ...] = (),
                 block: tuple[int, int] | None = None, rule: str | None = None):
        self.block = block
        self.rule = rule  # a path its partition rule matches (sharding/rules.py), e.g. "self_attn.o_proj.weight"
        if block is None:
            self.weight = nnx.Param(jnp.zeros((*stack, d_in, d_out), dtype))
            self.weight_scale_inv = None
        else:
            self.weight = nnx.Param(jnp.zeros((*stack, d_in, d_out), jnp.float8_e4m3fn))
            self.weight_scale_inv = nnx.Param(jnp.ones(scale_shape((*stack, d_in, d_out), block), jnp.float32))

    def __call__(self, x: jax.Array, parallel=None) -> jax.Array:
        """`x [..., in]` → `[..., out]` in x's dtype (fp32 accumulation).

        `parallel` (a `sharding.mesh.ParallelLayout`; None on one device): an FP8 weight is then
        multiplied shard by shard inside `shard_map` (the kernel is a custom call XLA cannot
        partition): each device runs the kernel on its own weight shard, a split input dimension
        is summed over its devices in fp32. Unquantised weights are partitioned by XLA."""
        if self.block is None:
            return mm(x, self.weight[...])
        w, s = self.weight[...], self.weight_scale_inv[...]
        if parallel is None or parallel.is_single_device:
            return fp8_matmul(x, w, s, block=self.block)
        if self.rule is None:
            raise ValueError("an FP8 Linear under a parallel layout needs its partition rule path (rule=)")
        return _sharded_fp8_linear(x, w, s, self.block, parallel, self.rule)

    def dense_weight(self, dtype=jnp.float32) -> jax.Array:
        """The real weight `[*stack, in, out]` (dequantised when FP8)."""
        if self.block is None:
            return self.weight[...].astype(dtype)
        return dequantize_fp8_blocks(self.weight[...], self.weight_scale_inv[...], self.block, dtype=dtype)


def _sharded_fp8_linear(x, w, s, block, parallel, rule: str):
    """`fp8_matmul` per device over the weight shards given by the partition rule of `rule`:
    tokens stay split as the model keeps them (TOKENS), the weight's output dimension splits the
    output, a split input dimension is psum-ed in fp32."""
    from sharding.mesh import TOKENS
    from sharding.rules import param_roles

    in_role, out_role = param_roles(rule, 2)
    sum_axes = parallel.axes(in_role)
    lead = x.shape[:-1]

    def body(x2, w, s):
        y = fp8_matmul(x2, w, s, block=block, out_dtype=jnp.float32)
        if sum_axes:
            y = lax.psum(y, sum_axes)
        return y.astype(x2.dtype)

    wspec = parallel.spec(in_role, out_role)
    f = jax.shard_map(body, mesh=parallel.mesh, check_vma=False, out_specs=parallel.spec(TOKENS, out_role),
                      in_specs=(parallel.spec(TOKENS, in_role), wspec, wspec))
    return f(x.reshape(-1, x.shape[-1]), w, s).reshape(*lead, w.shape[-1])


class RMSNorm(nnx.Module):
    """RMSNorm computed in fp32: `weight * (x / sqrt(mean(x²) + eps)).astype(x.dtype)` (HF order)."""

    def __init__(self, dim: int, eps: float, *, dtype, stack: tuple[int, ...] = ()):
        self.weight = nnx.Param(jnp.ones((*stack, dim), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias, fp32 compute (the indexer's `k_norm`, eps 1e-6)."""

    def __init__(self, dim: int, eps: float = 1e-6, *, dtype, stack: tuple[int, ...] = ()):
        self.weight = nnx.Param(jnp.ones((*stack, dim), dtype))
        self.bias = nnx.Param(jnp.zeros((*stack, dim), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mu = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
        y = (xf - mu) * lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(positions: jax.Array, rope_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin `[T, rope_dim // 2]` (fp32) for the default RoPE, frequencies theta^(-2i/rope_dim)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved RoPE on `x [T, ..., R]`: pair (2i, 2i+1) rotated by frequency i.

    Output keeps the interleaved layout (DeepSeek / vLLM convention). HF transformers writes the
    rotated pairs de-interleaved instead; both orders give the same q·k, which is all that matters.
    cos/sin: `[T, R/2]`.
    """
    shape = x.shape
    xf = x.astype(jnp.float32).reshape(*shape[:-1], shape[-1] // 2, 2)
    extra = xf.ndim - 3  # axes between T and the pair axis
    c = cos.reshape(cos.shape[0], *([1] * extra), cos.shape[1])
    s = sin.reshape(sin.shape[0], *([1] * extra), sin.shape[1])
    x0, x1 = xf[..., 0], xf[..., 1]
    out = jnp.stack([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)
    return out.reshape(shape).astype(x.dtype)
