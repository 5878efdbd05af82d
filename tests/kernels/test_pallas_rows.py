"""Lane decode of arena words (the Pallas kernels' row codecs) against the paged cache's own decode."""

import jax.numpy as jnp
import numpy as np
import pytest

from kernels.paged import decode_rows, encode_rows
from kernels.pallas_rows import decode_lanes, from_lanes, mla_row_codec, to_lanes


@pytest.mark.parametrize("row_dtype", ["float32", "bfloat16"])
def test_lanes_are_the_stored_values_in_lane_order(rng, row_dtype):
    x = jnp.asarray(rng.standard_normal((5, 24)).astype(np.float32))
    words = encode_rows(x, row_dtype)
    want = np.asarray(decode_rows(words, row_dtype))  # storage order, the cache's decode
    lanes = decode_lanes(words, row_dtype)
    np.testing.assert_array_equal(np.asarray(from_lanes(lanes)), want)
    for got, ref in zip(lanes, to_lanes(jnp.asarray(want), row_dtype)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_mla_codec_splits_latent_and_rope(rng):
    A, R = 16, 8
    x = jnp.asarray(rng.standard_normal((3, A + R)).astype(np.float32))
    words = np.asarray(encode_rows(x, "bfloat16"))
    codec = mla_row_codec("bfloat16", A, R)
    segs = [jnp.asarray(words[:, o:o + n]) for _, o, n in codec.segments]
    lat, rope = codec.decode(*segs)
    stored = np.asarray(decode_rows(jnp.asarray(words), "bfloat16"))
    np.testing.assert_array_equal(np.asarray(from_lanes(lat)), stored[:, :A])
    np.testing.assert_array_equal(np.asarray(from_lanes(rope)), stored[:, A:])
    with pytest.raises(NotImplementedError):
        mla_row_codec("fp8_e4m3", A, R)


def test_word_alignment_is_the_common_power_of_two():
    from kernels.pallas_rows import word_alignment
    assert word_alignment(0, 64 * 288) == 16  # bf16 MLA rows, first component
    assert word_alignment(64 * 288, 64 * 164) == 16
    assert word_alignment(8, 64 * 164) == 8
    assert word_alignment(3, 64) == 1
