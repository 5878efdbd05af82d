"""Row access into the paged KV arena: encode/decode, gather by slot, scatter by slot.

These are the cache-write and cache-read primitives every op uses (pure JAX; the CPU path and the
oracle for GPU kernels). Shapes: `kv_arena uint32[num_blocks, page_words]`, `slots int32[N]`,
logical rows `uint32[N, row_words]` (segments concatenated; `layout.py`). `layer` may be a traced
int32 scalar (layers scanned over).

Quantise on write, dequantise on read: `write_cache` encodes fp32/bf16 values into the
component's row dtype (fp8 formats compute their scales here) and `read_cache` decodes to fp32.
For `fp8_per_token_hadamard` rows the stored values are the keys rotated by H; `read_cache`
undoes the rotation unless `stored_basis=True` (what the indexer uses, rotating its queries by
`to_key_basis` instead).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged import fp8
from kernels.paged.layout import FP8_KEY_DTYPES, GroupLayout, row_segments


def encode_rows(x: jax.Array, row_dtype: str, rope_dim: int = 0) -> jax.Array:
    """Values `[..., width]` → logical row words `uint32[..., row_words]` (rounding/quantising).

    `rope_dim`: fp8_ds_mla's trailing bf16 part (R). Hadamard rows are rotated before quantising.
    """
    if row_dtype == "float32":
        return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    if row_dtype == "bfloat16":
        return fp8.encode_bf16_words(x)
    if row_dtype == "fp8_ds_mla":
        return fp8.encode_fp8_ds_mla(x, rope_dim)
    if row_dtype == "fp8_per_token":
        return fp8.encode_fp8_key(x)
    if row_dtype == "fp8_per_token_hadamard":
        return fp8.encode_fp8_key(fp8.hadamard_rotate(x))
    raise ValueError(f"unknown row dtype {row_dtype!r}")


def decode_rows(w: jax.Array, row_dtype: str, rope_dim: int = 0) -> jax.Array:
    """Logical row words `uint32[..., row_words]` → float32 values `[..., width]` in the stored basis.

    Pure 32-bit jnp, usable inside a kernel. For Hadamard rows the result is `k·H` (see
    `to_key_basis`).
    """
    if row_dtype == "float32":
        return lax.bitcast_convert_type(w, jnp.float32)
    if row_dtype == "bfloat16":
        return fp8.decode_bf16_words(w)
    if row_dtype == "fp8_ds_mla":
        nw = w.shape[-1]
        # words = A/4 + A/128 + R/2 = 33·A/128 + R/2
        latent = (nw - rope_dim // 2) * fp8.FP8_TILE // 33
        return fp8.decode_fp8_ds_mla_words(w, latent, rope_dim)
    if row_dtype in FP8_KEY_DTYPES:
        return fp8.decode_fp8_key_words(w[..., :-1], w[..., -1])
    raise ValueError(f"unknown row dtype {row_dtype!r}")


def to_key_basis(x: jax.Array, row_dtype: str) -> jax.Array:
    """Map vectors into the basis the rows are stored in: `x·H` for Hadamard rows, else `x` (fp32).

    Scores against stored rows are unchanged by the rotation: (q·H)·(k·H) = q·k.
    """
    if row_dtype == "fp8_per_token_hadamard":
        return fp8.hadamard_rotate(x)
    return x.astype(jnp.float32)


def slot_valid(slots: jax.Array, tokens_per_page: int) -> jax.Array:
    """True where a slot names a real row: not −1 and not inside the null block 0."""
    return slots >= tokens_per_page


def row_location(slots: jax.Array, layout: GroupLayout, component: str, layer):
    """(block `[...]`, start word of each segment: a tuple of `[...]` int32) for `slots` (≥ 0).

    Start of segment s: `base + layer·tpp·row_words + tpp·Σ seg[:s] + (slot % tpp)·seg[s]`
    (`layout.py`), in the page `block = slot // tpp`.
    """
    base, comp = layout.component(component)
    tpp = layout.tokens_per_page
    block = slots // tpp
    off = slots % tpp
    region = base + layer * tpp * comp.row_words
    starts, prefix = [], 0
    for sw in comp.segments:
        starts.append((region + tpp * prefix + off * sw).astype(jnp.int32))
        prefix += sw
    return block.astype(jnp.int32), tuple(starts)


def gather_rows(kv_arena: jax.Array, slots: jax.Array, layout: GroupLayout, component: str, layer) -> jax.Array:
    """Logical rows at `slots` (any shape `[...]`) of one layer of one component → `uint32[..., row_words]`.

    Invalid slots (−1 or the null block) return words of block 0's page (callers mask them with
    `slot_valid`); no out-of-bounds read happens.
    """
    _, comp = layout.component(component)
    shape = slots.shape
    flat = slots.reshape(-1)
    valid = slot_valid(flat, layout.tokens_per_page)
    block, starts = row_location(jnp.where(valid, flat, 0), layout, component, layer)
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0, 1))
    parts = [
        lax.gather(kv_arena, jnp.stack([block, start], axis=-1), dnums, slice_sizes=(1, sw),
                   mode=lax.GatherScatterMode.CLIP)
        for start, sw in zip(starts, comp.segments)
    ]
    rows = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return rows.reshape(*shape, comp.row_words)


def scatter_rows(
    kv_arena: jax.Array, slots: jax.Array, rows: jax.Array, layout: GroupLayout, component: str, layer
) -> jax.Array:
    """Write logical `rows uint32[N, row_words]` at `slots int32[N]`; −1 and null-block slots are dropped."""
    _, comp = layout.component(component)
    valid = slot_valid(slots, layout.tokens_per_page)
    block, starts = row_location(jnp.where(valid, slots, 0), layout, component, layer)
    # Dropped writes are sent out of bounds and discarded by FILL_OR_DROP.
    block = jnp.where(valid, block, kv_arena.shape[0]).astype(jnp.int32)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
    )
    rows = rows.astype(jnp.uint32)
    lo = 0
    for start, sw in zip(starts, comp.segments):
        kv_arena = lax.scatter(kv_arena, jnp.stack([block, start], axis=-1), rows[:, lo: lo + sw], dnums,
                               mode=lax.GatherScatterMode.FILL_OR_DROP, indices_are_sorted=False,
                               unique_indices=False)
        lo += sw
    return kv_arena


def write_cache(
    kv_arena: jax.Array, values: jax.Array, slot_mapping: jax.Array, layout: GroupLayout, component: str, layer
) -> jax.Array:
    """Cache-write op: encode `values [N, width]` as the component's row dtype (quantising for
    fp8) and scatter them by `slot_mapping int32[N]` (−1 slots and null-block slots dropped).

    Raises ValueError when the width does not match the layout.
    """
    _, comp = layout.component(component)
    if values.shape[-1] != comp.width:
        raise ValueError(f"{component}: row width {values.shape[-1]} != layout width {comp.width}")
    rows = encode_rows(values, comp.row_dtype, comp.rope_dim)
    return scatter_rows(kv_arena, slot_mapping, rows, layout, component, layer)


def read_cache(kv_arena: jax.Array, slots: jax.Array, layout: GroupLayout, component: str, layer,
               *, stored_basis: bool = False) -> jax.Array:
    """Cache-read op: rows at `slots [...]` decoded to float32 `[..., width]` (invalid slots give garbage).

    `stored_basis=True` skips undoing the Hadamard rotation of `fp8_per_token_hadamard` rows.
    """
    _, comp = layout.component(component)
    x = decode_rows(gather_rows(kv_arena, slots, layout, component, layer), comp.row_dtype, comp.rope_dim)
    if comp.row_dtype == "fp8_per_token_hadamard" and not stored_basis:
        x = fp8.hadamard_rotate(x)  # H is its own inverse
    return x


def positions_to_slots(
    positions: jax.Array, block_table_BP: jax.Array, req_idx_T: jax.Array, tokens_per_page: int
) -> jax.Array:
    """Request-local positions `[T, K]` (−1 = none) of the requests `req_idx_T [T]` → slots, through
    the block tables `[B, P]`.

    slot = block_table[p // tpp] * tpp + p % tpp; −1 stays −1, and a position whose page is the
    null block maps to −1 (absent).
    """
    p = jnp.maximum(positions, 0)
    page = jnp.minimum(p // tokens_per_page, block_table_BP.shape[-1] - 1)
    block = block_table_BP[req_idx_T[:, None], page]
    slots = block * tokens_per_page + p % tokens_per_page
    return jnp.where((positions >= 0) & (block > 0), slots, -1).astype(jnp.int32)


def copy_pages(kv_arena: jax.Array, src_C: jax.Array, dst_C: jax.Array) -> jax.Array:
    """Whole-page copies `kv_arena[dst_C[i]] = kv_arena[src_C[i]]`, applied in order i = 0, 1, ...

    Args:
      kv_arena: `uint32[num_blocks, page_words]` (donate it: the copies are done in place).
      src_C, dst_C: int32 `[C]` block ids. The valid entries come first; the first entry with
        `dst_C < 0` and everything after it are padding (not copied). A copy reads the arena as
        left by the copies before it, so a page may be copied out and then overwritten in the
        same call.

    Returns:
      The updated arena. The loop runs only over the valid entries (a while loop with a traced
      trip count), so padding costs nothing.
    """
    valid = dst_C >= 0
    n = jnp.argmin(jnp.concatenate([valid, jnp.zeros((1,), bool)]))  # leading valid entries

    def body(i, arena):
        page = lax.dynamic_slice_in_dim(arena, src_C[i], 1, axis=0)
        return lax.dynamic_update_slice_in_dim(arena, page, dst_C[i], axis=0)

    return lax.fori_loop(0, n.astype(jnp.int32), body, kv_arena)
