"""FP8 (e4m3) cache-row codecs over uint32 words: `fp8_ds_mla` latent rows and per-token-scaled keys.

Everything here is pure `jnp` on 32-bit integers and floats (shifts, masks, same-width bitcasts,
`where`), so the decoders can run inside a Pallas kernel on words it has gathered: load the
row's words, call `decode_fp8_ds_mla_words` / `decode_fp8_key_words`, compute in fp32.

e4m3 ("float8_e4m3fn", OCP FP8): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
infinities, one NaN pattern per sign (0x7F / 0xFF), largest finite value 448, smallest normal
2^-6, subnormals m·2^-9. Encoding rounds to nearest, ties to even, after clipping to ±448.

Byte order inside a word (host-independent, defined by shifts): byte j of a byte string lives in
bits `8·(j % 4) … 8·(j % 4) + 7` of word `j // 4` (byte 0 is the least significant byte, which
is also what a little-endian `uint8` view of the words gives). bf16 pairs: value 2i is the low
16 bits of word i, value 2i+1 the high 16 bits (the same order as `lax.bitcast_convert_type` of a
`bfloat16[..., 2]` to `uint32` on little-endian hosts).

Scale rule (both formats): `scale = max(amax · fp32(1/448), 2^-126)` in fp32 (amax/448, computed
as a multiply by the fp32-rounded reciprocal so every backend gets the same bits), with `amax`
the largest |value| of the tile (fp8_ds_mla) or of the token's key (indexer); codes are
`e4m3(clip(x / scale, ±448))` (|x / scale| can exceed 448 by an ulp, hence the clip); the decoded value is `e4m3_value · scale` (one fp32 multiply).
An all-zero tile stores scale 2^-126 (the smallest normal fp32; no division by zero) and all-zero
codes, so it decodes to exact zeros. Non-finite inputs are not supported: an inf or NaN in a tile
makes its scale non-finite and the whole tile decodes to NaN (visible, not silently clipped).

Error bound (per element, before the fp32 multiply's own 2^-24 rounding): with `y = x / scale`,
|y| <= 448; if |y| >= 2^-6 (normal range) the e4m3 rounding error is at most 2^-4·|y| (half an
ulp of a 3-bit mantissa), else at most 2^-10 (half the subnormal spacing 2^-9). So
`|decode - x| <= max(2^-4·|x|, 2^-10·scale)` up to fp32 rounding.

Formats (words are uint32; A = latent width, R = rope width, Dk = key width):

* `fp8_ds_mla` row, `A/4 + A/128 + R/2` words = `A + 4·A/128 + 2·R` bytes (656 at A=512, R=64;
  164 at the tiny model's A=128, R=16):
    words [0, A/4)                 e4m3 codes of the latent c_kv, value i in byte i (4 tiles of 128
                                   at A=512: tile t = values 128t … 128t+127)
    words [A/4, A/4 + A/128)       fp32 scale of tile t in word A/4 + t
    words [A/4 + A/128, … + R/2)   k_pe as bf16 pairs (never quantised)
  The tile is always 128 values; A must be a multiple of 128 (ValueError otherwise; the tiny
  configs use kv_lora_rank 128). R must be even.

* fp8 indexer key, `Dk/4 + 1` words = `Dk + 4` bytes (132 at Dk=128): the logical row is the
  e4m3 codes of the key (value i in byte i) followed by one fp32 scale word. In the page the two
  parts are stored as separate segments (all keys of the page's tokens, then all their scales;
  see `kernels/paged/layout.py`). Dk must be a multiple of 4.

Optional Hadamard rotation (docs/design.md §3.3): keys are rotated by the normalised Sylvester Hadamard
matrix `H = H_n / sqrt(n)` (n = Dk, a power of two) before quantising, and queries are rotated
by the same H before scoring. H is symmetric and orthogonal (H·H = I), so
`(q·H)·(k·H) = q·k` exactly in real arithmetic; only the fp8 rounding errors of the keys change
(a large coordinate is spread over all coordinates, so the per-token scale follows the key's
norm rather than its largest coordinate).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3_MAX = 448.0
SCALE_FLOOR = 2.0 ** -126  # smallest normal fp32: the scale of an all-zero tile
FP8_TILE = 128  # values per fp8_ds_mla scale tile

_SHIFTS = (0, 8, 16, 24)


# ----------------------------------------------------------------------------- e4m3 bytes

def e4m3_encode(y: jax.Array) -> jax.Array:
    """fp32 values (already divided by their scale) → e4m3 codes as uint32 in [0, 255].

    Clips to ±448 (so rounding of `x / scale` can never overflow), then rounds to nearest even.
    """
    y = jnp.clip(y.astype(jnp.float32), -E4M3_MAX, E4M3_MAX)
    return lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8).astype(jnp.uint32)


def e4m3_decode(code: jax.Array) -> jax.Array:
    """e4m3 codes (any integer dtype; the low 8 bits are used) → exact fp32 values.

    Only 32-bit integer ops and a same-width bitcast: normal codes become the fp32 bit pattern
    `sign | (e + 120) << 23 | m << 20`; subnormal codes (e = 0) are `m · 2^-9`; 0x7F/0xFF is NaN.
    """
    b = code.astype(jnp.uint32) & 0xFF
    em = b & 0x7F
    e = em >> 3
    m = em & 0x7
    normal = lax.bitcast_convert_type(((e + 120) << 23) | (m << 20), jnp.float32)
    mag = jnp.where(e == 0, m.astype(jnp.float32) * (2.0 ** -9), normal)
    mag = jnp.where(em == 0x7F, jnp.float32(jnp.nan), mag)
    bits = lax.bitcast_convert_type(mag, jnp.uint32) | ((b >> 7) << 31)
    return lax.bitcast_convert_type(bits, jnp.float32)


def pack_bytes(codes: jax.Array) -> jax.Array:
    """Byte values `[..., 4n]` (uint32 in [0, 255]) → words `uint32[..., n]` (byte j in bits 8(j%4))."""
    c = codes.astype(jnp.uint32).reshape(*codes.shape[:-1], codes.shape[-1] // 4, 4)
    return (c[..., 0] | (c[..., 1] << 8) | (c[..., 2] << 16) | (c[..., 3] << 24)).astype(jnp.uint32)


def unpack_bytes(words: jax.Array) -> jax.Array:
    """Words `uint32[..., n]` → byte values `uint32[..., 4n]` (inverse of `pack_bytes`).

    Value 4i + j is byte j of word i; a kernel that avoids the final reshape can keep the
    `[..., n, 4]` shape and view its other operand the same way.
    """
    w = words.astype(jnp.uint32)
    b = jnp.stack([(w >> s) & 0xFF for s in _SHIFTS], axis=-1)
    return b.reshape(*words.shape[:-1], words.shape[-1] * 4)


# ----------------------------------------------------------------------------- bf16 pairs

def encode_bf16_words(x: jax.Array) -> jax.Array:
    """Values `[..., 2n]` → words `uint32[..., n]`: bf16 (round to nearest even), value 2i low half."""
    b = lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)
    b = b.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    return b[..., 0] | (b[..., 1] << 16)


def decode_bf16_words(words: jax.Array) -> jax.Array:
    """Words `uint32[..., n]` → fp32 `[..., 2n]` (exact), 32-bit ops only."""
    w = words.astype(jnp.uint32)
    lo = lax.bitcast_convert_type(w << 16, jnp.float32)
    hi = lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.stack([lo, hi], axis=-1).reshape(*words.shape[:-1], words.shape[-1] * 2)


# ----------------------------------------------------------------------------- scales

def fp8_scale(amax: jax.Array) -> jax.Array:
    """The fp32 scale of a tile with largest magnitude `amax`: max(amax · fp32(1/448), 2^-126)."""
    return jnp.maximum(amax.astype(jnp.float32) * jnp.float32(1.0 / E4M3_MAX), jnp.float32(SCALE_FLOOR))


def _quantise(x: jax.Array, axis: int = -1):
    """x fp32 → (codes uint32 same shape, scale fp32 with `axis` reduced)."""
    scale = fp8_scale(jnp.max(jnp.abs(x), axis=axis))
    return e4m3_encode(x / jnp.expand_dims(scale, axis)), scale


# ----------------------------------------------------------------------------- fp8_ds_mla

def fp8_ds_mla_words(latent_dim: int, rope_dim: int) -> int:
    """Words of one fp8_ds_mla row: A/4 + A/128 + R/2. Raises ValueError for unsupported widths."""
    if latent_dim <= 0 or latent_dim % FP8_TILE:
        raise ValueError(f"fp8_ds_mla needs a latent width that is a positive multiple of {FP8_TILE} "
                         f"(the scale tile), got {latent_dim}")
    if rope_dim % 2 or rope_dim < 0:
        raise ValueError(f"fp8_ds_mla keeps the rope part as bf16 pairs: rope width must be even, got {rope_dim}")
    return latent_dim // 4 + latent_dim // FP8_TILE + rope_dim // 2


def encode_fp8_ds_mla(x: jax.Array, rope_dim: int) -> jax.Array:
    """Rows `[..., A+R]` (`[c_kv | k_pe]`) → words `uint32[..., A/4 + A/128 + R/2]` (see module doc)."""
    A = x.shape[-1] - rope_dim
    fp8_ds_mla_words(A, rope_dim)
    x = x.astype(jnp.float32)
    tiles = x[..., :A].reshape(*x.shape[:-1], A // FP8_TILE, FP8_TILE)
    codes, scale = _quantise(tiles)
    return jnp.concatenate([
        pack_bytes(codes.reshape(*x.shape[:-1], A)),
        lax.bitcast_convert_type(scale, jnp.uint32),
        encode_bf16_words(x[..., A:]),
    ], axis=-1)


def decode_fp8_ds_mla_words(words: jax.Array, latent_dim: int, rope_dim: int) -> jax.Array:
    """Words `uint32[..., A/4 + A/128 + R/2]` → fp32 `[..., A+R]` = `[e4m3 · tile scale | bf16 rope]`.

    Pure 32-bit jnp (usable inside a kernel on a gathered row or a block of rows).
    """
    A, R = latent_dim, rope_dim
    nt = A // FP8_TILE
    lead = words.shape[:-1]
    codes = unpack_bytes(words[..., : A // 4])
    scale = lax.bitcast_convert_type(words[..., A // 4: A // 4 + nt], jnp.float32)
    lat = e4m3_decode(codes).reshape(*lead, nt, FP8_TILE) * scale[..., None]
    rope = decode_bf16_words(words[..., A // 4 + nt: A // 4 + nt + R // 2])
    return jnp.concatenate([lat.reshape(*lead, A), rope], axis=-1)


# ----------------------------------------------------------------------------- fp8 per-token keys

def fp8_key_segments(dim: int) -> tuple[int, int]:
    """Word counts of an fp8 indexer key's two segments: (Dk/4 code words, 1 scale word)."""
    if dim <= 0 or dim % 4:
        raise ValueError(f"fp8 keys pack 4 codes per word: width must be a positive multiple of 4, got {dim}")
    return dim // 4, 1


