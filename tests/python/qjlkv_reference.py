"""An independent numpy model of SPEC §3-§6 and docs/DESIGN.md, written from the documents
only (never from src/). The sketch matrix is the one input taken from the package
(Sketch.matrix / Cache.sketch), as the SPEC allows any backend to upload it.

Everything here works per (kv head) token stream of one sequence and one layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


# ---------------------------------------------------------------------------
# fp16 with directed rounding (DESIGN "Numbers and rounding")
# ---------------------------------------------------------------------------
def f16_round_down(x: np.ndarray) -> np.ndarray:
    """The largest fp16 <= x, returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    h = x.astype(np.float16)
    up = h.astype(np.float32) > x
    h[up] = np.nextafter(h[up], np.float16(-np.inf))
    return h.astype(np.float32)


def f16_round_up(x: np.ndarray) -> np.ndarray:
    """The smallest fp16 >= x, returned as float32."""
    x = np.asarray(x, dtype=np.float32)
    h = x.astype(np.float16)
    down = h.astype(np.float32) < x
    h[down] = np.nextafter(h[down], np.float16(np.inf))
    return h.astype(np.float32)


def f16(x: np.ndarray) -> np.ndarray:
    """Round to nearest-even fp16, returned as float32 (how norms are stored)."""
    return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)


