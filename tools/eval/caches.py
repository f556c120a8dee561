"""KV caches the model decodes through: one small interface, two implementations.

  append(layer, keys, values)   keys, values: float32 [n_tokens, Hkv, d] (post-RoPE keys)
  attend(layer, queries)        queries [n, Hq, d] -> [n, Hq, d]: the last n appended
                                positions, causal among themselves, scale 1/sqrt(d); on a
                                layer with a sliding window W (Gemma 3's local layers) each
                                query sees only the newest W positions up to its own
  stats()                       dict with bits_per_number, bytes_used, bytes_fp16_equivalent,
                                bytes_full_precision (exact tails and pools)

ExactCache is the reference: float32 numpy arrays, exact softmax attention.
QjlkvCache stores through the libqjlkv Python binding (`import qjlkv`), with float32 or
float16 I/O (float16: the model's float32 K/V/queries are rounded to fp16 on the way in, as
an fp16 engine hands them over, and the exact tail is stored in fp16).
tools/eval/anchors.py has llama.cpp's q8_0/q4_0 formats with the same interface.

Windows: every cache is made with the model's per-layer windows (ModelShape.windows, None
for a global layer). The numpy caches mask what lies outside a window and keep it (their
stats count every appended position; window_bytes() says what a store that frees it holds).
QjlkvCache hands each layer's window to the library and refuses to be made on a windowed
model when the installed qjlkv cannot restrict attention to a window: running it with full
attention would measure another model.
"""
from __future__ import annotations

import numpy as np

from .model import causal_mask, grouped_attention

SEQUENCE = 0  # every cache here holds one sequence


def shape_windows(shape) -> tuple | None:
    """The per-layer windows of a model shape, None when no layer has one."""
    windows = getattr(shape, "windows", None)
    return None if windows is None or all(w is None for w in windows) else tuple(windows)


def window_bytes(shape, tokens: int, bytes_per_number: float, block: int = 1) -> dict:
    """Bytes of K and V at `tokens` positions: `full`, every layer holding every position,
    and `windowed`, a windowed layer holding only what its window still sees: its newest W
    positions, or up to W + block - 1 where positions are freed a block at a time (counted
    here at that worst case)."""
    per_position = shape.num_kv_heads * shape.head_dim * 2 * bytes_per_number
    windows = shape_windows(shape) or (None,) * shape.num_layers
    held = [tokens if w is None else min(tokens, w + block - 1) for w in windows]
    return {"full": int(shape.num_layers * tokens * per_position),
            "windowed": int(sum(held) * per_position)}


class ExactCache:
    """Plain float32 cache with exact attention: the reference of every comparison."""

    name = "exact (numpy fp32)"

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 windows: tuple | None = None):
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        if windows is not None and len(windows) != num_layers:
            raise ValueError(f"{len(windows)} windows for {num_layers} layers")
        self.windows = windows if windows is not None else (None,) * num_layers
        self.keys = [np.empty((0, num_kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self.values = [np.empty((0, num_kv_heads, head_dim), np.float32) for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    @classmethod
    def of(cls, shape) -> "ExactCache":
        """The reference cache of a model shape, with its windows."""
        return cls(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                   windows=shape_windows(shape))

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
        window = self.windows[layer]
        # the oldest position the first query's window still sees: nothing before it is read
        first = 0 if window is None else max(0, length - n - window + 1)
        mask = causal_mask(np.arange(length - n, length), first, length, window)
        return grouped_attention(queries, self.keys[layer][first:length],
                                 self.values[layer][first:length], mask)

    def stats(self) -> dict:
        numbers = sum(self.lengths) * self.num_kv_heads * self.head_dim * 2
        return {"bits_per_number": 32.0, "bytes_used": numbers * 4,
                "bytes_fp16_equivalent": numbers * 2, "bytes_full_precision": numbers * 4}


# How the adapter gives the library a layer's window: Cache.<this>(layer, window_tokens=W)
# (qjlkv_cache_set_layer_attention), after which attend on that layer sees only the newest W
# positions up to each query.
LIBRARY_WINDOW_METHOD = "set_layer_attention"


class WindowsUnsupported(ValueError):
    """The installed qjlkv cannot restrict a layer's attention to a sliding window."""


def library_has_windows(qjlkv) -> bool:
    return callable(getattr(qjlkv.Cache, LIBRARY_WINDOW_METHOD, None))


def require_library_windows(qjlkv, what: str) -> None:
    if not library_has_windows(qjlkv):
        raise WindowsUnsupported(
            f"{what}: this model has sliding-window layers and the installed qjlkv "
            f"{getattr(qjlkv, '__version__', '?')} cannot restrict attention to a window "
            f"(no qjlkv.Cache.{LIBRARY_WINDOW_METHOD}); running it with full attention would "
            "measure another model. The numpy formats (exact, q8_0, q4_0) do run windowed.")


class QjlkvCache:
    """A libqjlkv cache (CPU) built from a preset plus field overrides; `dtype` (a config
    field) sets the I/O precision, float32 by default; attend returns float32."""

    def __init__(self, name: str, preset: str, shape, **fields):
        import qjlkv

        self.name, self.preset, self.fields = name, preset, fields
        self.io_dtype = np.dtype(fields.get("dtype", "float32"))
        self.windows = shape_windows(shape)
        if self.windows is not None:
            require_library_windows(qjlkv, f"{name} (preset {preset})")
        config = qjlkv.Config(preset, num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
                              num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, **fields)
        self.cache = qjlkv.Cache(config)
        for layer, window in enumerate(self.windows or ()):
            if window is not None:
                getattr(self.cache, LIBRARY_WINDOW_METHOD)(layer, window_tokens=window)

    def _io(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=self.io_dtype)

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        self.cache.append(layer, SEQUENCE, self._io(keys), self._io(values))

    def attend(self, layer: int, queries: np.ndarray) -> np.ndarray:
        return np.asarray(self.cache.attend(layer, SEQUENCE, self._io(queries)), dtype=np.float32)

    def stats(self) -> dict:
        return dict(self.cache.stats())
