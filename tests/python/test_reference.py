"""The package against the independent numpy model of SPEC §2-§6 (qjlkv_reference.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import qjlkv
import qjlkv_reference as ref
from conftest import randn, small_config


def keys_with_outlier_channels(rng, tokens, heads, d, channels=(3, 17, 40)):
    """Gaussian keys whose few fixed channels are large in every token, as deeper layers' are."""
    keys = randn(rng, tokens, heads, d)
    keys[:, :, list(channels)] *= 12.0
    return keys


# --- §2 sketch ---------------------------------------------------------------------------
@pytest.mark.parametrize("m", [64, 128, 200])
def test_orthogonal_sketch_rows_are_orthogonal_blocks_of_norm_sqrt_d(m):
    d = 64
    s = qjlkv.Sketch(d, m, seed=7).matrix.astype(np.float64)
    assert s.shape == (m, d) and s.dtype == np.float64
    for start in range(0, m, d):
        block = s[start:start + d]
        np.testing.assert_allclose(block @ block.T, d * np.eye(len(block)), atol=2e-4 * d)


def test_gaussian_sketch_has_standard_normal_entries():
    s = qjlkv.Sketch(64, 512, seed=3, orthogonal=False).matrix.astype(np.float64)
    n = s.size
    assert abs(s.mean()) < 4 / math.sqrt(n)
    assert abs(s.var() - 1) < 4 * math.sqrt(2 / n)
    # Not orthogonalized: row norms vary around sqrt(d).
    assert np.linalg.norm(s, axis=1).std() > 0.1


def test_sketch_depends_on_seed_and_layer_stream_only():
    d, m = 64, 128
    a, b = qjlkv.Sketch(d, m, seed=11).matrix, qjlkv.Sketch(d, m, seed=11).matrix
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, qjlkv.Sketch(d, m, seed=12).matrix)
    cache = qjlkv.Cache(small_config(seed=11, num_layers=3))
    np.testing.assert_array_equal(cache.sketch(0).matrix, a[: cache.sketch(0).shape[0]])
    # One sketch per layer (stream id = layer): independent errors across layers.
    assert not np.array_equal(cache.sketch(1).matrix, cache.sketch(0).matrix)


def test_layer_sketch_has_max_of_inlier_and_outlier_rows():
    cfg = small_config(num_layers=3, initial_layers=1, initial_key_sketch_dim=256, initial_outlier_sketch_dim=64,
                       key_sketch_dim=64, outlier_sketch_dim=128)
    cache = qjlkv.Cache(cfg)
    assert cache.sketch(0).shape == (256, 64)
    assert cache.sketch(1).shape == (128, 64)
    assert cache.sketch(0).owned is False


# --- §3 keys -----------------------------------------------------------------------------
QJL_SHAPES = [
    dict(),  # the preset: m = 2d, c = 8 outlier channels, m_out = d/2
    dict(outlier_channels=0),
    dict(key_sketch_dim=200, outlier_sketch_dim=24, outlier_channels=5),
    dict(sketch_flags=0),  # Gaussian rows: c_d = sqrt(pi/2)
]


@pytest.mark.parametrize("fields", QJL_SHAPES)
def test_qjl_scores_equal_reference_estimator(rng, fields, fp32_kernels):
    cfg = small_config(num_layers=2, initial_layers=1, initial_key_sketch_dim=128, initial_outlier_sketch_dim=64,
                       **fields)
    cache = qjlkv.Cache(cfg)
    tokens, group = 150, cfg.num_q_heads // cfg.num_kv_heads
    for layer in range(2):
        keys = keys_with_outlier_channels(rng, tokens, 2, 64)
        values = randn(rng, tokens, 2, 64)
        cache.append(layer, 4, keys, values)
        model = ref.ReferenceLayer(cfg, keys, values, cache.sketch(layer).matrix, layer=layer)
        assert model.quantized == 96  # (150 - R=32) // B=32 blocks
        for _ in range(3):
            query = randn(rng, 8, 64)
            got = cache.scores(layer, 4, query)
            want = model.scores(query, group)
            magnitude = np.linalg.norm(query, axis=1)[:, None] * np.linalg.norm(keys, axis=2).T.repeat(group, 0)
            # fp32 sums against float64; a wrong constant c_d (0.4 % at d = 64) is far outside.
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * magnitude.max())
            assert np.abs(got - want).max() < 1e-3 * np.abs(want).max()