# ---------------------------------------------------------------------------
# SPEC §4 / DESIGN: asymmetric b-bit quantization of groups (values per token, KIVI keys
# per channel over a block)
# ---------------------------------------------------------------------------
def quantize_groups(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Dequantized x-hat of the groups that run along `axis` of float32 x."""
    x = np.asarray(x, dtype=np.float32)
    levels = np.float32(2**bits - 1)
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    min16 = f16_round_down(lo)
    scale16 = f16_round_up((hi - min16) / levels)
    flat = hi == lo  # zero range: scale 0, codes 0, x-hat = min16
    scale16 = np.where(flat, np.float32(0), scale16)
    safe = np.where(flat, np.float32(1), scale16)
    codes = np.clip(np.rint((x - min16) / safe), 0, levels).astype(np.float32)
    codes = np.where(flat, np.float32(0), codes)
    return (codes * scale16 + min16).astype(np.float32)


def quantize_values(v: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Per-token values (tokens, d) in groups of `group` channels."""
    tokens, d = v.shape
    return quantize_groups(v.reshape(tokens, d // group, group), bits, axis=2).reshape(tokens, d)


# ---------------------------------------------------------------------------
# Mixed-bit keys (key_method "mixed", the q2 preset): per block and channel the fp16 range
# [lo, hi] of the block's tokens (minimum rounded down, maximum rounded up) and a width of 0-4
# bits; a token's key_token_bits go to the candidates (channel j, bit b < 4) of largest priority
# r_j * 2^-b (r_j = hi_j - lo_j), ties to the lower candidate 4j + b. A code cuts the range into
# 2^w equal cells and decodes to its cell's centre; 0 bits decode to the middle of the range.
# ---------------------------------------------------------------------------
MIXED_MAX_WIDTH = 4


def mixed_widths(ranges: np.ndarray, key_token_bits: int) -> np.ndarray:
    """The code width of each channel of a block, given the channels' fp16 ranges (d,)."""
    d = len(ranges)
    candidate = np.arange(MIXED_MAX_WIDTH * d)
    priority = np.ldexp(np.repeat(ranges.astype(np.float32), MIXED_MAX_WIDTH),
                        -(candidate % MIXED_MAX_WIDTH)).astype(np.float32)
    taken = np.lexsort((candidate, -priority))[:key_token_bits]  # largest first, then lower index
    return np.bincount(taken // MIXED_MAX_WIDTH, minlength=d)


def mixed_quantize_block(keys: np.ndarray, key_token_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(dense keys (B, d) float32, widths (d,)) of one block of one kv head."""
    keys = np.asarray(keys, dtype=np.float32)
    lo = f16_round_down(keys.min(axis=0))
    hi = f16_round_up(keys.max(axis=0))
    ranges = (hi - lo).astype(np.float32)
    widths = mixed_widths(ranges, key_token_bits)
    cell = np.ldexp(ranges, -widths).astype(np.float32)
    top = (2.0**widths - 1).astype(np.float32)
    safe = np.where(cell > 0, cell, np.float32(1))
    codes = np.clip(np.floor((keys - lo) / safe), 0, top).astype(np.float32)
    codes = np.where((widths == 0) | (cell == 0), np.float32(0), codes)
    return (lo + (codes + np.float32(0.5)) * cell).astype(np.float32), widths


# ---------------------------------------------------------------------------
# SPEC §3: QJL keys
# ---------------------------------------------------------------------------
def qjl_constant(d: int, orthogonal: bool) -> float:
    if not orthogonal:
        return math.sqrt(math.pi / 2)
    return math.sqrt(math.pi) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2)) / math.sqrt(d)


def outlier_channels(block_keys: np.ndarray, c: int) -> np.ndarray:
    """The c channels of largest sum of squares over the block (ties: lower index), ascending."""
    energy = (block_keys.astype(np.float64) ** 2).sum(axis=0)
    order = np.argsort(-energy, kind="stable")
    return np.sort(order[:c])


@dataclass
class QJLBlock:
    """One quantized block of one kv head, as SPEC §3 defines it (bits as ±1) with the outlier
    bits replaced by what DESIGN "QJL outlier corrections" stores: tau (B, c), fp16-rounded."""

    signs_in: np.ndarray     # (B, m) of ±1
    norm_in: np.ndarray      # (B,) fp16-rounded
    norm_out: np.ndarray     # (B,)
    outliers: np.ndarray     # (c,) channel indices
    corrections: np.ndarray  # (B, c): tau = T / (n_in + n_out), fp16-rounded


def qjl_quantize_block(keys: np.ndarray, sketch: np.ndarray, m: int, m_out: int, c: int, const: float) -> QJLBlock:
    keys = keys.astype(np.float32)
    idx = outlier_channels(keys, c) if c else np.zeros(0, dtype=np.int64)
    mask_out = np.zeros(keys.shape[1], dtype=bool)
    mask_out[idx] = True
    k_out = np.where(mask_out, keys, 0).astype(np.float64)
    k_in = np.where(mask_out, 0, keys).astype(np.float64)
    s = sketch.astype(np.float64)
    signs_in = np.where(k_in @ s[:m].T > 0, 1.0, -1.0)
    norm_in, norm_out = f16(np.linalg.norm(k_in, axis=1)), f16(np.linalg.norm(k_out, axis=1))
    corrections = np.zeros((keys.shape[0], len(idx)))
    if m_out and len(idx):
        signs_out = np.where(k_out @ s[:m_out].T > 0, 1.0, -1.0)
        # T_o: the outlier sketch's estimate of channel o less what the inlier bits put there.
        outlier = const / m_out * norm_out[:, None].astype(np.float64) * (signs_out @ s[:m_out][:, idx])
        inlier = const / m * norm_in[:, None].astype(np.float64) * (signs_in @ s[:m][:, idx])
        scale = norm_in.astype(np.float64) + norm_out
        safe = np.where(scale > 0, scale, 1.0)[:, None]
        corrections = np.where(scale[:, None] > 0, f16((outlier - inlier) / safe), 0.0)
    return QJLBlock(signs_in, norm_in, norm_out, idx, corrections)


def qjl_dense_keys(block: QJLBlock, sketch: np.ndarray, m: int, const: float) -> np.ndarray:
    """k-hat = c_d/m ||k_in|| S^T(±bits_in) + sum_o tau_o (n_in + n_out) e_o."""
    s = sketch.astype(np.float64)
    k_hat = const / m * block.norm_in[:, None] * (block.signs_in @ s[:m])
    scale = block.norm_in.astype(np.float64) + block.norm_out
    k_hat[:, block.outliers] += block.corrections * scale[:, None]
    return k_hat


def qjl_estimate(q: np.ndarray, block: QJLBlock, sketch: np.ndarray, m: int, const: float) -> np.ndarray:
    """est(q, k) for every token of the block, from the asymmetric formula (not the dense form)."""
    s = sketch.astype(np.float64)
    q = q.astype(np.float64)
    est = const / m * block.norm_in * (block.signs_in @ (s[:m] @ q))
    scale = block.norm_in.astype(np.float64) + block.norm_out
    return est + scale * (block.corrections @ q[block.outliers])


# ---------------------------------------------------------------------------
# SPEC §6: one layer of one sequence, all kv heads
# ---------------------------------------------------------------------------
def quantized_length(length: int, block_tokens: int, residual_tokens: int) -> int:
    """Positions held in quantized blocks after `length` appended tokens."""
    if length < residual_tokens + block_tokens:
        return 0
    return (length - residual_tokens) // block_tokens * block_tokens


class ReferenceLayer:
    """The dense (keys, values) a cache layer's attention sees, per SPEC §3-§6, for QJL, KIVI,
    mixed-bit and EXACT keys (no sink tokens; uniform values). keys/values: (length, Hkv, d) float32 (already in the input dtype's
    precision); storage16: np.float16 or "bfloat16" rounding for 16-bit storage."""

    def __init__(self, cfg, keys: np.ndarray, values: np.ndarray, sketch: np.ndarray | None, layer: int = 0,
                 storage16=np.float16) -> None:
        length, heads, d = keys.shape
        B = cfg.block_tokens
        q_len = quantized_length(length, B, cfg.residual_tokens)
        self.dense_keys = keys.astype(np.float64).copy()
        self.dense_values = values.astype(np.float64).copy()
        self.blocks: list[list[QJLBlock]] = [[] for _ in range(heads)]
        initial = layer < cfg.initial_layers
        self.m = cfg.initial_key_sketch_dim if initial else cfg.key_sketch_dim
        self.m_out = (cfg.initial_outlier_sketch_dim if initial else cfg.outlier_sketch_dim) if cfg.outlier_channels else 0
        self.const = qjl_constant(d, bool(cfg.sketch_flags & 1))
        self.sketch = sketch
        self.block_tokens = B
        self.quantized = q_len
        for h in range(heads):
            for start in range(0, q_len, B):
                k = keys[start:start + B, h]
                v = values[start:start + B, h]
                if cfg.key_method == "qjl":
                    blk = qjl_quantize_block(k, sketch, self.m, self.m_out, cfg.outlier_channels, self.const)
                    self.blocks[h].append(blk)
                    self.dense_keys[start:start + B, h] = qjl_dense_keys(blk, sketch, self.m, self.const)
                elif cfg.key_method == "kivi":
                    self.dense_keys[start:start + B, h] = quantize_groups(k, cfg.key_bits, axis=0)
                elif cfg.key_method == "mixed":
                    self.dense_keys[start:start + B, h] = mixed_quantize_block(k, cfg.key_token_bits)[0]
                elif cfg.key_method == "exact":
                    self.dense_keys[start:start + B, h] = round16(k, storage16)
                else:
                    raise ValueError(cfg.key_method)
                if cfg.value_bits == 16:
                    self.dense_values[start:start + B, h] = round16(v, storage16)
                else:
                    self.dense_values[start:start + B, h] = quantize_values(v, cfg.value_bits, cfg.value_group_size)

    def scores(self, query: np.ndarray, group: int) -> np.ndarray:
        """Raw logits (Hq, length): the asymmetric estimator for QJL blocks, <q, k-hat>
        otherwise. query: (Hq, d)."""
        hq = query.shape[0]
        length = self.dense_keys.shape[0]
        out = np.empty((hq, length))
        for h in range(hq):
            kv = h // group
            q = query[h].astype(np.float64)
            out[h] = self.dense_keys[:, kv] @ q
            for i, blk in enumerate(self.blocks[kv]):
                start = i * self.block_tokens
                out[h, start:start + self.block_tokens] = qjl_estimate(q, blk, self.sketch, self.m, self.const)
        return out

    def attend(self, queries: np.ndarray, group: int, scale: float) -> np.ndarray:
        """(n, Hq, d) queries at the last n positions, causal; joint softmax per head."""
        n, hq, d = queries.shape
        length = self.dense_keys.shape[0]
        out = np.empty((n, hq, d))
        for i in range(n):
            visible = length - n + i + 1
            logits = self.scores(queries[i], group)[:, :visible] * scale
            weights = np.exp(logits - logits.max(axis=1, keepdims=True))
            weights /= weights.sum(axis=1, keepdims=True)
            for h in range(hq):
                out[i, h] = weights[h] @ self.dense_values[:visible, h // group]
        return out


def round16(x: np.ndarray, storage16) -> np.ndarray:
    """16-bit exact storage: fp16 (round to nearest even) or bf16."""
    if storage16 is np.float16:
        return f16(x)
    import ml_dtypes

    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
