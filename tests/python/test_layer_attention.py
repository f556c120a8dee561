"""Cache.set_layer_attention: soft-capped logits (Gemma 2) and sink logits (gpt-oss) against a
numpy float64 reference over Cache.reconstruct, per layer and reversible, and its arguments."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import qjlkv
from conftest import randn, raises, require_cuda, small_config

HQ, HKV, D = 8, 2, 64
SINKS = np.array([-2.0 + 0.75 * h for h in range(HQ)], dtype=np.float32)  # negligible to dominant
VARIANTS = [(0.0, True), (5.0, False), (2.5, True)]


def reference(cache: qjlkv.Cache, layer: int, seq: int, queries: np.ndarray, scale: float, softcap: float,
              sinks: np.ndarray | None, window: int = 0) -> np.ndarray:
    """Causal attention of the last n queries (n, Hq, d) over the reconstruction, in float64:
    logits s = scale * <q, k-hat>, c * tanh(s / c) for a cap c > 0, exp(sinks[h]) in head h's
    denominator. Only the positions the first query sees on are reconstructed: a window may
    have freed those before."""
    length, n = cache.length(layer, seq), len(queries)
    first = max(0, length - n + 1 - window) if window else 0
    k_hat, v_hat = (np.repeat(x.astype(np.float64), HQ // HKV, axis=1)
                    for x in cache.reconstruct(layer, seq, first, length - first))
    logits = np.einsum("ihd,thd->iht", queries.astype(np.float64), k_hat) * scale
    if softcap > 0:
        logits = softcap * np.tanh(logits / softcap)
    position = (length - n + np.arange(n))[:, None]
    positions = np.arange(first, length)[None, :]
    seen = positions <= position  # (n, length - first): causal
    if window:
        seen &= positions > position - window
    logits = np.where(seen[:, None, :], logits, -np.inf)
    top = logits.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks.astype(np.float64)[None, :, None])
    weights = np.exp(logits - top)
    total = weights.sum(-1, keepdims=True)
    if sinks is not None:
        total += np.exp(sinks.astype(np.float64)[None, :, None] - top)
    return np.einsum("iht,thd->ihd", weights / total, v_hat)


def filled_cache(rng, preset: str, **fields) -> qjlkv.Cache:
    """Layers 0 and 1 of sequence 3 hold the same 150 tokens (blocks of 32 and a tail)."""
    cache = qjlkv.Cache(small_config(preset, block_tokens=32, residual_tokens=8, **fields))
    keys, values = 2 * randn(rng, 150, HKV, D), randn(rng, 150, HKV, D)  # logits of a few units: the cap bites
    for layer in range(2):
        cache.append(layer, 3, keys, values)
    return cache


@pytest.mark.parametrize("preset", ["q2", "q3", "kivi", "exact"])
@pytest.mark.parametrize("softcap,with_sinks", VARIANTS)
def test_variant_matches_the_reference_over_the_reconstruction(rng, preset, softcap, with_sinks, fp32_kernels):
    cache = filled_cache(rng, preset)
    sinks = SINKS if with_sinks else None
    cache.set_layer_attention(1, logit_softcap=softcap, sink_logits=sinks)
    for n in (1, 5):  # a decode step; five queries, causal among themselves
        queries = randn(rng, n, HQ, D)
        out = cache.attend(1, 3, queries, 0.3)
        want = reference(cache, 1, 3, queries, 0.3, softcap, sinks)
        np.testing.assert_allclose(out, want, rtol=5e-5, atol=5e-5 * np.abs(want).max())
    # attend_batch applies the same variant.
    query = randn(rng, HQ, D)
    batch = cache.attend_batch(1, [3, 3], np.stack([query, query]), 0.3)
    single = cache.attend(1, 3, query, 0.3)
    np.testing.assert_array_equal(batch[0], single)
    np.testing.assert_array_equal(batch[1], single)


@pytest.mark.parametrize("preset", ["q2", "q3", "ott"])
@pytest.mark.parametrize("window", [1, 20, 77, 400])
def test_window_matches_the_reference(rng, preset, window, fp32_kernels):
    """A sliding window, set while the layer is empty: each query sees the newest `window`
    positions up to its own, through prefill-sized and decode-sized appends."""
    cache = qjlkv.Cache(small_config(preset, block_tokens=32, residual_tokens=8))
    cache.set_layer_attention(0, window_tokens=window, logit_softcap=4.0 if window == 77 else 0.0)
    for n in (150, 1, 40):
        cache.append(0, 3, randn(rng, n, HKV, D), randn(rng, n, HKV, D))
        for q in (1, 5):
            queries = randn(rng, q, HQ, D)
            want = reference(cache, 0, 3, queries, 0.3, 4.0 if window == 77 else 0.0, None, window)
            np.testing.assert_allclose(cache.attend(0, 3, queries, 0.3), want, rtol=5e-5,
                                       atol=5e-5 * np.abs(want).max())
    with raises(qjlkv.InvalidArgument, "window_tokens"):
        cache.set_layer_attention(0, window_tokens=window + 1)


def test_window_frees_blocks_and_refuses_freed_positions(rng):
    """A windowed layer decoding a long sequence keeps its bytes bounded (the blocks its window
    leaves behind are freed); an attend whose first query would see a freed position raises."""
    window = 64
    cache = qjlkv.Cache(small_config("q3", block_tokens=32, residual_tokens=8, rollback_tokens=32))
    cache.set_layer_attention(0, window_tokens=window)
    used = []
    for step in range(60):
        cache.append(0, 3, randn(rng, 50, HKV, D), randn(rng, 50, HKV, D))
        used.append(cache.stats()["bytes_used"])
    assert cache.stats()["tokens"] < 3000 // 10
    assert max(used[40:]) <= max(used[20:40])
    query = randn(rng, HQ, D)
    cache.attend(0, 3, query)
    with raises(qjlkv.InvalidArgument, "n_queries"):
        cache.attend(0, 3, randn(rng, 2 * window + 64, HQ, D))


def test_variant_changes_the_output_as_expected(rng):
    """A cap far below the logits flattens the weights toward uniform; a dominant sink takes
    almost all of the weight, so the output all but vanishes."""
    cache = filled_cache(rng, "q3")
    query = randn(rng, HQ, D)
    plain = cache.attend(1, 3, query)
    _, v_hat = cache.reconstruct(1, 3)
    cache.set_layer_attention(1, logit_softcap=1e-4)
    uniform = np.repeat(v_hat, HQ // HKV, axis=1).astype(np.float64).mean(0)
    np.testing.assert_allclose(cache.attend(1, 3, query), uniform, atol=1e-3)
    cache.set_layer_attention(1, sink_logits=np.full(HQ, 40.0))
    assert np.abs(cache.attend(1, 3, query)).max() < 1e-6 * np.abs(plain).max()


def test_variant_is_per_layer_reversible_and_leaves_scores_raw(rng):
    cache = filled_cache(rng, "q2")
    query = randn(rng, HQ, D)
    plain = [cache.attend(layer, 3, query) for layer in range(2)]
    scores = cache.scores(0, 3, query)
    cache.set_layer_attention(0, logit_softcap=1.0, sink_logits=SINKS)
    assert not np.array_equal(cache.attend(0, 3, query), plain[0])
    np.testing.assert_array_equal(cache.attend(1, 3, query), plain[1])  # layer 1 is untouched
    np.testing.assert_array_equal(cache.scores(0, 3, query), scores)    # scores stay the raw <q, k>
    cache.set_layer_attention(0)  # no soft-cap, no sinks: plain again
    np.testing.assert_array_equal(cache.attend(0, 3, query), plain[0])


def test_streams_carry_no_variant(rng):
    """export/import move the stored bytes only: the importing cache attends plainly until given
    the variant too."""
    source = filled_cache(rng, "kivi")
    query = randn(rng, HQ, D)
    plain = source.attend(1, 3, query)
    source.set_layer_attention(1, logit_softcap=2.0, sink_logits=SINKS)
    capped = source.attend(1, 3, query)
    dest = qjlkv.Cache(source.config)
    dest.import_bytes(0, source.export_bytes(3))
    np.testing.assert_array_equal(dest.attend(1, 0, query), plain)
    dest.set_layer_attention(1, logit_softcap=2.0, sink_logits=SINKS)
    np.testing.assert_array_equal(dest.attend(1, 0, query), capped)


@pytest.mark.parametrize("kind", ["list", "float64", "float16", "bfloat16", "int", "big-endian", "torch",
                                  "torch-bf16", "torch-parameter"])
def test_sink_logits_take_any_1d_array_of_numbers(rng, kind):
    """Read once as float32: every kind of the same numbers gives the same output (these sinks
    are exact in every dtype)."""
    cache = filled_cache(rng, "exact")
    sinks = np.arange(HQ, dtype=np.float32) - 3.0
    given = {
        "list": sinks.tolist(),
        "float64": sinks.astype(np.float64),
        "float16": sinks.astype(np.float16),
        "bfloat16": sinks.astype(ml_dtypes.bfloat16),
        "int": sinks.astype(np.int64),
        "big-endian": sinks.astype(">f4"),
        "torch": torch.from_numpy(sinks),
        "torch-bf16": torch.from_numpy(sinks).to(torch.bfloat16),
        "torch-parameter": torch.nn.Parameter(torch.from_numpy(sinks)),
    }[kind]
    query = randn(rng, HQ, D)
    cache.set_layer_attention(0, sink_logits=sinks)
    want = cache.attend(0, 3, query)
    cache.set_layer_attention(0)
    cache.set_layer_attention(0, sink_logits=given)
    np.testing.assert_array_equal(cache.attend(0, 3, query), want)
    # Strided arrays are read too (a copy is made: the library copies them anyway).
    cache.set_layer_attention(0, sink_logits=np.repeat(sinks, 2)[::2])
    np.testing.assert_array_equal(cache.attend(0, 3, query), want)


def test_bad_arguments_name_the_field_and_change_nothing(rng):
    cache = filled_cache(rng, "q3")
    query = randn(rng, HQ, D)
    plain = cache.attend(0, 3, query)
    for softcap in (-1.0, float("nan"), float("inf"), 1e300):
        with raises(qjlkv.InvalidArgument, "logit_softcap"):
            cache.set_layer_attention(0, logit_softcap=softcap)
    for softcap in ("1", None, True, [1.0]):
        with raises(qjlkv.InvalidType, "logit_softcap"):
            cache.set_layer_attention(0, logit_softcap=softcap)
    with raises(qjlkv.InvalidArgument, "layer", "2 layers"):
        cache.set_layer_attention(2, logit_softcap=1.0)
    with raises(qjlkv.InvalidType, "layer"):
        cache.set_layer_attention("0", logit_softcap=1.0)
    for shape in [(HQ - 1,), (HQ + 1,), (0,), (2, HQ // 2), ()]:
        with raises(qjlkv.InvalidArgument, "sink_logits", f"({HQ},)"):
            cache.set_layer_attention(0, sink_logits=np.zeros(shape, np.float32))
    with raises(qjlkv.InvalidArgument, "sink_logits[5]", "finite"):
        cache.set_layer_attention(0, sink_logits=np.where(np.arange(HQ) == 5, np.nan, 0.0))
    with raises(qjlkv.InvalidArgument, "sink_logits[0]", "finite"):
        cache.set_layer_attention(0, sink_logits=[1e39] + [0.0] * (HQ - 1))  # beyond float32: infinite
    for sinks in ("abcdefgh", [1.0, None] * (HQ // 2), np.zeros(HQ, np.complex64), np.zeros(HQ, bool),
                  torch.zeros(HQ, dtype=torch.bool), [[1.0], [2.0, 3.0]]):
        with raises(qjlkv.InvalidType, "sink_logits"):
            cache.set_layer_attention(0, sink_logits=sinks)
    # The extension itself takes only native float32 arrays (Cache.set_layer_attention converts).
    for sinks in (np.zeros(HQ, ">f4"), np.zeros(HQ, np.float64), [0.0] * HQ):
        with raises(qjlkv.InvalidType, "sink_logits"):
            cache._handle.set_layer_attention(0, 0.0, sinks, 0)
    np.testing.assert_array_equal(cache.attend(0, 3, query), plain)  # every refusal left the layer plain
    cache.close()
    with raises(qjlkv.InvalidArgument, "closed"):
        cache.set_layer_attention(0)


def test_cuda_tensor_sinks_are_read_from_the_device(rng):
    """A torch CUDA tensor of sinks (a gpt-oss parameter on the GPU) is copied to the host: a CPU
    cache needs only torch's CUDA."""
    if not torch.cuda.is_available():
        reason = "needs a CUDA device for torch"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    cache = filled_cache(rng, "q3")
    query = randn(rng, HQ, D)
    cache.set_layer_attention(0, logit_softcap=3.0, sink_logits=SINKS)
    want = cache.attend(0, 3, query)
    cache.set_layer_attention(0)
    cache.set_layer_attention(0, logit_softcap=3.0, sink_logits=torch.from_numpy(SINKS).cuda())
    np.testing.assert_array_equal(cache.attend(0, 3, query), want)


def test_cuda_cache_attends_with_the_variant(rng):
    """A CUDA cache holding the CPU cache's sequence attends with the same variant."""
    require_cuda()
    cpu = filled_cache(rng, "q3")
    query = randn(rng, HQ, D)
    cpu.set_layer_attention(0, logit_softcap=3.0, sink_logits=SINKS)
    want = cpu.attend(0, 3, query)
    gpu = qjlkv.Cache(cpu.config.replace(device=0))
    gpu.import_bytes(3, cpu.export_bytes(3))
    try:
        gpu.set_layer_attention(0, logit_softcap=3.0, sink_logits=torch.from_numpy(SINKS).cuda())
    except qjlkv.Unsupported as e:
        reason = f"this build's CUDA backend refuses attention variants: {e}"
        print(f"SKIP: {reason}")
        pytest.skip(reason)
    out = gpu.attend(0, 3, torch.from_numpy(query).cuda())
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=2e-5, atol=2e-5)
