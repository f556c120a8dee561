"""Every bad argument raises the right qjlkv.Error subclass, with the status and a message
that names the argument; a failed call changes nothing."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

import qjlkv
from conftest import raises, randn, small_config

IA, IT, UN = qjlkv.InvalidArgument, qjlkv.InvalidType, qjlkv.Unsupported
SHAPE = dict(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64)


@pytest.fixture
def cache(rng):
    cache = qjlkv.Cache(small_config())
    cache.append(0, 0, randn(rng, 10, 2, 64), randn(rng, 10, 2, 64))
    return cache


def k(n=3, heads=2, d=64, dtype=np.float32):
    return np.ones((n, heads, d), dtype=dtype)


def with_value(array, index, value):
    array = array.copy()
    array[index] = value
    return array


SKETCH_CASES = [
    (lambda: qjlkv.Sketch(0, 16), IA, ["head_dim is 0"]),
    (lambda: qjlkv.Sketch(2000, 16), IA, ["head_dim"]),
    (lambda: qjlkv.Sketch(64, 12), IA, ["sketch_dim is 12"]),
    (lambda: qjlkv.Sketch(64, 0), IA, ["sketch_dim"]),
    (lambda: qjlkv.Sketch(64, 16, seed=-1), IA, ["seed is -1"]),
    (lambda: qjlkv.Sketch(64, 16, seed=2**64), IA, ["seed"]),
    (lambda: qjlkv.Sketch("64", 16), IT, ["head_dim", "str"]),
    (lambda: qjlkv.Sketch(64, 16.0), IT, ["sketch_dim", "float"]),
    (lambda: qjlkv.Sketch(-64, 16), IA, ["head_dim is -64"]),
]

CONFIG_CASES = [
    (lambda: qjlkv.Config("fast", **SHAPE), IA, ["preset", "fast"]),
    (lambda: qjlkv.Config(3, **SHAPE), IT, ["preset"]),
    (lambda: qjlkv.Config(**{**SHAPE, "num_layers": 0}), IA, ["num_layers is 0"]),
    (lambda: qjlkv.Config(**{**SHAPE, "num_layers": -1}), IA, ["num_layers is -1"]),
    (lambda: qjlkv.Config(**{**SHAPE, "num_q_heads": 6, "num_kv_heads": 4}), IA, ["num_q_heads (6)", "num_kv_heads (4)"]),
    (lambda: qjlkv.Config(**{**SHAPE, "head_dim": 60}), IA, ["head_dim is 60"]),
    (lambda: qjlkv.Config(**{**SHAPE, "head_dim": 512}), IA, ["head_dim is 512"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, bogus=1), IT, ["bogus"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, dtype="int8"), IT, ["dtype", "int8"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, dtype=np.float64), IT, ["dtype", "float64"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, dtype=torch.int32), IT, ["dtype", "int32"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, dtype=object()), IT, ["dtype"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, key_method="sparse"), IA, ["key_method", "sparse"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, device="tpu"), IA, ["device", "tpu"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, block_tokens=12).validate(), IA, ["config.block_tokens is 12"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, block_tokens=-8).validate(), IA, ["config.block_tokens is -8"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, block_tokens="32").validate(), IT, ["config.block_tokens", "str"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, residual_tokens=70000).validate(), IA, ["config.residual_tokens"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, key_sketch_dim=100).validate(), IA, ["config.key_sketch_dim is 100"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, outlier_channels=64).validate(), IA, ["config.outlier_channels is 64"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, outlier_sketch_dim=0).validate(), IA, ["config.outlier_sketch_dim is 0"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, initial_layers=3).validate(), IA, ["config.initial_layers is 3"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, initial_layers=1, initial_key_sketch_dim=4).validate(), IA,
     ["config.initial_key_sketch_dim is 4"]),
    (lambda: qjlkv.Config("kivi", **SHAPE, key_bits=5).validate(), IA, ["config.key_bits is 5"]),
    (lambda: qjlkv.Config("ott", **SHAPE, outlier_tokens=200).validate(), IA, ["config.outlier_tokens is 200"]),
    (lambda: qjlkv.Config("ott", **SHAPE, outlier_spill_tokens=5000).validate(), IA, ["config.outlier_spill_tokens"]),
    (lambda: qjlkv.Config("ott", **SHAPE, outlier_skip_layers=3).validate(), IA, ["config.outlier_skip_layers is 3"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, value_bits=5).validate(), IA, ["config.value_bits is 5"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, value_group_size=48).validate(), IA, ["config.value_group_size is 48"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, sketch_flags=2).validate(), IA, ["config.sketch_flags"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, num_threads=5000).validate(), IA, ["config.num_threads is 5000"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, device=-2).validate(), IA, ["config.device is -2"]),
    (lambda: qjlkv.Config("qjl", **SHAPE, seed=-5).validate(), IA, ["config.seed is -5"]),
    (lambda: qjlkv.Workers(5000), IA, ["num_threads is 5000"]),
    (lambda: qjlkv.Workers(-1), IA, ["num_threads is -1"]),
    (lambda: qjlkv.Workers("2"), IT, ["num_threads", "str"]),
    (lambda: qjlkv.Cache({"num_layers": 1}), IT, ["config", "dict"]),
    (lambda: qjlkv.Cache(qjlkv.Config("qjl", **SHAPE, value_bits=5)), IA, ["config.value_bits is 5"]),
    (lambda: qjlkv.Cache(qjlkv.Config("qjl", **SHAPE, device=0)), UN, ["QJLKV_BACKEND_CUDA", "config.device_ordinal 0"]),
]


@pytest.mark.parametrize("call,cls,words", SKETCH_CASES + CONFIG_CASES)
def test_construction_errors(call, cls, words):
    with raises(cls, *words):
        call()


def cache_cases():
    q8 = np.ones((8, 64), dtype=np.float32)
    return [
        # append
        (lambda c: c.append(2, 0, k(), k()), IA, ["layer is 2"]),
        (lambda c: c.append(-1, 0, k(), k()), IA, ["layer is -1"]),
        (lambda c: c.append(0.0, 0, k(), k()), IT, ["layer", "float"]),
        (lambda c: c.append(0, 2**32, k(), k()), IA, ["seq is 4294967296"]),
        (lambda c: c.append(0, "a", k(), k()), IT, ["seq", "str"]),
        (lambda c: c.append(0, True, k(), k()), IT, ["seq", "bool"]),
        (lambda c: c.append(0, 0, k(dtype=np.float16), k()), IT, ["keys has dtype float16", "float32"]),
        (lambda c: c.append(0, 0, k(), k(dtype=np.float64)), IT, ["values has dtype float64"]),
        (lambda c: c.append(0, 0, k().tolist(), k()), IT, ["keys is a list"]),
        (lambda c: c.append(0, 0, None, k()), IT, ["keys is a NoneType"]),
        (lambda c: c.append(0, 0, k(heads=3), k()), IA, ["keys has shape (3, 3, 64)", "num_kv_heads"]),
        (lambda c: c.append(0, 0, k(d=32), k()), IA, ["keys has shape (3, 2, 32)"]),
        (lambda c: c.append(0, 0, np.ones(64, np.float32), k()), IA, ["keys has shape (64,)"]),
        (lambda c: c.append(0, 0, k(n=0), k(n=0)), IA, ["keys has shape (0, 2, 64)", "n >= 1"]),
        (lambda c: c.append(0, 0, k(), k(n=4)), IA, ["values has shape (4, 2, 64)", "(3, 2, 64)"]),
        (lambda c: c.append(0, 0, k(d=128)[:, :, ::2], k()), IA, ["keys is not C-contiguous"]),
        (lambda c: c.append(0, 0, k(), np.asfortranarray(k())), IA, ["values is not C-contiguous"]),
        (lambda c: c.append(0, 0, torch.ones(2, 3, 64).transpose(0, 1), k()), IA, ["keys is not contiguous"]),
        (lambda c: c.append(0, 0, torch.ones(3, 2, 64, requires_grad=True), k()), IA, ["keys", "DLPack", "gradient"]),
        (lambda c: c.append(0, 0, torch.ones(3, 2, 64, dtype=torch.int32), k()), IT, ["keys has DLPack dtype"]),
        (lambda c: c.append(0, 0, with_value(k(), (1, 1, 5), np.nan), k()), IA, ["keys[", "nan"]),
        (lambda c: c.append(0, 0, k(), with_value(k(), (0, 0, 0), np.inf)), IA, ["values[0] is inf"]),
        (lambda c: c.append(0, 0, k(), with_value(k(), (2, 0, 0), 1e6)), IA, ["values[", "fp16 range"]),
        # attend
        (lambda c: c.attend(2, 0, q8), IA, ["layer is 2"]),
        (lambda c: c.attend(0, 1, q8), IA, ["seq 1"]),
        (lambda c: c.attend(0, 0, np.ones((11, 8, 64), np.float32)), IA, ["n_queries is 11", "10 tokens"]),
        (lambda c: c.attend(0, 0, np.ones((2, 4, 64), np.float32)), IA, ["queries has shape (2, 4, 64)", "num_q_heads"]),
        (lambda c: c.attend(0, 0, q8.astype(np.float16)), IT, ["queries has dtype float16"]),
        (lambda c: c.attend(0, 0, q8, float("nan")), IA, ["scale is nan"]),
        (lambda c: c.attend(0, 0, q8, 0.0), IA, ["scale is 0.0", "> 0"]),
        (lambda c: c.attend(0, 0, q8, -0.125), IA, ["scale is -0.125", "> 0"]),
        (lambda c: c.attend(0, 0, q8, float("inf")), IA, ["scale is inf", "finite"]),
        (lambda c: c.attend(0, 0, q8, 1e39), IA, ["scale is 1e+39", "finite"]),
        (lambda c: c.attend(0, 0, q8, "0.1"), IT, ["scale", "str"]),
        (lambda c: c.attend(0, 0, q8, True), IT, ["scale", "bool"]),
        (lambda c: c.attend_batch(0, [0], q8[None], 0), IA, ["scale is 0", "> 0"]),
        (lambda c: c.attend(0, 0, with_value(q8, (3, 3), np.inf)), IA, ["queries[", "inf"]),
        (lambda c: c.attend(0, 0, q8, out=np.ones((7, 64), np.float32)), IA, ["out has shape (7, 64)"]),
        (lambda c: c.attend(0, 0, q8, out=np.ones((8, 64), np.float16)), IT, ["out has dtype float16"]),
        (lambda c: c.attend(0, 0, q8, out=np.broadcast_to(np.float32(0), (8, 64))), IA, ["out"]),
        (lambda c: c.attend(0, 0, [[0.0] * 64] * 8), IT, ["queries is a list"]),
        # append_batch / attend_batch
        (lambda c: c.append_batch(0, [1, 1], k(2), k(2)), IA, ["seqs lists sequence 1 twice"]),
        (lambda c: c.append_batch(0, [1, 2, 3], k(2), k(2)), IA, ["keys has shape (2, 2, 64)", "len(seqs)"]),
        (lambda c: c.append_batch(0, [1, 2], k(2), k(3)), IA, ["values has shape (3, 2, 64)"]),
        (lambda c: c.append_batch(0, [1, -2], k(2), k(2)), IA, ["seqs[1] is -2"]),
        (lambda c: c.append_batch(0, 5, k(1), k(1)), IT, ["seqs must be a sequence"]),
        (lambda c: c.append_batch(0, "ab", k(2), k(2)), IT, ["seqs must be a sequence"]),
        (lambda c: c.append_batch(3, [1], k(1), k(1)), IA, ["layer is 3"]),
        (lambda c: c.attend_batch(0, [0, 9], np.ones((2, 8, 64), np.float32)), IA, ["seq 9"]),
        (lambda c: c.attend_batch(0, [0], np.ones((2, 8, 64), np.float32)), IA, ["queries has shape (2, 8, 64)"]),
        (lambda c: c.attend_batch(0, [0], np.ones((1, 8, 64), np.float32), out=np.ones((1, 8, 32), np.float32)),
         IA, ["out has shape (1, 8, 32)"]),
        # scores, reconstruct, length, clear, sketch, stream
        (lambda c: c.scores(0, 0, np.ones((2, 8, 64), np.float32)), IA, ["query has shape (2, 8, 64)"]),
        (lambda c: c.scores(0, 3, q8), IA, ["seq 3"]),
        (lambda c: c.scores(0, 0, with_value(q8, (0, 0), np.nan)), IA, ["query[0] is nan"]),
        (lambda c: c.reconstruct(0, 0, 10), IA, ["[10, 10 + 0)", "10 tokens"]),
        (lambda c: c.reconstruct(0, 0, 4, 7), IA, ["[4, 4 + 7)"]),
        (lambda c: c.reconstruct(0, 0, 0, 0), IA, ["count is 0"]),
        (lambda c: c.reconstruct(0, 0, -1), IA, ["first is -1"]),
        (lambda c: c.reconstruct(0, 0, keys=False, values=False), IA, ["keys_out and values_out are both NULL"]),
        (lambda c: c.reconstruct(0, 4), IA, ["seq 4", "0 tokens"]),
        (lambda c: c.length(5, 0), IA, ["layer is 5"]),
        (lambda c: c.clear(-3), IA, ["seq is -3"]),
        (lambda c: c.sketch(2), IA, ["layer is 2"]),
        (lambda c: c.set_stream(5), UN, ["stream"]),
        (lambda c: c.set_stream("s"), IT, ["stream", "str"]),
        (lambda c: c.set_workers("w"), IT, ["workers", "str"]),
    ]


@pytest.mark.parametrize("case", range(len(cache_cases())))
def test_cache_call_errors_name_the_argument_and_change_nothing(cache, case):
    call, cls, words = cache_cases()[case]
    before = (cache.stats(), cache.reconstruct(0, 0), cache.length(0, 1), cache.length(0, 2))
    with raises(cls, *words):
        call(cache)
    after = (cache.stats(), cache.reconstruct(0, 0), cache.length(0, 1), cache.length(0, 2))
    assert before[0] == after[0] and before[2:] == after[2:]
    for a, b in zip(before[1], after[1]):
        np.testing.assert_array_equal(a, b)


def test_append_batch_is_all_or_nothing(rng):
    cache = qjlkv.Cache(small_config())
    keys = randn(rng, 3, 2, 64)
    bad = with_value(keys, (2, 1, 7), np.nan)
    with raises(IA, "keys["):
        cache.append_batch(0, [4, 5, 6], bad, keys)
    assert [cache.length(0, s) for s in (4, 5, 6)] == [0, 0, 0]


def test_sketch_of_a_cache_without_one():
    with raises(UN, "key_method"):
        qjlkv.Cache(small_config("kivi")).sketch(0)


def test_closed_cache_rejects_calls(rng):
    cache = qjlkv.Cache(small_config())
    cache.close()
    with raises(IA, "closed"):
        cache.append(0, 0, k(), k())
    with raises(IA, "closed"):
        cache.stats()


class DLPackProducer:
    """A DLPack producer with any device and dtype, built with ctypes: a device the library
    cannot read never has its memory touched, so no GPU is needed to test the checks."""

    class _Device(ctypes.Structure):
        _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]

    class _DType(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]

    class _Tensor(ctypes.Structure):
        pass

    _Tensor._fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DType),
                        ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                        ("byte_offset", ctypes.c_uint64), ("manager_ctx", ctypes.c_void_p),
                        ("deleter", ctypes.c_void_p)]

    def __init__(self, shape, device=(1, 0), dtype=(2, 32, 1)):
        self.buffer = np.zeros(shape, dtype=np.float32)
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.tensor = self._Tensor(self.buffer.ctypes.data, self._Device(*device), len(shape), self._DType(*dtype),
                                   self.shape, None, 0, None, None)
        self.device = device
        self.streams = []

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None):
        self.streams.append(stream)
        new_capsule = ctypes.pythonapi.PyCapsule_New
        new_capsule.restype = ctypes.py_object
        new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new_capsule(ctypes.addressof(self.tensor), b"dltensor", None)


def test_dlpack_producer_on_a_cpu_is_read_in_place():
    producer = DLPackProducer((3, 2, 64))
    assert qjlkv._qjlkv.data_pointer(producer) == producer.buffer.ctypes.data
    assert producer.streams == [None]  # a CPU producer gets no stream


def test_device_mismatch_is_named():
    cache = qjlkv.Cache(small_config())
    on_gpu = DLPackProducer((3, 2, 64), device=(2, 1))  # kDLCUDA, device 1
    with raises(IA, "keys is on cuda:1", "the cache is on cpu"):
        cache.append(0, 0, on_gpu, k())
    assert on_gpu.streams == [1]  # the legacy default stream: the producer orders its work first
    with raises(IA, "values lives on DLPack device type 4"):
        cache.append(0, 0, k(), DLPackProducer((3, 2, 64), device=(4, 0)))
    with raises(IT, "keys has DLPack dtype (code 0, bits 32, lanes 1)"):
        cache.append(0, 0, DLPackProducer((3, 2, 64), dtype=(0, 32, 1)), k())
    with raises(IT, "keys has DLPack dtype (code 2, bits 32, lanes 4)"):
        cache.append(0, 0, DLPackProducer((3, 2, 64), dtype=(2, 32, 4)), k())
