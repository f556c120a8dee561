"""Round trips in every dtype, numpy and torch, GQA/MQA, batched calls, zero copy, threads."""

from __future__ import annotations

import threading

import ml_dtypes
import numpy as np
import pytest
import torch

import qjlkv
import qjlkv_reference as ref
from conftest import randn, require_cuda, small_config

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Attention output tolerance per I/O dtype (the output is rounded to it).
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 2e-2}


def as_numpy_f32(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.float().cpu().numpy()
    return np.asarray(x).astype(np.float32)


def make_inputs(rng, kind, dtype, *shape):
    data = randn(rng, *shape, dtype=NUMPY_DTYPES[dtype])  # values exactly representable in dtype
    if kind == "numpy":
        return data
    return torch.from_numpy(data.astype(np.float32)).to(TORCH_DTYPES[dtype])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", list(NUMPY_DTYPES))
def test_exact_preset_round_trip(rng, kind, dtype):
    """16-bit storage: fp16 for float32/float16 input, bf16 for bfloat16; the tail keeps the input."""
    cfg = small_config("exact", dtype=dtype, block_tokens=32)
    cache = qjlkv.Cache(cfg)
    keys, values = make_inputs(rng, kind, dtype, 77, 2, 64), make_inputs(rng, kind, dtype, 77, 2, 64)
    cache.append(0, 1, keys, values)
    k_hat, v_hat = cache.reconstruct(0, 1)
    storage = "bfloat16" if dtype == "bfloat16" else np.float16
    k32, v32 = as_numpy_f32(keys), as_numpy_f32(values)
    np.testing.assert_array_equal(k_hat[:64], ref.round16(k32[:64], storage))
    np.testing.assert_array_equal(v_hat[:64], ref.round16(v32[:64], storage))
    np.testing.assert_array_equal(k_hat[64:], k32[64:])
    np.testing.assert_array_equal(v_hat[64:], v32[64:])

    queries = make_inputs(rng, kind, dtype, 3, 8, 64)
    out = cache.attend(0, 1, queries)
    assert type(out) is type(queries) and out.dtype == queries.dtype and tuple(out.shape) == (3, 8, 64)
    model = ref.ReferenceLayer(cfg, k32, v32, None, storage16=storage)
    want = model.attend(as_numpy_f32(queries), 4, 1 / 8)
    np.testing.assert_allclose(as_numpy_f32(out), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("preset", ["q2", "qjl", "kivi", "ott"])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", list(NUMPY_DTYPES))
def test_attend_equals_attention_over_reconstruction(rng, preset, kind, dtype, request):
    """For every method and dtype, attend is softmax attention over what reconstruct returns."""
    # Within float rounding: the integer kernels (QJL and KIVI/OTT scores, uniform value sums) are
    # held to SPEC §9 elsewhere (test_reference.py, tests/cpu_paths).
    request.getfixturevalue("fp32_kernels")
    cache = qjlkv.Cache(small_config(preset, dtype=dtype, block_tokens=32, outlier_skip_layers=0))
    keys, values = make_inputs(rng, kind, dtype, 150, 2, 64), make_inputs(rng, kind, dtype, 150, 2, 64)
    cache.append(0, 0, keys, values)
    k_hat, v_hat = cache.reconstruct(0, 0)
    np.testing.assert_array_equal(k_hat[-32:], as_numpy_f32(keys)[-32:])  # the newest R tokens are exact
    query = make_inputs(rng, kind, dtype, 8, 64)
    out = cache.attend(0, 0, query)
    assert type(out) is type(query) and out.dtype == query.dtype and tuple(out.shape) == (8, 64)
    q = as_numpy_f32(query).astype(np.float64)
    logits = np.einsum("hd,thd->ht", q, np.repeat(k_hat, 4, axis=1).astype(np.float64)) / 8
    weights = np.exp(logits - logits.max(1, keepdims=True))
    weights /= weights.sum(1, keepdims=True)
    want = np.einsum("ht,thd->hd", weights, np.repeat(v_hat, 4, axis=1).astype(np.float64))
    np.testing.assert_allclose(as_numpy_f32(out), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("heads", [(8, 2), (8, 1), (4, 4), (6, 3)])
def test_gqa_head_mapping(rng, heads):
    """Query head h reads kv head h // (Hq / Hkv) (transformers' repeat_kv)."""
    hq, hkv = heads
    cache = qjlkv.Cache(small_config("exact", num_q_heads=hq, num_kv_heads=hkv))
    keys, values = randn(rng, 20, hkv, 64), randn(rng, 20, hkv, 64)
    cache.append(0, 0, keys, values)
    query = randn(rng, hq, 64)
    scores = cache.scores(0, 0, query)
    for h in range(hq):
        np.testing.assert_allclose(scores[h], keys[:, h // (hq // hkv)] @ query[h], rtol=1e-5, atol=1e-5)
    out = cache.attend(0, 0, query)
    torch_out = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(query)[:, None], torch.from_numpy(keys).transpose(0, 1).repeat_interleave(hq // hkv, 0),
        torch.from_numpy(values).transpose(0, 1).repeat_interleave(hq // hkv, 0))[:, 0]
    np.testing.assert_allclose(out, torch_out.numpy(), rtol=1e-5, atol=1e-5)


def test_single_token_shapes_and_appending_in_pieces(rng):
    """(heads, d) is one token; appending n at once stores what n single appends store."""
    cfg = small_config()
    whole, pieces = qjlkv.Cache(cfg), qjlkv.Cache(cfg)
    keys, values = randn(rng, 90, 2, 64), randn(rng, 90, 2, 64)
    whole.append(0, 0, keys, values)
    for t in range(90):
        pieces.append(0, 0, keys[t], values[t])
    for a, b in zip(whole.reconstruct(0, 0), pieces.reconstruct(0, 0)):
        np.testing.assert_array_equal(a, b)
    query = randn(rng, 8, 64)
    np.testing.assert_array_equal(whole.attend(0, 0, query), pieces.attend(0, 0, query))
    assert whole.stats() == pieces.stats()


def test_reconstruct_ranges(rng):
    cache = qjlkv.Cache(small_config())
    keys, values = randn(rng, 70, 2, 64), randn(rng, 70, 2, 64)
    cache.append(0, 0, keys, values)
    k_all, v_all = cache.reconstruct(0, 0)
    k_part, none = cache.reconstruct(0, 0, 10, 30, values=False)
    assert none is None
    np.testing.assert_array_equal(k_part, k_all[10:40])
    none, v_tail = cache.reconstruct(0, 0, 60, keys=False)
    assert none is None
    np.testing.assert_array_equal(v_tail, v_all[60:])


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_batched_calls_equal_single_calls(rng, kind):
    cfg = small_config(dtype="float32")
    batched, single = qjlkv.Cache(cfg), qjlkv.Cache(cfg)
    seqs = [7, 2, 40, 3]
    for seq in seqs:
        prompt_k, prompt_v = randn(rng, 30 + seq, 2, 64), randn(rng, 30 + seq, 2, 64)
        batched.append(1, seq, prompt_k, prompt_v)
        single.append(1, seq, prompt_k, prompt_v)
    for step in range(40):
        keys, values = make_inputs(rng, kind, "float32", 4, 2, 64), make_inputs(rng, kind, "float32", 4, 2, 64)
        batched.append_batch(1, seqs, keys, values)
        for i, seq in enumerate(seqs):
            single.append(1, seq, keys[i], values[i])
    for seq in seqs:
        for a, b in zip(batched.reconstruct(1, seq), single.reconstruct(1, seq)):
            np.testing.assert_array_equal(a, b)
    # attend_batch accepts repeated ids and numpy id arrays.
    ids = np.array([3, 7, 3, 40], dtype=np.uint32)
    queries = make_inputs(rng, kind, "float32", 4, 8, 64)
    out = batched.attend_batch(1, ids, queries)
    assert type(out) is type(queries)
    for i, seq in enumerate(ids):
        np.testing.assert_allclose(as_numpy_f32(out[i]), as_numpy_f32(single.attend(1, int(seq), queries[i])),
                                   rtol=1e-6, atol=1e-7)


def test_clear_releases_and_sequence_ids_are_reusable(rng):
    cache = qjlkv.Cache(small_config())
    cache.append(0, 5, randn(rng, 200, 2, 64), randn(rng, 200, 2, 64))
    cache.append(1, 5, randn(rng, 10, 2, 64), randn(rng, 10, 2, 64))
    assert cache.stats()["bytes_used"] > 0
    cache.clear(5)
    assert cache.length(0, 5) == cache.length(1, 5) == 0 and cache.stats()["bytes_used"] == 0
    cache.clear(5)  # clearing an empty id is fine
    keys = randn(rng, 3, 2, 64)
    cache.append(0, 5, keys, keys)
    np.testing.assert_array_equal(cache.reconstruct(0, 5)[0], keys)


# --- zero copy ------------------------------------------------------------------------------
def test_contiguous_inputs_are_passed_without_copy(rng):
    array = randn(rng, 10, 2, 64)
    assert qjlkv._qjlkv.data_pointer(array) == array.ctypes.data
    view = array[3:7]  # a contiguous slice: passed as is, at its offset
    assert qjlkv._qjlkv.data_pointer(view) == view.ctypes.data == array.ctypes.data + 3 * 2 * 64 * 4
    bf16 = array.astype(ml_dtypes.bfloat16)
    assert qjlkv._qjlkv.data_pointer(bf16) == bf16.ctypes.data
    tensor = torch.randn(10, 2, 64, dtype=torch.bfloat16)
    assert qjlkv._qjlkv.data_pointer(tensor) == tensor.data_ptr()
    assert qjlkv._qjlkv.data_pointer(tensor[2:5]) == tensor[2:5].data_ptr()
    # A size-1 dimension's stride does not matter: still no copy.
    odd = torch.randn(1, 8, 64).transpose(0, 1).transpose(0, 1)
    assert qjlkv._qjlkv.data_pointer(odd) == odd.data_ptr()


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_outputs_are_written_in_place(rng, kind):
    cache = qjlkv.Cache(small_config())
    keys = make_inputs(rng, kind, "float32", 50, 2, 64)
    cache.append(0, 0, keys, keys)
    queries = make_inputs(rng, kind, "float32", 2, 8, 64)
    out = make_inputs(rng, kind, "float32", 2, 8, 64)
    address = qjlkv._qjlkv.data_pointer(out)
    result = cache.attend(0, 0, queries, out=out)
    assert result is out and qjlkv._qjlkv.data_pointer(result) == address
    np.testing.assert_array_equal(as_numpy_f32(out), as_numpy_f32(cache.attend(0, 0, queries)))


# --- threads and CUDA ---------------------------------------------------------------------
def test_distinct_caches_in_parallel_threads_match_serial_results(rng):
    cfg = small_config(num_threads=1)
    data = [(randn(rng, 600, 2, 64), randn(rng, 600, 2, 64), randn(rng, 8, 8, 64)) for _ in range(4)]

    def run(i, results):
        cache = qjlkv.Cache(cfg)
        keys, values, queries = data[i]
        for start in range(0, 600, 50):
            cache.append(0, 0, keys[start:start + 50], values[start:start + 50])
        results[i] = cache.attend(0, 0, queries)

    serial, parallel = {}, {}
    for i in range(4):
        run(i, serial)
    threads = [threading.Thread(target=run, args=(i, parallel)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        np.testing.assert_array_equal(serial[i], parallel[i])


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_cuda_tensors_round_trip(rng, dtype):
    require_cuda()
    cache = qjlkv.Cache(small_config(dtype=dtype, device=0))
    cpu = qjlkv.Cache(small_config(dtype=dtype))
    keys = make_inputs(rng, "torch", dtype, 100, 2, 64)
    values = make_inputs(rng, "torch", dtype, 100, 2, 64)
    cache.append(0, 0, keys.cuda(), values.cuda())
    cpu.append(0, 0, keys, values)
    query = make_inputs(rng, "torch", dtype, 8, 64)
    out = cache.attend(0, 0, query.cuda())
    assert out.is_cuda and out.dtype == query.dtype
    np.testing.assert_allclose(as_numpy_f32(out), as_numpy_f32(cpu.attend(0, 0, query)),
                               rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    for a, b in zip(cache.reconstruct(0, 0), cpu.reconstruct(0, 0)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    with pytest.raises(qjlkv.InvalidArgument, match="keys is on cpu"):
        cache.append(0, 0, keys, values)
