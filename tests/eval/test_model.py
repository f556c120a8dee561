"""The numpy forward pass of SmolLM2-135M read from GGUF."""
import numpy as np
import pytest

from tools.eval.caches import ExactCache
from tools.eval.model import SOFTMAX_PARALLEL_SIZE, causal_mask, grouped_attention


def exact_cache(model):
    s = model.shape
    return ExactCache(s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim)


def test_shape_read_from_metadata(model):
    s = model.shape
    assert (s.num_layers, s.dim, s.num_q_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == \
        (30, 576, 9, 3, 64, 49152)
    assert s.rope_base == 100000.0
    # tied output matrix: the (transposed) token embedding
    np.testing.assert_array_equal(model.output, model.embedding[np.arange(s.vocab_size)].T)


def test_exact_cache_decoding_matches_the_full_sequence_forward(model):
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. In 1984, there were")
    full, _ = model.forward_full(ids)
    cache = exact_cache(model)
    prefix = 5
    stepped = [model.prefill(ids[:prefix], [cache])]
    for pos in range(prefix, len(ids)):
        stepped.append(model.decode_step([ids[pos]], pos, [cache])[0])
    stepped = np.array(stepped)
    scale = np.abs(full).max()
    assert scale > 10  # real logits, not zeros
    np.testing.assert_allclose(stepped, full[prefix - 1:], atol=1e-5 * scale)
    assert (stepped.argmax(-1) == full[prefix - 1:].argmax(-1)).all()


def test_batched_decode_equals_one_cache_at_a_time(model):
    ids = model.tokenizer.encode("Free software means")
    caches = [exact_cache(model), exact_cache(model)]
    model.prefill(ids, caches)
    both = model.decode_step([262, 5225], len(ids), caches)  # different tokens per cache
    alone = exact_cache(model)
    model.prefill(ids, [alone])
    one = model.decode_step([5225], len(ids), [alone])[0]
    np.testing.assert_allclose(both[1], one, atol=1e-4 * np.abs(one).max())
    assert not np.allclose(both[0], both[1])


def test_rope_on_adjacent_pairs_equals_hf_half_split_rope_on_unpermuted_weights(model):
    """llama.cpp's converter permutes Q/K rows so that adjacent pairs rotate; undoing the
    permutation and rotating halves (Hugging Face's convention) must give the same scores."""
    d = model.shape.head_dim
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 4, 1, d)).astype(np.float32)
    pos_q, pos_k = np.array([7, 100, 2000, 5]), np.array([3, 100, 1500, 4000])
    ours = (model.rope(q, pos_q) * model.rope(k, pos_k)).sum(-1)
    # GGUF row 2i <- HF row i, row 2i+1 <- HF row i + d/2: invert it
    hf_order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
    inv_freq = model.shape.rope_base ** (-np.arange(d // 2) * 2 / d)

    def hf_rope(x, pos):
        x = x[..., hf_order].astype(np.float64)
        angle = np.concatenate([pos[:, None] * inv_freq] * 2, axis=-1)[:, None, :]
        rotated = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
        return x * np.cos(angle) + rotated * np.sin(angle)

    theirs = (hf_rope(q, pos_q) * hf_rope(k, pos_k)).sum(-1)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)
    # and the rotation matters: without it the scores differ
    assert not np.allclose((q * k).sum(-1), theirs, atol=1e-2)


@pytest.mark.parametrize("n, window", [(3, None), (1, None), (1, 4)])
def test_grouped_attention_against_a_loop(n, window):
    """Several queries (the batched path) and one (the decode path, reading K/V as strided
    views of a larger reserved store, as the caches hold them), with and without a window."""
    rng = np.random.default_rng(1)
    t, hq, hkv, d = 7, 6, 2, 8
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k, v = rng.standard_normal((2, t + 5, hkv, d)).astype(np.float32)[:, :t]
    mask = causal_mask(np.arange(t - n, t), 0, t, window)
    out = grouped_attention(q, k, v, mask)
    for i in range(n):
        for h in range(hq):
            kv = h // (hq // hkv)
            visible = t - n + i + 1
            first = 0 if window is None else max(0, visible - window)
            s = np.full(visible, -np.inf)
            s[first:] = k[first:visible, kv] @ q[i, h] / np.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[i, h], p @ v[:visible, kv], rtol=1e-5, atol=1e-6)


def test_grouped_attention_of_a_long_chunk_matches_a_short_one():
    """A score matrix large enough for the row-parallel softmax and the reused scores buffer
    (a long prefill's chunk) against the same rows attended a few at a time."""
    rng = np.random.default_rng(3)
    n, t, hq, hkv, d = 256, 4096, 4, 2, 16
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k, v = rng.standard_normal((2, t, hkv, d)).astype(np.float32)
    assert n * hq * t >= SOFTMAX_PARALLEL_SIZE
    positions = np.arange(t - n, t)
    buffer = np.full(n * hq * t + 5, np.nan, np.float32)
    out = grouped_attention(q, k, v, causal_mask(positions, 0, t), buffer)
    for lo in range(0, n, 64):
        rows = slice(lo, lo + 64)
        part = grouped_attention(q[rows], k, v, causal_mask(positions[rows], 0, t))
        np.testing.assert_allclose(out[rows], part, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prompt, answer", [
    ("<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
     "<|im_start|>assistant\n", "The capital of France is Paris."),
])
def test_greedy_generation_is_coherent(model, prompt, answer):
    tok = model.tokenizer
    ids = tok.encode(prompt, allow_special=True)
    cache = exact_cache(model)
    logits = model.prefill(ids, [cache])
    out = []
    for pos in range(len(ids), len(ids) + 12):
        out.append(int(np.argmax(logits)))
        if out[-1] == tok.special["<|im_end|>"]:
            break
        logits = model.decode_step([out[-1]], pos, [cache])[0]
    assert tok.decode(out) == answer + "<|im_end|>"
