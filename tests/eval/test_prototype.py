"""The numpy QJL prototype used to measure remedies (tools/eval/prototype.py)."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from tools.eval.prototype import (PrototypeQjlCache, dequantized, fp16_toward, orthogonal_sketch,
                                  unbiased_constant)

D = 64
SHAPE = SimpleNamespace(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=D)


def test_sketch_rows_are_orthogonal_in_blocks_of_d_with_norm_sqrt_d():
    s = orthogonal_sketch(160, D, np.random.default_rng(0))
    assert s.shape == (160, D)
    np.testing.assert_allclose(s[:D] @ s[:D].T, D * np.eye(D), atol=1e-9)
    np.testing.assert_allclose(s[D:2 * D] @ s[D:2 * D].T, D * np.eye(D), atol=1e-9)
    np.testing.assert_allclose(np.linalg.norm(s[2 * D:], axis=1), math.sqrt(D))


def test_unbiased_constant_matches_the_spec_approximation():
    assert unbiased_constant(D) == pytest.approx(math.sqrt(math.pi / 2) * (1 - 1 / (4 * D)), rel=1e-4)


def test_directed_fp16_rounding():
    x = np.array([0.1, -0.1, 1 / 3, 1000.3])
    down, up = fp16_toward(x, -np.inf), fp16_toward(x, np.inf)
    assert (down <= x).all() and (up >= x).all() and (up > down).all()
    exact = np.array([0.5, -2.0])
    np.testing.assert_array_equal(fp16_toward(exact, -np.inf), exact)


def test_dequantized_error_is_at_most_half_a_step_and_constant_groups_are_exact():
    x = np.random.default_rng(1).standard_normal((4, 32))
    x[3] = 0.75
    y = dequantized(x, 2, axis=-1)
    step = (x.max(-1) - x.min(-1)) / 3
    assert (np.abs(x - y).max(-1) <= step / 2 * 1.01 + 1e-12).all()
    np.testing.assert_array_equal(y[3], x[3])


def block_estimate(keys, query, seeds, **options):
    """<q, k̂> of a single block for each sketch seed (residual 0: all keys quantized)."""
    estimates = []
    for seed in seeds:
        cache = PrototypeQjlCache("p", SHAPE, block=len(keys), residual=0, value_bits=16,
                                  seed=seed, **options)
        cache.append(0, keys[:, None].astype(np.float32), keys[:, None].astype(np.float32))
        assert cache.quantized[0] == len(keys)
        estimates.append(cache.keys[0][:len(keys), 0].astype(np.float64) @ query)
    return np.array(estimates)


@pytest.mark.parametrize("options", [
    dict(m=64, m_out=0, channels=0),
    dict(m=64, m_out=32, channels=8),
    dict(m=64, m_out=0, channels=0, center=True),
])
def test_estimate_is_unbiased(options):
    rng = np.random.default_rng(2)
    keys = rng.standard_normal((8, D)) + 2.0
    query = rng.standard_normal(D)
    est = block_estimate(keys, query, range(400), **options)
    exact = keys @ query
    spread = est.std(0) / math.sqrt(len(est))
    assert (np.abs(est.mean(0) - exact) < 5 * spread + 0.02 * np.abs(exact)).all()


def test_centering_removes_the_error_of_a_shared_key_component():
    rng = np.random.default_rng(3)
    keys = rng.standard_normal((32, D)) * 0.3 + rng.standard_normal(D) * 3  # shared mean
    query = rng.standard_normal(D)
    plain = block_estimate(keys, query, range(20), m=128, m_out=0, channels=0)
    centered = block_estimate(keys, query, range(20), m=128, m_out=0, channels=0, center=True)
    exact = keys @ query
    # error scales with the norm that is sketched: ~10x smaller norm, ~10x smaller error
    assert np.sqrt(((centered - exact) ** 2).mean()) < 0.2 * np.sqrt(((plain - exact) ** 2).mean())


def test_tail_stays_exact_and_blocks_follow_the_library_protocol():
    rng = np.random.default_rng(4)
    cache = PrototypeQjlCache("p", SHAPE, 64, 32, 8, block=32, residual=32)
    keys = rng.standard_normal((100, 1, D)).astype(np.float32)
    for t in range(100):
        cache.append(0, keys[t:t + 1], keys[t:t + 1])
    # a block leaves the tail whenever it holds >= R + B tokens: 2 blocks at 100 tokens
    assert cache.quantized[0] == 64
    np.testing.assert_array_equal(cache.keys[0][64:100], keys[64:])
    assert not np.allclose(cache.keys[0][:64], keys[:64])


def test_bits_per_number_counts_what_the_library_would_store():
    cache = PrototypeQjlCache("p", SHAPE, 128, 32, 8, block=32, residual=32)
    x = np.random.default_rng(5).standard_normal((96, 1, D)).astype(np.float32)
    cache.append(0, x, x)  # 2 blocks (64 tokens) + 32 tail tokens
    per_block = 32 * (128 / 8 + 2) + 8 + 32 * (32 / 8 + 2) + 32 * (D * 2 / 8 + 2 * 4)
    used = 2 * per_block + 32 * D * 2 * 4
    st = cache.stats()
    assert st["bytes_used"] == int(used)
    assert st["bits_per_number"] == pytest.approx(8 * used / (96 * D * 2))
