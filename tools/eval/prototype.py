"""A numpy prototype of QJL key storage, to measure on the model changes that the library
does not (yet) offer: the remedies proposed in docs/ACCURACY.md.

It keeps the library's block/tail protocol (SPEC §6) but stores each quantized block as the
dense reconstruction k̂ whose inner product with any query equals the QJL estimate
(SPEC §3, "equivalent dense form"), and the per-token quantized values (SPEC §4), so
attention is exact attention over (k̂, v̂) plus the exact tail. Options beyond the SPEC:
  center        subtract the block's per-channel key mean (stored in fp16) before
                sketching and add q·mean back exactly: softmax ignores the common part of
                the logits, but QJL's error grows with the full key norm;
  outlier_bits  store the outlier channels with per-channel `outlier_bits`-bit
                quantization (KIVI-style, over the block) instead of a sign sketch.
Sizes are counted as the library would store them (fp16 norms, scales, minima and
means, uint8 outlier indices, float32 tail).
"""
from __future__ import annotations

import math

import numpy as np

from .caches import ExactCache, shape_windows


def orthogonal_sketch(rows: int, d: int, rng: np.random.Generator) -> np.ndarray:
    """SPEC §2: Gaussian rows, orthonormalized in blocks of d (sign-fixed QR), norm √d."""
    blocks = []
    for start in range(0, rows, d):
        q, r = np.linalg.qr(rng.standard_normal((d, d)))
        q = q * np.sign(np.diag(r))
        blocks.append(q.T[:min(d, rows - start)] * math.sqrt(d))
    return np.concatenate(blocks) if blocks else np.zeros((0, d))


def unbiased_constant(d: int) -> float:
    """c_d of SPEC §3 for orthogonalized rows (uniform on the sphere)."""
    return math.sqrt(math.pi) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2)) / math.sqrt(d)


def fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def fp16_toward(x: np.ndarray, direction: float) -> np.ndarray:
    """The nearest fp16 on the side of `direction` (-inf: <= x, +inf: >= x), as DESIGN.md
    rounds minima down and scales up."""
    h = x.astype(np.float16)
    wrong = (h.astype(np.float64) > x) if direction < 0 else (h.astype(np.float64) < x)
    return np.where(wrong, np.nextafter(h, np.float16(direction)), h).astype(np.float64)


def dequantized(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Asymmetric `bits`-bit quantization with min/scale taken along `axis` (DESIGN.md
    rounding), returned dequantized."""
    lo = fp16_toward(x.min(axis, keepdims=True), -np.inf)
    scale = fp16_toward((x.max(axis, keepdims=True) - lo) / (2 ** bits - 1), np.inf)
    codes = np.clip(np.rint((x - lo) / np.where(scale > 0, scale, 1)), 0, 2 ** bits - 1)
    return codes * scale + lo


def quantize_rows(x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Per-token values in groups of `group` channels (SPEC §4), dequantized."""
    return dequantized(x.reshape(x.shape[0], -1, group), bits, axis=-1).reshape(x.shape)


class PrototypeQjlCache(ExactCache):
    """ExactCache whose blocks are replaced in place by their reconstructions."""

    def __init__(self, name: str, shape, m: int, m_out: int, channels: int, *, block: int = 32,
                 residual: int = 32, value_bits: int = 2, value_group: int = 32,
                 center: bool = False, outlier_bits: int = 0, seed: int = 0):
        super().__init__(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                         windows=shape_windows(shape))
        self.name, self.s = name, shape
        self.m, self.m_out, self.c = m, m_out, channels
        self.block, self.residual = block, residual
        self.value_bits, self.value_group = value_bits, value_group
        self.center, self.outlier_bits = center, outlier_bits
        d = shape.head_dim
        self.c_d = unbiased_constant(d)
        rng = np.random.default_rng(seed)
        self.sketch = [orthogonal_sketch(max(m, m_out), d, rng) for _ in range(shape.num_layers)]
        self.quantized = [0] * shape.num_layers  # positions [0, quantized) are blocks

    def _reconstruct_keys(self, sketch: np.ndarray, kb: np.ndarray) -> np.ndarray:
        """kb [B, d] of one kv head -> k̂ [B, d] with <q, k̂> = the estimate."""
        out = np.zeros_like(kb)
        if self.center:
            mean = fp16(kb.mean(0))
            kb = kb - mean
            out += mean
        mask = np.zeros(kb.shape[1], bool)
        if self.c:
            mask[np.argsort(-(kb ** 2).sum(0), kind="stable")[:self.c]] = True
        k_in, k_out = kb * ~mask, kb * mask
        s_in = sketch[:self.m]
        signs = np.where(k_in @ s_in.T > 0, 1.0, -1.0)
        norm_in = fp16(np.linalg.norm(k_in, axis=1, keepdims=True))
        out += self.c_d / self.m * norm_in * (signs @ s_in) * ~mask
        if self.c and self.outlier_bits:  # per channel over the block, as KIVI keys
            out += dequantized(k_out, self.outlier_bits, axis=0) * mask
        elif self.c:
            s_out = sketch[:self.m_out]
            signs = np.where(k_out @ s_out.T > 0, 1.0, -1.0)
            norm_out = fp16(np.linalg.norm(k_out, axis=1, keepdims=True))
            out += self.c_d / self.m_out * norm_out * (signs @ s_out) * mask
        return out

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        super().append(layer, keys, values)
        while self.lengths[layer] - self.quantized[layer] >= self.residual + self.block:
            start, end = self.quantized[layer], self.quantized[layer] + self.block
            kb = self.keys[layer][start:end].astype(np.float64)
            vb = self.values[layer][start:end].astype(np.float64)
            for h in range(self.s.num_kv_heads):
                kb[:, h] = self._reconstruct_keys(self.sketch[layer], kb[:, h])
                vb[:, h] = (quantize_rows(vb[:, h], self.value_bits, self.value_group)
                            if self.value_bits < 16 else fp16(vb[:, h]))
            self.keys[layer][start:end] = kb
            self.values[layer][start:end] = vb
            self.quantized[layer] = end

    def _block_bytes_per_head(self) -> float:
        d, b = self.s.head_dim, self.block
        key = b * (self.m / 8 + 2)                       # inlier signs, fp16 norm
        if self.c:
            key += self.c                                # uint8 outlier indices
            if self.outlier_bits:
                key += b * self.c * self.outlier_bits / 8 + self.c * 4  # codes, fp16 scale+min
            else:
                key += b * (self.m_out / 8 + 2)          # outlier signs, fp16 norm
        if self.center:
            key += d * 2                                 # fp16 block mean
        if self.value_bits < 16:
            value = b * (d * self.value_bits / 8 + d // self.value_group * 4)
        else:
            value = b * d * 2
        return key + value

    def stats(self) -> dict:
        s = self.s
        blocks = sum(self.quantized) // self.block
        tail = sum(self.lengths) - sum(self.quantized)
        tail_bytes = tail * s.num_kv_heads * s.head_dim * 2 * 4
        used = blocks * s.num_kv_heads * self._block_bytes_per_head() + tail_bytes
        numbers = sum(self.lengths) * s.num_kv_heads * s.head_dim * 2
        return {"bits_per_number": 8 * used / numbers, "bytes_used": int(used),
                "bytes_fp16_equivalent": numbers * 2, "bytes_full_precision": tail_bytes}