def test_qjl_reconstruction_is_the_dense_form(rng, fp32_kernels):
    cfg = small_config()
    cache = qjlkv.Cache(cfg)
    keys, values = keys_with_outlier_channels(rng, 100, 2, 64), randn(rng, 100, 2, 64)
    cache.append(0, 0, keys, values)
    model = ref.ReferenceLayer(cfg, keys, values, cache.sketch(0).matrix)
    k_hat, v_hat = cache.reconstruct(0, 0)
    np.testing.assert_allclose(k_hat, model.dense_keys, rtol=1e-5, atol=1e-5 * np.abs(model.dense_keys).max())
    # est(q, k) = <q, k-hat>: the reconstruction's dot products are the scores attend uses.
    query = randn(rng, 8, 64)
    dense = np.einsum("hd,thd->ht", query, k_hat.repeat(4, axis=1).reshape(100, 8, 64))
    np.testing.assert_allclose(cache.scores(0, 0, query), dense, rtol=1e-4, atol=1e-4)
    # The tail (positions >= 64) is exact.
    np.testing.assert_array_equal(k_hat[64:], keys[64:])
    np.testing.assert_array_equal(v_hat[64:], values[64:])


def test_qjl_estimator_is_unbiased_over_sketches(rng):
    """E_S[est] = <q, k> (Lemma 3.2) for the orthogonalized sketch and its constant c_d."""
    d, seeds = 64, 300
    keys, query = randn(rng, 8, 1, d), randn(rng, 1, d)
    exact = keys[:, 0] @ query[0]
    estimates = []
    for seed in range(seeds):
        cache = qjlkv.Cache(small_config(num_layers=1, num_q_heads=1, num_kv_heads=1, seed=seed, outlier_channels=0,
                                         block_tokens=8, residual_tokens=0))
        cache.append(0, 0, keys, keys)
        estimates.append(cache.scores(0, 0, query)[0])
    estimates = np.array(estimates)
    stderr = estimates.std(axis=0) / math.sqrt(seeds)
    assert np.all(np.abs(estimates.mean(axis=0) - exact) < 4.5 * stderr)


def test_qjl_distortion_within_lemma_3_5(rng):
    """P(|est - <q,k>| > eps ||q|| ||k||) <= delta when m >= 4/3 (1+eps)/eps^2 log(2/delta)."""
    d, m, eps = 64, 256, 0.25
    delta = 2 * math.exp(-m * eps**2 / (4 / 3 * (1 + eps)))
    tokens = 2048
    cache = qjlkv.Cache(small_config(num_layers=1, num_q_heads=2, num_kv_heads=2, key_sketch_dim=m,
                                     outlier_channels=0, residual_tokens=0))
    keys = randn(rng, tokens, 2, d)
    cache.append(0, 0, keys, keys)
    query = randn(rng, 2, d)
    est = cache.scores(0, 0, query)
    exact = np.einsum("hd,thd->ht", query, keys)
    bound = eps * np.linalg.norm(query, axis=1)[:, None] * np.linalg.norm(keys, axis=2).T
    assert np.mean(np.abs(est - exact) > bound) <= delta + 3 * math.sqrt(delta / est.size)


