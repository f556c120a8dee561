"""Export and import of a sequence (qjlkv_cache_export*/import*): bytes and the buffer protocol,
file objects in both directions, several streams in one file, continued decode bit-identical to
the cache that never left, and the refusals with the destination unchanged."""

from __future__ import annotations

import io

import numpy as np
import pytest

import qjlkv

from conftest import raises, randn, small_config


def _fill(cache: qjlkv.Cache, rng: np.random.Generator, seq: int, tokens: int, dtype) -> None:
    cfg = cache.config
    for layer in range(cfg.num_layers):
        cache.append(layer, seq, randn(rng, tokens + layer, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
                     randn(rng, tokens + layer, cfg.num_kv_heads, cfg.head_dim, dtype=dtype))


def _decode_outputs(cache: qjlkv.Cache, seq: int, steps: int, dtype) -> list[np.ndarray]:
    """Appends `steps` tokens to every layer, attending after each; the outputs, in order."""
    cfg = cache.config
    rng = np.random.default_rng(99)  # the same tokens and queries for every cache
    outputs = []
    for _ in range(steps):
        for layer in range(cfg.num_layers):
            cache.append(layer, seq, randn(rng, cfg.num_kv_heads, cfg.head_dim, dtype=dtype),
                         randn(rng, cfg.num_kv_heads, cfg.head_dim, dtype=dtype))
            outputs.append(cache.attend(layer, seq, randn(rng, 1, cfg.num_q_heads, cfg.head_dim, dtype=dtype)))
    return outputs


@pytest.mark.parametrize("preset", ["q2", "q3", "q4", "qjl", "kivi", "ott", "exact"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_bytes_round_trip_then_identical_decode(preset: str, dtype, rng: np.random.Generator) -> None:
    cfg = small_config(preset, dtype="float32" if dtype == np.float32 else "float16", block_tokens=16,
                       residual_tokens=8, num_threads=1, seed=5)
    source = qjlkv.Cache(cfg)
    _fill(source, rng, seq=3, tokens=61, dtype=dtype)
    stream = source.export_bytes(3)
    assert isinstance(stream, bytes) and stream[:8] == b"QJLKVSEQ"
    dest = qjlkv.Cache(cfg)
    dest.import_bytes(11, memoryview(bytearray(stream)))  # any buffer, read in place
    assert [dest.length(layer, 11) for layer in range(2)] == [source.length(layer, 3) for layer in range(2)]
    assert dest.export_bytes(11) == stream
    for a, b in zip(_decode_outputs(source, 3, 20, dtype), _decode_outputs(dest, 11, 20, dtype)):
        assert a.tobytes() == b.tobytes()
    assert dest.export_bytes(11) == source.export_bytes(3)


def test_mixed_keys_streams_carry_key_token_bits(rng: np.random.Generator) -> None:
    """key_token_bits sizes a q2 cache's stored keys: a stream goes into a cache of the same
    key_token_bits only, and any other is refused naming the field (docs/FORMAT.md: a new config
    field that changes stored bytes is a header field the reader compares)."""
    cfg = small_config("q2", block_tokens=16, residual_tokens=8, sink_tokens=4, num_threads=1)
    source = qjlkv.Cache(cfg)
    _fill(source, rng, seq=0, tokens=61, dtype=np.float32)
    stream = source.export_bytes(0)
    same = qjlkv.Cache(cfg)
    same.import_bytes(1, stream)
    assert same.export_bytes(1) == stream
    for bits in (cfg.key_token_bits - 8, cfg.key_token_bits + 8):
        other = qjlkv.Cache(cfg.replace(key_token_bits=bits))
        before = other.stats()
        with raises(qjlkv.InvalidArgument, "key_token_bits"):
            other.import_bytes(1, stream)
        assert other.stats() == before and other.length(0, 1) == 0


def test_files_hold_several_streams(tmp_path, rng: np.random.Generator) -> None:
    cfg = small_config("kivi", block_tokens=16, residual_tokens=8)
    source = qjlkv.Cache(cfg)
    _fill(source, rng, seq=1, tokens=40, dtype=np.float32)
    _fill(source, rng, seq=2, tokens=5, dtype=np.float32)
    path = tmp_path / "kv.bin"
    with open(path, "wb") as f:
        first = source.export_to(f, 1)
        second = source.export_to(f, 2, first_layer=1, num_layers=1)
    assert path.stat().st_size == first + second
    assert first == len(source.export_bytes(1))
    dest = qjlkv.Cache(cfg)
    with open(path, "rb") as f:
        dest.import_from(f, 7)
        dest.import_from(f, 8)
        assert f.read() == b""
    assert dest.export_bytes(7) == source.export_bytes(1)
    assert dest.length(0, 8) == 0 and dest.length(1, 8) == source.length(1, 2)
    # An object with read() only (no readinto) works too.
    class ReadOnly:
        def __init__(self, data: bytes) -> None:
            self._f = io.BytesIO(data)

        def read(self, n: int) -> bytes:
            return self._f.read(min(n, 7))

    other = qjlkv.Cache(cfg)
    other.import_from(ReadOnly(source.export_bytes(1)), 1)
    assert other.export_bytes(1) == source.export_bytes(1)


def test_refusals_leave_the_destination_unchanged(rng: np.random.Generator) -> None:
    cfg = small_config("qjl", block_tokens=16, residual_tokens=8)
    source = qjlkv.Cache(cfg)
    _fill(source, rng, seq=1, tokens=40, dtype=np.float32)
    stream = source.export_bytes(1)
    dest = qjlkv.Cache(cfg)
    _fill(dest, rng, seq=1, tokens=3, dtype=np.float32)
    before = dest.stats()
    with raises(qjlkv.InvalidArgument, "already holds"):
        dest.import_bytes(1, stream)
    with raises(qjlkv.CorruptData, "truncated", status=qjlkv.Status.CORRUPT_DATA):
        dest.import_bytes(2, stream[:-1])
    damaged = bytearray(stream)
    damaged[300] ^= 0x10
    with raises(qjlkv.CorruptData, "checksum", status=qjlkv.Status.CORRUPT_DATA):
        dest.import_bytes(2, damaged)
    with raises(qjlkv.CorruptData, "truncated", status=qjlkv.Status.CORRUPT_DATA):
        dest.import_from(io.BytesIO(stream[:200]), 2)
    with raises(qjlkv.InvalidArgument, "key_method"):
        qjlkv.Cache(small_config("kivi")).import_bytes(1, stream)
    with raises(qjlkv.InvalidType, "data"):
        dest.import_bytes(2, 12)
    with raises(qjlkv.InvalidType, "file"):
        dest.import_from(12, 2)
    assert dest.stats() == before and dest.length(0, 2) == 0
    with raises(qjlkv.InvalidArgument, "seq"):
        source.export_bytes(5)


def test_write_errors_propagate(rng: np.random.Generator) -> None:
    cfg = small_config("exact")
    source = qjlkv.Cache(cfg)
    _fill(source, rng, seq=0, tokens=4, dtype=np.float32)

    class Full:
        def write(self, data: bytes) -> int:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        source.export_to(Full(), 0)

    class Short:
        def write(self, data: bytes) -> int:
            return len(data) - 1

    with raises(qjlkv.InvalidArgument, "write"):
        source.export_to(Short(), 0)
