"""Row decode for the Pallas GPU kernels: uint32 arena words → float32 *lanes*.

The Triton lowering cannot interleave (a bf16 row decoded in storage order would need a join of
two halves per word) and needs every loaded tensor to have a power-of-two size. So the kernels
decode a row into `L` lanes, one per value packed in a word, and never reorder values:

    lane l, column i  ↔  value i·L + l of the row segment        (L = values per uint32 word)

The maths is permutation invariant where it must be (a dot product over the feature axis is a
sum over lanes of per-lane dots), so the callers split queries into the same lanes before the
kernel (`to_lanes`) and put outputs back after it (`from_lanes`), both cheap jnp reshapes outside
the kernel.

A row is read as *pieces*: runs of words of power-of-two length, loaded separately. A piece
lives in one of the row's layout segments (`kernels.paged.layout`: a row may be split into
segments stored in separate regions of the page, e.g. fp8 key codes then key scales) at a word
offset inside that segment. A codec names its pieces and one pure-jnp `decode` that turns the
loaded piece words into lanes; `piece_addressing` turns pieces into (constant, stride) word
addresses relative to the (component, layer) region. This is the only place a row dtype appears
in the kernels: a new row dtype is a new codec here, with no change to the kernels.

Byte layouts (as written by `kernels.paged.ops.encode_rows`; fp8 details in `kernels.paged.fp8`):
  float32        one value per word (bit pattern).               L = 1
  bfloat16       two values per word; value 2i in the low 16 bits of word i, value 2i+1 in the
                 high.                                             L = 2
  fp8_ds_mla     latent: four e4m3 codes per word (value 4i+j in byte j of word i), one fp32
                 scale per 128-value tile (the word after the codes); rope: bf16 pairs.
                 Latent L = 4 (lane j = byte j; lane column i lies in tile i // 32), rope L = 2.
                 Pieces: codes (A/4 words), each tile scale (1 word), rope (R/2 words).
  fp8_per_token  key codes (Dk/4 words, L = 4) in the page's key segment, one fp32 scale word in
  (+_hadamard)   its scale segment. The Hadamard variant stores rotated keys; callers rotate the
                 queries (`kernels.paged.ops.to_key_basis`) before `to_lanes`.
Every fp8 lane is decoded to fp32 and multiplied by its scale before the dots (the reference's
dequantise-then-dot maths), using the 32-bit decoders of `kernels.paged.fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kernels.paged.fp8 import FP8_TILE, e4m3_decode
from kernels.paged.layout import FP8_KEY_DTYPES

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


def _e4m3_lanes(words: jax.Array) -> tuple[jax.Array, ...]:
    """Words holding four e4m3 codes → 4 float32 lanes (lane j = byte j), unscaled, exact."""
    return tuple(e4m3_decode(lax.shift_right_logical(words, jnp.uint32(8 * j))) for j in range(4))


def to_lanes(x: jax.Array, row_dtype: str | int) -> tuple[jax.Array, ...]:
    """Values `[..., W]` → `L` lanes `[..., W/L]` in the order `decode_lanes` produces.

    `row_dtype` names a uniform row dtype, or is `L` itself (a codec's `part_lanes` entry).
    """
    L = row_dtype if isinstance(row_dtype, int) else values_per_word(row_dtype)
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

    segments: one `(layout segment, word offset in it, word count)` per loaded piece, each count a
      power of two (see the module docstring; `piece_addressing` gives their addresses).
    decode: `(*piece_words uint32[BK, count]) -> tuple of part lane-tuples` (e.g. (latent, rope)),
      each lane float32 `[BK, part_width / L_part]`.
    part_lanes: L of each part (values per word), in the order `decode` returns them.
    """

    segments: tuple[tuple[int, int, int], ...]
    decode: Callable[..., tuple[tuple[jax.Array, ...], ...]]
    part_lanes: tuple[int, ...]


def piece_addressing(codec: RowCodec, layout_segments: tuple[int, ...], tokens_per_page: int
                     ) -> tuple[tuple[int, int, int], ...]:
    """`(constant, stride, count)` per codec piece: the piece of token-in-page `o` starts at word
    `region + constant + o · stride` of the page, `region` being the (component, layer) base
    (`kernels.paged.layout`: segment s of token o at `region + tpp · Σ seg[:s] + o · seg[s]`)."""
    out = []
    for seg, off, count in codec.segments:
        out.append((tokens_per_page * sum(layout_segments[:seg]) + off, layout_segments[seg], count))
    return tuple(out)


def _fp8_ds_mla_codec(A: int, R: int) -> RowCodec:
    if A % FP8_TILE or R % 2:
        raise NotImplementedError(f"fp8_ds_mla needs A % {FP8_TILE} == 0 and an even R (A={A}, R={R})")
    a_w, nt, tile_w = A // 4, A // FP8_TILE, FP8_TILE // 4

    def decode(code_words, *rest):
        scale_words, rope_words = rest[:nt], rest[nt]
        # Per-column scale [BK, A/4]: lane column i lies in tile i // tile_w (a select chain).
        col_tile = lax.broadcasted_iota(jnp.int32, (1, a_w), 1) // tile_w
        scales = [lax.bitcast_convert_type(w, jnp.float32) for w in scale_words]  # [BK, 1] each
        scale_cols = jnp.broadcast_to(scales[0], code_words.shape)
        for t in range(1, nt):
            scale_cols = jnp.where(col_tile == t, scales[t], scale_cols)
        lat = tuple(c * scale_cols for c in _e4m3_lanes(code_words))
        return lat, decode_lanes(rope_words, "bfloat16")

    pieces = ((0, 0, a_w), *((0, a_w + t, 1) for t in range(nt)), (0, a_w + nt, R // 2))
    return RowCodec(segments=pieces, decode=decode, part_lanes=(4, 2))


def mla_row_codec(row_dtype: str, kv_lora_rank: int, rope_dim: int) -> RowCodec:
    """Codec of an MLA latent row `[c_kv (A) | k_pe (R)]` stored as `row_dtype` (uniform float32 /
    bfloat16, or fp8_ds_mla).

    Parts: (latent lanes, rope lanes). Raises NotImplementedError for row dtypes without a codec.
    """
    if row_dtype == "fp8_ds_mla":
        return _fp8_ds_mla_codec(kv_lora_rank, rope_dim)
    L = values_per_word(row_dtype)
    a_w, r_w = kv_lora_rank // L, rope_dim // L
    if kv_lora_rank % L or rope_dim % L:
        raise NotImplementedError(f"A={kv_lora_rank}, R={rope_dim} not multiples of {L} for {row_dtype}")

    def decode(lat_words, rope_words):
        return decode_lanes(lat_words, row_dtype), decode_lanes(rope_words, row_dtype)

    return RowCodec(segments=((0, 0, a_w), (0, a_w, r_w)), decode=decode, part_lanes=(L, L))


def key_row_codec(row_dtype: str, width: int) -> RowCodec:
    """Codec of an indexer-key row `[Dk]` stored as `row_dtype` (one part): uniform float32 /
    bfloat16, or fp8 codes with a per-token scale (`fp8_per_token`, `fp8_per_token_hadamard`;
    two layout segments: codes, then scales)."""
    if row_dtype in FP8_KEY_DTYPES:
        if width % 4:
            raise NotImplementedError(f"fp8 keys need a width multiple of 4, got {width}")

        def decode_fp8(code_words, scale_word):
            scale = lax.bitcast_convert_type(scale_word, jnp.float32)  # [BK, 1]
            return (tuple(c * scale for c in _e4m3_lanes(code_words)),)

        return RowCodec(segments=((0, 0, width // 4), (1, 0, 1)), decode=decode_fp8, part_lanes=(4,))
    L = values_per_word(row_dtype)
    if width % L:
        raise NotImplementedError(f"width {width} not a multiple of {L} for {row_dtype}")

    def decode(words):
        return (decode_lanes(words, row_dtype),)

    return RowCodec(segments=((0, 0, width // L),), decode=decode, part_lanes=(L,))


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
