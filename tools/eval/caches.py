"""KV caches the model decodes through: one small interface, two implementations.

  append(layer, keys, values)   keys, values: float32 [n_tokens, Hkv, d] (post-RoPE keys)
  attend(layer, queries)        queries [n, Hq, d] -> [n, Hq, d]: the last n appended
                                positions, causal among themselves, scale 1/sqrt(d)
  stats()                       dict with bits_per_number, bytes_used, bytes_fp16_equivalent,
                                bytes_full_precision (exact tails and pools)

ExactCache is the reference: float32 numpy arrays, exact softmax attention.
QjlkvCache stores through the libqjlkv Python binding (`import qjlkv`), with float32 or
float16 I/O (float16: the model's float32 K/V/queries are rounded to fp16 on the way in, as
an fp16 engine hands them over, and the exact tail is stored in fp16).
tools/eval/anchors.py has llama.cpp's q8_0/q4_0 formats with the same interface.
"""
from __future__ import annotations

import numpy as np

from .model import grouped_attention

SEQUENCE = 0  # every cache here holds one sequence


class ExactCache:
    """Plain float32 cache with exact attention: the reference of every comparison."""

    name = "exact (numpy fp32)"

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int):
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.keys = [np.empty((0, num_kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self.values = [np.empty((0, num_kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` tokens per layer now, so that a run of known length does not
        grow to twice its size (a 16k-token Qwen2.5 cache: 0.9 GB instead of 1.8 GB)."""
        for store in (self.keys, self.values):
            for layer, held in enumerate(store):
                if len(held) < tokens:
                    grown = np.empty((tokens, self.num_kv_heads, self.head_dim), np.float32)
                    grown[:self.lengths[layer]] = held[:self.lengths[layer]]
                    store[layer] = grown

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        n, length = len(keys), self.lengths[layer]
        if length + n > len(self.keys[layer]):  # grow geometrically: appends stay O(1)
            capacity = max(2 * len(self.keys[layer]), length + n, 64)
            for store in (self.keys, self.values):
                grown = np.empty((capacity, self.num_kv_heads, self.head_dim), np.float32)
                grown[:length] = store[layer][:length]
                store[layer] = grown
        self.keys[layer][length:length + n] = self._stored(keys)
        self.values[layer][length:length + n] = self._stored(values)
        self.lengths[layer] = length + n

    def _stored(self, x: np.ndarray) -> np.ndarray:
        """What attention reads back of appended keys or values [n, Hkv, d]: here, x itself;
        subclasses that emulate a storage format round-trip x through it."""
        return x

    def attend(self, layer: int, queries: np.ndarray) -> np.ndarray:
        n, length = len(queries), self.lengths[layer]
        query_pos = np.arange(length - n, length)[:, None]
        mask = np.where(np.arange(length)[None, :] <= query_pos, np.float32(0), np.float32(-np.inf))
        return grouped_attention(queries, self.keys[layer][:length], self.values[layer][:length], mask)

    def stats(self) -> dict:
        numbers = sum(self.lengths) * self.num_kv_heads * self.head_dim * 2
        return {"bits_per_number": 32.0, "bytes_used": numbers * 4,
                "bytes_fp16_equivalent": numbers * 2, "bytes_full_precision": numbers * 4}


class QjlkvCache:
    """A libqjlkv cache (CPU) built from a preset plus field overrides; `dtype` (a config
    field) sets the I/O precision, float32 by default; attend returns float32."""

    def __init__(self, name: str, preset: str, shape, **fields):
        import qjlkv

        self.name, self.preset, self.fields = name, preset, fields
        self.io_dtype = np.dtype(fields.get("dtype", "float32"))
        config = qjlkv.Config(preset, num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
                              num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, **fields)
        self.cache = qjlkv.Cache(config)

    def _io(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=self.io_dtype)

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        self.cache.append(layer, SEQUENCE, self._io(keys), self._io(values))

    def attend(self, layer: int, queries: np.ndarray) -> np.ndarray:
        return np.asarray(self.cache.attend(layer, SEQUENCE, self._io(queries)), dtype=np.float32)

    def stats(self) -> dict:
        return dict(self.cache.stats())
