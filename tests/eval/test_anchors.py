"""llama.cpp's q8_0 / q4_0 cache formats (tools/eval/anchors.py): bit-exact to the gguf
package's implementation of ggml's reference quantizers, and the caches built on them."""
from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from tools.eval.anchors import (BLOCK, BLOCK_BYTES, QUANTIZE, BlockQuantCache, dequantize,
                                ggml_bytes, hadamard, roundf)
from tools.eval.evaluate import DEFAULT_TEXT, CacheConfig, evaluate, load_text_tokens
from tools.eval.model import grouped_attention

GGML_TYPE = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def awkward_numbers(rng, rows=64, width=128):
    """Heavy-tailed rows plus the edge cases: an all-zero block, ties at exactly .5 steps,
    a block whose largest magnitude is negative, a block with its maximum twice."""
    x = (rng.standard_normal((rows, width)) * rng.lognormal(0, 2, (rows, 1))).astype(np.float32)
    x[0, :BLOCK] = 0
    x[1, :BLOCK] = np.arange(BLOCK, dtype=np.float32) * np.float32(0.5) - 8  # .5 ties for q8_0
    x[2, :BLOCK] = np.linspace(-3, 1, BLOCK, dtype=np.float32)                # negative max
    x[3, :BLOCK] = 1
    x[3, 5] = x[3, 9] = -4
    return x


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_blocks_equal_ggml_bytes(fmt):
    x = awkward_numbers(np.random.default_rng(0))
    codes, scales = QUANTIZE[fmt](x)
    assert ggml_bytes(fmt, codes, scales) == quants.quantize(x, GGML_TYPE[fmt]).tobytes()


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_dequantized_numbers_equal_ggml(fmt):
    x = awkward_numbers(np.random.default_rng(1))
    codes, scales = QUANTIZE[fmt](x)
    theirs = quants.dequantize(quants.quantize(x, GGML_TYPE[fmt]), GGML_TYPE[fmt])
    np.testing.assert_array_equal(dequantize(fmt, codes, scales), theirs)


def test_block_sizes_are_llama_cpp_s():
    assert BLOCK_BYTES == {"q8_0": 34, "q4_0": 18}  # 8.5 and 4.5 bits per number


def test_roundf_rounds_halves_away_from_zero():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, -1.4999999], dtype=np.float32)
    np.testing.assert_array_equal(roundf(x), [1, 2, 3, -1, -3, 0, -1])


def test_q4_0_scale_is_the_signed_largest_over_minus_8():
    x = np.zeros(BLOCK, np.float32)
    x[7], x[8] = -6.0, 5.0
    codes, scales = QUANTIZE["q4_0"](x)
    assert scales[0] == np.float16(0.75)  # -6 / -8
    assert codes[7] == 0 and dequantize("q4_0", codes, scales)[7] == -6.0


def test_hadamard_is_orthogonal_and_symmetric():
    for n in (64, 128):
        h = hadamard(n)
        np.testing.assert_array_equal(h, h.T)
        np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(96)


SHAPE = SimpleNamespace(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("fmt, rotate", [("q8_0", False), ("q4_0", False), ("q4_0", True)])
def test_cache_attends_over_its_stored_numbers(fmt, rotate):
    rng = np.random.default_rng(2)
    k, v = rng.standard_normal((2, 40, 2, 64)).astype(np.float32)
    q = rng.standard_normal((3, 4, 64)).astype(np.float32) * 0.5
    cache = BlockQuantCache("c", fmt, SHAPE, rotate=rotate)
    cache.append(1, k[:37], v[:37])
    cache.append(1, k[37:], v[37:])
    h = hadamard(64) if rotate else np.eye(64, dtype=np.float32)
    stored_k = dequantize(fmt, *QUANTIZE[fmt](k @ h))
    stored_v = dequantize(fmt, *QUANTIZE[fmt](v @ h))
    mask = np.where(np.arange(40)[None] <= np.arange(37, 40)[:, None], 0, -np.inf).astype(np.float32)
    expected = grouped_attention(q @ h, stored_k, stored_v, mask) @ h
    np.testing.assert_allclose(cache.attend(1, q), expected, rtol=1e-5, atol=1e-5)
    # and close to exact attention: the rotation is undone
    exact = grouped_attention(q, k, v, mask)
    tolerance = 0.02 if fmt == "q8_0" else 0.2
    assert np.abs(cache.attend(1, q) - exact).max() < tolerance
    st = cache.stats()
    assert st["bits_per_number"] == (8.5 if fmt == "q8_0" else 4.5)
    assert st["bytes_used"] == 40 * 2 * 64 * 2 // BLOCK * BLOCK_BYTES[fmt]
    assert st["bytes_full_precision"] == 0


def test_on_the_model_more_bits_less_error(model):
    configs = [CacheConfig("q8_0", "q8_0", anchor=True), CacheConfig("q4_0", "q4_0", anchor=True),
               CacheConfig("q4_0 rotated", "q4_0", {"rotate": True}, anchor=True)]
    tokens = load_text_tokens(model, DEFAULT_TEXT, 81)
    _, results = evaluate(model, tokens, 64, configs, progress=False, bits_length=1024)
    r = {x.name: x for x in results}
    assert 0 < r["q8_0"].mean_kl < r["q4_0"].mean_kl
    assert 0 < r["q4_0 rotated"].mean_kl
    assert (r["q8_0"].bits_at_length, r["q4_0"].bits_at_length) == (8.5, 4.5)