def encode_fp8_key(x: jax.Array) -> jax.Array:
    """Keys `[..., Dk]` → logical row words `uint32[..., Dk/4 + 1]` = `[codes | scale]`."""
    fp8_key_segments(x.shape[-1])
    codes, scale = _quantise(x.astype(jnp.float32))
    return jnp.concatenate([pack_bytes(codes), lax.bitcast_convert_type(scale, jnp.uint32)[..., None]], axis=-1)


def decode_fp8_key_words(code_words: jax.Array, scale_word: jax.Array) -> jax.Array:
    """Key codes `uint32[..., Dk/4]` and scale word `uint32[...]` → fp32 keys `[..., Dk]`.

    Two arguments because the page stores the codes and the scales in separate segments.
    """
    scale = lax.bitcast_convert_type(scale_word, jnp.float32)
    return e4m3_decode(unpack_bytes(code_words)) * scale[..., None]


# ----------------------------------------------------------------------------- Hadamard

def hadamard_matrix(n: int) -> np.ndarray:
    """Normalised Sylvester Hadamard matrix `float32[n, n]` (symmetric, orthogonal; H·H = I).

    Raises ValueError unless n is a power of two.
    """
    if n <= 0 or n & (n - 1):
        raise ValueError(f"the Hadamard rotation needs a power-of-two width, got {n}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def hadamard_rotate(x: jax.Array) -> jax.Array:
    """`x @ H` over the last axis (fp32, full precision). Also its own inverse."""
    H = jnp.asarray(hadamard_matrix(x.shape[-1]))
    return jnp.einsum("...d,de->...e", x.astype(jnp.float32), H, precision=lax.Precision.HIGHEST)