# --- §4 values, §5 KIVI keys, 16-bit storage ---------------------------------------------
@pytest.mark.parametrize("bits,group", [(2, 32), (4, 16), (8, 64), (2, 8), (3, 32), (3, 8)])
def test_values_quantization_equals_reference(rng, bits, group):
    cfg = small_config(value_bits=bits, value_group_size=group)
    cache = qjlkv.Cache(cfg)
    values = randn(rng, 130, 2, 64) * 3 + 1
    values[5, 0, :group] = 0.375  # a constant group: scale 0, x-hat = min exactly
    values[6, 1] = np.linspace(-2, 2, 64)
    keys = randn(rng, 130, 2, 64)
    cache.append(1, 9, keys, values)
    model = ref.ReferenceLayer(cfg, keys, values, cache.sketch(1).matrix, layer=1)
    _, v_hat = cache.reconstruct(1, 9)
    np.testing.assert_allclose(v_hat, model.dense_values, rtol=1e-6, atol=1e-6)
    assert np.all(v_hat[5, 0, :group] == np.float32(0.375))
    # |x - x-hat| <= scale/2 with scale = range / (2^b - 1).
    quantized = values[:model.quantized].reshape(model.quantized, 2, 64 // group, group)
    half_step = (quantized.max(-1) - quantized.min(-1)) / (2**bits - 1) / 2
    err = np.abs(v_hat[:model.quantized] - values[:model.quantized]).reshape(quantized.shape).max(-1)
    assert np.all(err <= half_step * 1.01 + 1e-6)


def assert_scores_within_budget(got, want, queries, keys, group):
    """SPEC §9: rms of (score - reference) / (|q|·|k|) at most 1e-3 (the CPU may score codes in
    integers within it). got, want: [query heads, tokens]; keys: [tokens, kv heads, d]."""
    heads = np.arange(len(queries))
    size = np.linalg.norm(queries, axis=-1)[:, None] * np.linalg.norm(keys, axis=-1)[:, heads // group].T
    assert np.sqrt(np.mean(((got - want) / size) ** 2)) <= 1e-3


def assert_outputs_within_budget(got, want):
    """SPEC §9: rms(output - reference) / rms(reference) at most 1e-3."""
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)) <= 1e-3


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_kivi_keys_equal_reference(rng, bits):
    cfg = small_config("kivi", key_bits=bits, block_tokens=32)
    cache = qjlkv.Cache(cfg)
    keys, values = randn(rng, 100, 2, 64), randn(rng, 100, 2, 64)
    cache.append(0, 0, keys, values)
    model = ref.ReferenceLayer(cfg, keys, values, None)
    k_hat, v_hat = cache.reconstruct(0, 0)
    np.testing.assert_allclose(k_hat, model.dense_keys, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v_hat, model.dense_values, rtol=1e-6, atol=1e-6)
    query = randn(rng, 8, 64)
    assert_scores_within_budget(cache.scores(0, 0, query), model.scores(query, 4), query, keys, 4)


def mixed_keys(rng, tokens, heads, d):
    """Keys whose channels span ranges from 1/64 to 16 (and one constant channel), so that the
    widths of a block run from 0 to 4 bits."""
    keys = randn(rng, tokens, heads, d) * np.logspace(-6, 4, d, base=2, dtype=np.float32)
    keys[:, :, 5] = 0.625
    return keys


