"""The KV formats users would otherwise pick: llama.cpp's q8_0 and q4_0 cache types, and
q4_0 after a normalized Hadamard rotation, as numpy caches with the interface of caches.py;
also its default f16 (every number rounded to float16, 16 bits), the exact-storage row
where the library's own exact preset cannot run (a model with sliding windows).

Block formats, bit-exact to ggml's reference quantizers (ggml-quants.c; the `gguf`
package's quants module implements the same, and tests/eval/test_anchors.py compares):
  q8_0  32 numbers -> fp16 d = amax / 127 and 32 int8 q = roundf(x / d)  (34 bytes, 8.5 bits)
  q4_0  32 numbers -> fp16 d = max / -8, `max` the signed number of largest magnitude,
        and 32 4-bit q = min(15, (int)(x / d + 8.5))                    (18 bytes, 4.5 bits)
  dequantized: q8_0 q * d, q4_0 (q - 8) * d (d as stored, fp16).
As in llama.cpp's cache (flash attention, which quantized V requires), every token's K and
V rows are stored quantized along head_dim, blocks of 32 within a head; there is no
full-precision tail. The rotated variant stores q4_0(k H) and q4_0(v H) with H the
normalized Sylvester-Hadamard matrix of size head_dim (orthogonal and symmetric), scores
(q H)·(k H) = q·k and rotates the attention output back with H.

What is not emulated: llama.cpp's CPU kernels also round the query to q8_0 (and the
CUDA ones to q8_1) for the dot product with a quantized K, and may accumulate in fp16;
attention here runs in float32 on the dequantized K/V, so the figures isolate the storage.
"""
from __future__ import annotations

import numpy as np

from .caches import ExactCache, shape_windows

BLOCK = 32
BLOCK_BYTES = {"q8_0": 2 + BLOCK, "q4_0": 2 + BLOCK // 2}


def roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (numpy's round goes to even). |x| - trunc|x| is
    exact, unlike |x| + 0.5, which rounds 0.49999997 up to 1."""
    magnitude = np.abs(x)
    whole = np.trunc(magnitude)
    return np.copysign(whole + (magnitude - whole >= 0.5), x)


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [..., 32k] -> (int8 codes [..., 32k], fp16 scales [..., k])."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, BLOCK)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    codes = roundf(blocks * inverse[..., None]).astype(np.int8)
    return codes.reshape(x.shape), d.astype(np.float16)


def quantize_q4_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [..., 32k] -> (codes 0..15 as uint8 [..., 32k], fp16 scales [..., k])."""
    blocks = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, BLOCK)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)[..., 0]
    d = largest / np.float32(-8)
    with np.errstate(divide="ignore"):
        inverse = np.where(d == 0, np.float32(0), np.float32(1) / d)
    # x/d + 8.5 lies in [0.5, 16.5]: the C cast truncates, which is floor here
    codes = np.minimum(15, np.trunc(blocks * inverse[..., None] + np.float32(8.5))).astype(np.uint8)
    return codes.reshape(x.shape), d.astype(np.float16)


def dequantize(fmt: str, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    blocks = codes.reshape(*codes.shape[:-1], -1, BLOCK).astype(np.float32)
    if fmt == "q4_0":
        blocks -= 8
    return (blocks * scales.astype(np.float32)[..., None]).reshape(codes.shape)


def ggml_bytes(fmt: str, codes: np.ndarray, scales: np.ndarray) -> bytes:
    """The blocks as ggml lays them out (fp16 d, then the codes; q4_0 packs code j in the
    low nibble and code j + 16 in the high nibble of byte j)."""
    blocks = codes.reshape(-1, BLOCK)
    if fmt == "q4_0":
        blocks = blocks[:, :16] | (blocks[:, 16:] << 4)
    return np.concatenate([scales.reshape(-1, 1).view(np.uint8),
                           blocks.astype(np.uint8).view(np.uint8)], axis=1).tobytes()


def hadamard(n: int) -> np.ndarray:
    """The normalized Sylvester-Hadamard matrix (n a power of two): H = Hᵀ = H⁻¹."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"head_dim {n} is not a power of two: no Sylvester-Hadamard matrix")
    h = np.ones((1, 1))
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


QUANTIZE = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0}


class BlockQuantCache(ExactCache):
    """K and V of every token stored in a ggml block format (optionally Hadamard-rotated),
    attention in float32 on the dequantized numbers."""

    def __init__(self, name: str, fmt: str, shape, rotate: bool = False):
        if fmt not in QUANTIZE and fmt != "f16":
            raise ValueError(f"format {fmt!r}: expected f16 or one of {sorted(QUANTIZE)}")
        if shape.head_dim % BLOCK:
            raise ValueError(f"head_dim {shape.head_dim} is not a multiple of {BLOCK}")
        super().__init__(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                         windows=shape_windows(shape))
        self.name, self.fmt = name, fmt
        self.rotation = hadamard(shape.head_dim) if rotate else None

    def _stored(self, x: np.ndarray) -> np.ndarray:
        """What attention reads back of x [n, Hkv, d]: rotated, quantized, dequantized."""
        x = np.asarray(x, np.float32)
        if self.rotation is not None:
            x = x @ self.rotation
        if self.fmt == "f16":
            return x.astype(np.float16).astype(np.float32)
        return dequantize(self.fmt, *QUANTIZE[self.fmt](x))

    def attend(self, layer: int, queries: np.ndarray) -> np.ndarray:
        if self.rotation is None:
            return super().attend(layer, queries)
        # Scores of rotated keys with rotated queries equal the unrotated ones (H is orthogonal);
        # the output, a sum of rotated values, is rotated back.
        return super().attend(layer, np.asarray(queries, np.float32) @ self.rotation) @ self.rotation

    def stats(self) -> dict:
        numbers = sum(self.lengths) * self.num_kv_heads * self.head_dim * 2
        used = numbers * 2 if self.fmt == "f16" else numbers // BLOCK * BLOCK_BYTES[self.fmt]
        return {"bits_per_number": 8 * used / numbers if numbers else 0.0, "bytes_used": used,
                "bytes_fp16_equivalent": numbers * 2, "bytes_full_precision": 0}
