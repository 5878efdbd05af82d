"""Row access into the paged KV arena: encode/decode, gather by slot, scatter by slot.

These are the cache-write and cache-read primitives every op uses (pure JAX; the CPU path and the
oracle for GPU kernels). Shapes: `kv_arena uint32[num_blocks, page_words]`, `slots int32[N]`,
rows `uint32[N, row_words]`. `layer` may be a traced int32 scalar (layers scanned over).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged.layout import GroupLayout


def encode_rows(x: jax.Array, row_dtype: str) -> jax.Array:
    """Values `[..., width]` → words `uint32[..., row_words]` (rounding to `row_dtype`)."""
    if row_dtype == "float32":
        return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    if row_dtype == "bfloat16":
        x = x.astype(jnp.bfloat16)
        x = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        return lax.bitcast_convert_type(x, jnp.uint32)
    raise ValueError(f"unknown row dtype {row_dtype!r}")


def decode_rows(w: jax.Array, row_dtype: str) -> jax.Array:
    """Words `uint32[..., row_words]` → float32 values `[..., width]`."""
    if row_dtype == "float32":
        return lax.bitcast_convert_type(w, jnp.float32)
    if row_dtype == "bfloat16":
        x = lax.bitcast_convert_type(w, jnp.bfloat16)  # [..., row_words, 2]
        return x.reshape(*w.shape[:-1], w.shape[-1] * 2).astype(jnp.float32)
    raise ValueError(f"unknown row dtype {row_dtype!r}")


def slot_valid(slots: jax.Array, tokens_per_page: int) -> jax.Array:
    """True where a slot names a real row: not −1 and not inside the null block 0."""
    return slots >= tokens_per_page


def _row_starts(slots, layout: GroupLayout, component: str, layer):
    base, comp = layout.component(component)
    tpp = layout.tokens_per_page
    block = slots // tpp
    off = slots % tpp
    start = base + (layer * tpp + off) * comp.row_words
    return block, start.astype(jnp.int32), comp


def gather_rows(kv_arena: jax.Array, slots: jax.Array, layout: GroupLayout, component: str, layer) -> jax.Array:
    """Rows at `slots` (any shape `[...]`) of one layer of one component → `uint32[..., row_words]`.

    Invalid slots (−1 or the null block) return row 0 of block 0's page region (callers mask them
    with `slot_valid`); no out-of-bounds read happens.
    """
    shape = slots.shape
    flat = slots.reshape(-1)
    valid = slot_valid(flat, layout.tokens_per_page)
    flat = jnp.where(valid, flat, 0)
    block, start, comp = _row_starts(flat, layout, component, layer)
    idx = jnp.stack([block.astype(jnp.int32), start], axis=-1)
    dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0, 1))
    rows = lax.gather(kv_arena, idx, dnums, slice_sizes=(1, comp.row_words), mode=lax.GatherScatterMode.CLIP)
    return rows.reshape(*shape, comp.row_words)


def scatter_rows(
    kv_arena: jax.Array, slots: jax.Array, rows: jax.Array, layout: GroupLayout, component: str, layer
) -> jax.Array:
    """Write `rows uint32[N, row_words]` at `slots int32[N]`; −1 slots and null-block slots are dropped."""
    valid = slot_valid(slots, layout.tokens_per_page)
    block, start, comp = _row_starts(jnp.where(valid, slots, 0), layout, component, layer)
    # Dropped writes are sent out of bounds and discarded by FILL_OR_DROP.
    block = jnp.where(valid, block, kv_arena.shape[0]).astype(jnp.int32)
    idx = jnp.stack([block, start], axis=-1)
    dnums = lax.ScatterDimensionNumbers(
        update_window_dims=(1,), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0, 1)
    )
    return lax.scatter(kv_arena, idx, rows.astype(jnp.uint32), dnums, mode=lax.GatherScatterMode.FILL_OR_DROP,
                       indices_are_sorted=False, unique_indices=False)


def write_cache(
    kv_arena: jax.Array, values: jax.Array, slot_mapping: jax.Array, layout: GroupLayout, component: str, layer
) -> jax.Array:
    """Cache-write op: encode `values [N, width]` as the component's row dtype and scatter by slot."""
    _, comp = layout.component(component)
    if values.shape[-1] != comp.width:
        raise ValueError(f"{component}: row width {values.shape[-1]} != layout width {comp.width}")
    return scatter_rows(kv_arena, slot_mapping, encode_rows(values, comp.row_dtype), layout, component, layer)


def read_cache(kv_arena: jax.Array, slots: jax.Array, layout: GroupLayout, component: str, layer) -> jax.Array:
    """Cache-read op: rows at `slots [...]` decoded to float32 `[..., width]` (invalid slots give garbage)."""
    _, comp = layout.component(component)
    return decode_rows(gather_rows(kv_arena, slots, layout, component, layer), comp.row_dtype)


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