@pytest.mark.parametrize("key_token_bits", [None, 8, 64, 256])
def test_mixed_keys_equal_reference(rng, key_token_bits):
    """Mixed-bit keys (preset "q2"): widths from the channels' ranges, key_token_bits a token."""
    fields = {} if key_token_bits is None else dict(key_token_bits=key_token_bits)
    cfg = small_config("q2", block_tokens=32, residual_tokens=8, sink_tokens=0,
                       value_method=qjlkv.ValueMethod.UNIFORM, value_bits=4, **fields)
    assert cfg.key_token_bits == (key_token_bits or 136)
    cache = qjlkv.Cache(cfg)
    keys, values = mixed_keys(rng, 100, 2, 64), randn(rng, 100, 2, 64)
    cache.append(1, 0, keys, values)
    model = ref.ReferenceLayer(cfg, keys, values, None, layer=1)
    assert model.quantized == 64
    k_hat, v_hat = cache.reconstruct(1, 0)
    scale = np.abs(keys).max(axis=0)  # per (head, channel)
    np.testing.assert_allclose(k_hat, model.dense_keys, rtol=0, atol=1e-6)
    assert np.all(np.abs(k_hat - model.dense_keys) <= 1e-6 * scale)
    np.testing.assert_array_equal(k_hat[64:], keys[64:])
    np.testing.assert_allclose(v_hat, model.dense_values, rtol=1e-6, atol=1e-6)
    # The widths spend exactly key_token_bits a token; more bits, smaller errors.
    widths = ref.mixed_widths((ref.f16_round_up(keys[:32, 0].max(0)) - ref.f16_round_down(keys[:32, 0].min(0))),
                              cfg.key_token_bits)
    assert widths.sum() == cfg.key_token_bits and widths.max() <= 4
    assert widths[5] == (4 if cfg.key_token_bits == 4 * 64 else 0)  # the constant channel comes last
    query = randn(rng, 8, 64)
    assert_scores_within_budget(cache.scores(1, 0, query), model.scores(query, 4), query, keys, 4)


def test_mixed_keys_error_shrinks_with_key_token_bits(rng):
    keys = mixed_keys(rng, 64, 2, 64)
    errors = []
    for bits in (8, 64, 136, 256):
        cache = qjlkv.Cache(small_config("q2", block_tokens=64, residual_tokens=0, sink_tokens=0, key_token_bits=bits))
        cache.append(0, 0, keys, keys)
        k_hat, _ = cache.reconstruct(0, 0)
        errors.append(float(np.sqrt(np.mean((k_hat - keys) ** 2))))
    assert all(a > b for a, b in zip(errors, errors[1:])) and errors[-1] < errors[0] / 5, errors


# --- §6 attention -------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["qjl", "kivi", "exact", "q2"])
@pytest.mark.parametrize("n_queries", [1, 5])
def test_attend_equals_reference_softmax(rng, preset, n_queries):
    # q2's keys with the model's values (uniform) and no sinks
    extra = dict(sink_tokens=0, value_method=qjlkv.ValueMethod.UNIFORM) if preset == "q2" else {}
    cfg = small_config(preset, block_tokens=32, **extra)
    cache = qjlkv.Cache(cfg)
    keys = keys_with_outlier_channels(rng, 140, 2, 64) * 0.3
    values = randn(rng, 140, 2, 64)
    cache.append(0, 2, keys, values)
    sketch = cache.sketch(0).matrix if preset == "qjl" else None
    model = ref.ReferenceLayer(cfg, keys, values, sketch)
    queries = randn(rng, n_queries, 8, 64)
    for scale in (None, 0.3):
        got = cache.attend(0, 2, queries, scale)
        want = model.attend(queries, 4, 1 / 8 if scale is None else scale)
        assert_outputs_within_budget(got, want)


def test_quantization_boundary_follows_block_and_residual_sizes(rng):
    cfg = small_config(block_tokens=16, residual_tokens=8)
    cache = qjlkv.Cache(cfg)
    keys = randn(rng, 1, 2, 64)
    exact_positions = []
    for n in range(1, 60):
        cache.append(0, 0, keys, keys)
        k_hat, _ = cache.reconstruct(0, 0)
        exact = np.all(k_hat == keys[0], axis=(1, 2))
        exact_positions.append(int(exact.sum()))
        assert exact.sum() == n - ref.quantized_length(n, 16, 8)
        assert exact[ref.quantized_length(n, 16, 8):].all()
    # At least min(len, R) newest tokens stay exact, never more than R + B - 1.
    assert min(exact_positions[8:]) >= 8 and max(exact_positions) <= 23
