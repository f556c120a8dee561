"""The numpy caches of the tier research (tools/eval/research.py): codebooks, rotations,
the block/tail protocol and the bit count, so the measured rows cannot silently drift."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from tools.eval.research import (EXACT, Codec, Format, ResearchCache, candidate_sets, channel, hadamard,
                                 lloyd_max_gaussian, lm, randomized_hadamard, token)

D = 64
SHAPE = SimpleNamespace(num_layers=2, num_q_heads=2, num_kv_heads=1, head_dim=D)


def test_lloyd_max_levels_match_the_published_gaussian_quantizers():
    # Max (1960), Table I: optimum levels for a unit-variance Gaussian
    np.testing.assert_allclose(lloyd_max_gaussian(1), [-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)],
                               atol=1e-9)
    np.testing.assert_allclose(lloyd_max_gaussian(2), [-1.5104, -0.4528, 0.4528, 1.5104], atol=1e-4)
    np.testing.assert_allclose(lloyd_max_gaussian(3)[4:], [0.2451, 0.7560, 1.3439, 2.1520], atol=1e-4)
    assert (np.diff(lloyd_max_gaussian(4)) > 0).all()


def test_randomized_hadamard_is_orthogonal_and_round_trips():
    assert (hadamard(8) @ hadamard(8).T == 8 * np.eye(8)).all()
    r = randomized_hadamard(D, np.random.default_rng(3))
    np.testing.assert_allclose(r @ r.T, np.eye(D), atol=1e-12)
    x = np.random.default_rng(4).standard_normal((5, 1, D))
    np.testing.assert_allclose((x @ r.T) @ r, x, atol=1e-12)
    with pytest.raises(ValueError):
        hadamard(48)


def test_rotated_codes_decode_back_in_the_original_basis():
    rng = np.random.default_rng(5)
    r = randomized_hadamard(D, rng)
    x = rng.standard_normal((7, 2, D))
    x[:, :, 3] += 40.0        # an outlier channel: rotation spreads it
    fine = token(8, 32, rotate=True).apply(x, r)
    assert np.abs(fine - x).max() < 0.1    # 8-bit steps of ≈ 0.06
    coarse_plain = token(2, 64).apply(x, r)
    coarse_rotated = token(2, 64, rotate=True).apply(x, r)
    assert np.linalg.norm(coarse_rotated - x) < np.linalg.norm(coarse_plain - x)


def test_lloyd_codes_keep_each_groups_norm():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((9, 1, D)) * 3
    x[0] = 0.0                                    # a zero vector stays zero, no NaN
    y = lm(2).apply(x, randomized_hadamard(D, rng))
    norms = np.linalg.norm(x, axis=-1)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), norms.astype(np.float16).astype(np.float64), rtol=1e-12)
    assert (y[0] == 0).all()
    cosine = (x[1:] * y[1:]).sum(-1) / norms[1:] / np.linalg.norm(y[1:], axis=-1)
    assert cosine.min() > 0.85                    # 2-bit Lloyd-Max: ≈ 0.94 expected


def test_channel_codes_follow_the_block():
    x = np.random.default_rng(7).standard_normal((32, 1, D)) + np.linspace(-300, 300, D)
    y = channel(4).apply(x, None)
    step = (x.max(0) - x.min(0)) / 15
    assert (np.abs(x - y) <= step / 2 * 1.01 + 0.25).all()


def test_bits_counted_by_hand():
    # 3-bit channel keys B=128 + 2-bit Lloyd values (fp16 norm per token), R=32, at 8192
    # tokens of one kv head: 63 blocks of keys 128·64·3/8 + 64·4 = 3328 bytes and values
    # 128·64·2/8 + 128·2 = 2304 bytes, 128 exact tokens of 2·64·2 bytes.
    fmt = Format(channel(3), lm(2))
    expected = 8 * (63 * (3328 + 2304) + 128 * 256) / (8192 * 64 * 2)
    assert fmt.bits_at(SHAPE, 8192) == pytest.approx(expected)
    # 4 sinks, 2 exact outlier tokens per block (fp16 K and V plus a uint8 index each),
    # boundary layer (1 of 2) with exact keys and 4-bit per-token values in groups of 32
    fmt = Format(channel(2), token(2, 32), block=64, residual=16, sinks=4, outlier_tokens=2,
                 boundary_layers=(1, 0), boundary_key=EXACT, boundary_value=token(4, 32))
    blocks, exact = (1000 - 4 - 16) // 64, 1000 - 15 * 64
    inner = 62 * 64 * 2 / 8 + 64 * 4 + 62 * (64 * 2 / 8 + 2 * 4) + 2 * 257
    edge = 62 * 64 * 2 + 62 * (64 * 4 / 8 + 2 * 4) + 2 * 257
    expected = 8 * (blocks * (inner + edge) + 2 * exact * 256) / (2 * 1000 * 64 * 2)
    assert blocks == 15 and fmt.bits_at(SHAPE, 1000) == pytest.approx(expected)


def test_cache_quantizes_blocks_behind_the_tail_and_keeps_sinks_and_outliers_exact():
    fmt = Format(channel(2), token(2, 32), block=64, residual=32, sinks=4, outlier_tokens=1)
    cache = ResearchCache("c", SHAPE, fmt)
    rng = np.random.default_rng(8)
    keys = rng.standard_normal((200, 1, D)).astype(np.float32)
    keys[50, 0, 7] = 80.0                       # stretches channel 7's range: kept exact
    values = rng.standard_normal((200, 1, D)).astype(np.float32)
    for start in range(0, 200, 37):             # uneven appends: the same blocks as one append
        cache.append(0, keys[start:start + 37], values[start:start + 37])
    cache.append(1, keys, values)
    assert cache.quantized == [4 + 64 * 2, 4 + 64 * 2]
    for layer in (0, 1):
        stored_k = cache.keys[layer][:200]
        np.testing.assert_array_equal(stored_k[:4], keys[:4].astype(np.float16))
        np.testing.assert_array_equal(stored_k[132:], keys[132:].astype(np.float16))
        np.testing.assert_array_equal(stored_k[50], keys[50].astype(np.float16))
        assert not np.array_equal(stored_k[4:50], keys[4:50].astype(np.float16))
    np.testing.assert_array_equal(cache.keys[0][:200], cache.keys[1][:200])
    assert cache.stats()["bits_per_number"] == pytest.approx(fmt.bits_at(SHAPE, 200))


def test_every_candidate_names_a_valid_format():
    for configs in candidate_sets().values():
        for c in configs:
            assert 0 < c.bits_at(SHAPE, 8192) <= 16


def test_library_candidates_are_library_caches_with_fp16_io():
    from tools.eval.research import LibraryConfig

    config = LibraryConfig("q3 B64 R16", "q3", {"block_tokens": 64, "residual_tokens": 16})
    cache = config.make(SHAPE, 1)
    fields = cache.cache.config
    assert (fields.block_tokens, fields.residual_tokens, fields.key_bits, fields.dtype) == (64, 16, 3, "float16")
    assert config.describe() == "q3 block_tokens=64 residual_tokens=16"
    # the bits of a cache filled with other numbers (the stored size depends on the count only)
    rng = np.random.default_rng(8)
    for layer in range(SHAPE.num_layers):
        kv = rng.standard_normal((300, 1, D)).astype(np.float32) * (layer + 1)
        cache.append(layer, kv, kv[::-1].copy())
    assert config.bits_at(SHAPE, 300) == cache.stats()["bits_per_number"]
    assert config.bits_at(SHAPE, 8192) < 3.0


def test_every_q3_parameter_candidate_builds():
    from tools.eval.research import LibraryConfig

    library = [c for c in candidate_sets()["q3-params"] if isinstance(c, LibraryConfig)]
    assert len(library) == len(candidate_sets()["q3-params"])
    for config in library:
        config.make(SHAPE, 1).cache.config.validate()


def test_mixed_bits_follow_the_ranges_and_sum_to_the_budget():
    from tools.eval.research import allocate_bits
    ranges = np.array([[1.0, 2.0, 4.0, 8.0, 0.5, 100.0, 0.0, 1.0]])
    bits = allocate_bits(ranges, 2.5, 0, 4, midrise=True)
    assert bits.sum() == 20
    # each bit quarters a channel's squared error: the widest channels get the most bits;
    # equal ranges (channels 0 and 7) get equal bits, a zero range none
    assert bits.tolist() == [[2, 3, 4, 4, 1, 4, 0, 2]]
    # greedy order = the 20 largest gains r²·4^-b: no channel could trade a bit for less error
    err = ranges ** 2 * 4.0 ** -bits
    gained = np.where(bits > 0, ranges ** 2 * 4.0 ** -(bits - 1) - err, np.inf)
    wanted = np.where(bits < 4, err - ranges ** 2 * 4.0 ** -(bits + 1), -np.inf)
    assert wanted.max() <= gained.min()


def test_mixed_codes_midrise_reconstruction_and_bits():
    from tools.eval.prototype import fp16_toward
    from tools.eval.research import allocate_bits, mixed
    rng = np.random.default_rng(9)
    x = rng.standard_normal((128, 1, D)) * np.exp(rng.standard_normal(D)) + 300 * (np.arange(D) == 5)
    codec = mixed(2.125)
    y = codec.apply(x, None)
    lo = x.min(0).astype(np.float16).astype(np.float64)
    assert (y >= lo - 1e-9).all()
    # every channel's error is at most half its cell (range / 2^b)
    r = fp16_toward(x.max(0), np.inf) - fp16_toward(x.min(0), -np.inf)
    bits = allocate_bits(r, 2.125, 0, 4, True)
    assert bits.sum() == 136
    assert (np.abs(y - x) <= r / 2 ** bits / 2 + 1e-9).all()
    # a midrise 2-bit code beats min/max endpoints on Gaussian data
    g = rng.standard_normal((128, 1, D))
    midrise, endpoints = Codec("channel", 2, midrise=True).apply(g, None), channel(2).apply(g, None)
    assert np.mean((midrise - g) ** 2) < np.mean((endpoints - g) ** 2)
    # Q2q at d = 128, 8,192 tokens, 16 sinks, tail 32: 63 blocks of keys 128·272/8 + fp16
    # min and max 128·4 + widths 128·3/8, values 128·128·2/8 + 128·2; 128 exact tokens
    shape = SimpleNamespace(num_layers=1, num_q_heads=1, num_kv_heads=1, head_dim=128)
    fmt = Format(mixed(2.125), lm(2), sinks=16)
    per_block = 128 * 272 / 8 + 128 * 4 + 128 * 3 / 8 + 128 * 128 * 2 / 8 + 128 * 2
    expected = 8 * (63 * per_block + 128 * 128 * 2 * 2) / (8192 * 128 * 2)
    assert fmt.bits_at(shape, 8192) == pytest.approx(expected) and expected < 2.5


def test_separate_value_tail_codes_values_before_their_block():
    fmt = Format(channel(3), lm(2), block=64, residual=32, sinks=4, value_residual=8)
    cache = ResearchCache("c", SHAPE, fmt)
    rng = np.random.default_rng(10)
    kv = rng.standard_normal((60, 1, D)).astype(np.float32)
    cache.append(0, kv, kv)
    assert cache.quantized[0] == 4 and cache.values_coded[0] == 52
    np.testing.assert_array_equal(cache.keys[0][:60], kv.astype(np.float16))   # no key block yet
    assert not np.array_equal(cache.values[0][4:52], kv[4:52].astype(np.float16))
    np.testing.assert_array_equal(cache.values[0][52:60], kv[52:60].astype(np.float16))
