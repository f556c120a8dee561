"""Shared helpers of the qjlkv Python tests."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

import qjlkv


@contextlib.contextmanager
def raises(cls: type, *words: str, status: qjlkv.Status | None = None):
    """Expects a qjlkv error of class `cls` whose message names every one of `words` and whose
    .status is `status` (by default the class's own)."""
    with pytest.raises(cls) as info:
        yield info
    err = info.value
    assert isinstance(err, qjlkv.Error)
    message = str(err)
    for word in words:
        assert re.search(re.escape(word), message), f"{word!r} not named in {message!r}"
    expected = status
    if expected is None:
        expected = {
            qjlkv.InvalidType: qjlkv.Status.INVALID_ARGUMENT,
            qjlkv.InvalidArgument: qjlkv.Status.INVALID_ARGUMENT,
            qjlkv.Unsupported: qjlkv.Status.UNSUPPORTED,
        }.get(cls)
    if expected is not None:
        assert err.status == expected, f"status {err.status!r}, expected {expected!r}"


def small_config(preset: str = "qjl", **fields) -> qjlkv.Config:
    shape = dict(num_layers=2, num_q_heads=8, num_kv_heads=2, head_dim=64)
    shape.update({k: fields.pop(k) for k in list(fields) if k in shape})
    return qjlkv.Config(preset, **shape, **fields)


def randn(rng: np.random.Generator, *shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def cuda_available() -> bool:
    """A CUDA device usable by both torch and this build of the library."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    try:
        qjlkv.Cache(small_config(device=0)).close()
    except qjlkv.Unsupported:
        return False
    return True


def require_cuda() -> None:
    if not cuda_available():
        reason = "needs a CUDA device and a libqjlkv built with QJLKV_CUDA=ON"
        print(f"SKIP: {reason}")
        pytest.skip(reason)


@pytest.fixture
def fp32_kernels(monkeypatch):
    """Caches created in the test run the fp32 (scalar) CPU kernels: tests that hold QJL scores to
    the estimator's formula within float rounding use it. The integer QJL paths (avx2, avx512,
    avx512vnni) are held to SPEC §9's error budget by tests/cpu_paths instead."""
    monkeypatch.setenv("QJLKV_CPU_ISA", "scalar")
