"""Row decode for the Pallas GPU kernels: uint32 arena words → float32 *lanes*.

The Triton lowering cannot interleave (a bf16 row decoded in storage order would need a join of
two halves per word) and needs every loaded tensor to have a power-of-two size. So the kernels
decode a row into `L` lanes, one per value packed in a word, and never reorder values:

    lane l, column i  ↔  value i·L + l of the row segment        (L = values per uint32 word)

The maths is permutation invariant where it must be (a dot product over the feature axis is a
sum over lanes of per-lane dots), so the callers split queries into the same lanes before the
kernel (`to_lanes`) and put outputs back after it (`from_lanes`), both cheap jnp reshapes outside
the kernel.

A row is read as *segments*: runs of words of power-of-two length at fixed word offsets in the
row, loaded separately. A codec names its segments and one pure-jnp `decode` that turns the
loaded segment words into lanes. This is the only place a row dtype appears in the kernels: a
new row dtype (the fp8 formats) is a new codec here, with no change to the kernels.

Byte layouts (as written by `kernels.paged.ops.encode_rows`):
  float32   one value per word (bit pattern).
  bfloat16  two values per word; value 2i in the low 16 bits of word i, value 2i+1 in the high.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

_VALUES_PER_WORD = {"float32": 1, "bfloat16": 2}


def values_per_word(row_dtype: str) -> int:
    """L: how many values one uint32 word holds for `row_dtype`."""
    try:
        return _VALUES_PER_WORD[row_dtype]
    except KeyError:
        raise NotImplementedError(f"no Pallas row codec for row dtype {row_dtype!r}") from None


def decode_lanes(words: jax.Array, row_dtype: str) -> tuple[jax.Array, ...]:
    """Words `uint32[..., n]` → `L` float32 lanes `[..., n]` (lane l holds values i·L + l).

    Pure jnp (bitcasts, shifts, masks): lowers inside Triton kernels and runs anywhere.
    """
    if row_dtype == "float32":
        return (lax.bitcast_convert_type(words, jnp.float32),)
    if row_dtype == "bfloat16":
        # A bf16 value is the top half of the float32 with the same bits below it zero.
        lo = lax.bitcast_convert_type(lax.shift_left(words, jnp.uint32(16)), jnp.float32)
        hi = lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32)
        return lo, hi
    raise NotImplementedError(f"no Pallas row codec for row dtype {row_dtype!r}")


def to_lanes(x: jax.Array, row_dtype: str) -> tuple[jax.Array, ...]:
    """Values `[..., W]` → `L` lanes `[..., W/L]` in the order `decode_lanes` produces."""
    L = values_per_word(row_dtype)
    if x.shape[-1] % L:
        raise ValueError(f"width {x.shape[-1]} is not a multiple of {L} for {row_dtype}")
    xr = x.reshape(*x.shape[:-1], x.shape[-1] // L, L)
    return tuple(xr[..., l] for l in range(L))


def from_lanes(lanes: tuple[jax.Array, ...] | list[jax.Array]) -> jax.Array:
    """Inverse of `to_lanes`: `L` lanes `[..., n]` → values `[..., n·L]`."""
    x = jnp.stack(lanes, axis=-1)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


@dataclass(frozen=True)
class RowCodec:
    """How a kernel reads one row kind.

    segments: `(word offset in the row, word count)` per segment, each count a power of two.
    decode: `(*segment_words uint32[BK, count]) -> tuple of part lane-tuples` (e.g. (latent, rope)),
      each lane float32 `[BK, part_width / L_part]`.
    part_lanes: L of each part (values per word), in the order `decode` returns them.
    """

    segments: tuple[tuple[int, int], ...]
    decode: Callable[..., tuple[tuple[jax.Array, ...], ...]]
    part_lanes: tuple[int, ...]


def mla_row_codec(row_dtype: str, kv_lora_rank: int, rope_dim: int) -> RowCodec:
    """Codec of an MLA latent row `[c_kv (A) | k_pe (R)]` stored uniformly as `row_dtype`.

    Parts: (latent lanes, rope lanes). Raises NotImplementedError for row dtypes without a codec.
    """
    L = values_per_word(row_dtype)
    a_w, r_w = kv_lora_rank // L, rope_dim // L
    if kv_lora_rank % L or rope_dim % L:
        raise NotImplementedError(f"A={kv_lora_rank}, R={rope_dim} not multiples of {L} for {row_dtype}")

    def decode(lat_words, rope_words):
        return decode_lanes(lat_words, row_dtype), decode_lanes(rope_words, row_dtype)

    return RowCodec(segments=((0, a_w), (a_w, r_w)), decode=decode, part_lanes=(L, L))


def key_row_codec(row_dtype: str, width: int) -> RowCodec:
    """Codec of an indexer-key row `[Dk]` stored uniformly as `row_dtype` (one part)."""
    L = values_per_word(row_dtype)
    if width % L:
        raise NotImplementedError(f"width {width} not a multiple of {L} for {row_dtype}")

    def decode(words):
        return (decode_lanes(words, row_dtype),)

    return RowCodec(segments=((0, width // L),), decode=decode, part_lanes=(L,))


def word_alignment(*strides: int, cap: int = 16) -> int:
    """Largest power of two (≤ `cap`) dividing every stride: the word alignment every row start
    built from these strides is known to have. Kernels pass it to Triton as a divisibility hint
    (`pl.multiple_of`) so that row loads can use 16-byte vector accesses."""
    a = cap
    for s in strides:
        while a > 1 and s % a:
            a //= 2
    return a


def is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_power_of_two(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()
