"""Candidates for the 3-bit and 4-bit tiers (the q3 and q4 presets), prototyped as numpy caches.

A ResearchCache keeps the library's block/tail protocol (SPEC §6: whenever the tail holds
≥ R + B tokens its oldest B are quantized) and replaces each quantized block in place by
its reconstruction, so attention over the stored arrays is exactly the attention a kernel
would compute from the codes. A rotated format stores x·Rᵀ quantized; its reconstruction
is rotated back (x̂ = x̂_rot·R), which equals rotating the query (keys) or the output
(values: out = Rᵀ·Σ p·v̂_rot) once per query.

Per layer, keys and values each have a Codec:
  exact     fp16 copy;
  channel   per-channel asymmetric b-bit codes over the block's B tokens (KIVI keys),
            fp16 scale and minimum per channel, DESIGN.md's directed rounding;
  token     per-token codes in groups of g channels, optionally after a randomized
            Hadamard rotation; either uniform asymmetric min/max (fp16 scale and min per
            group) or a Lloyd-Max codebook for N(0, 1) applied to x·√g/‖x‖ with the
            group's fp16 norm, rescaled after decoding so that ‖x̂‖ = ‖x‖ ("norm correction").
Around the blocks: the first `sinks` tokens of the sequence stay exact (attention sinks),
`outlier_tokens` tokens per block and kv head stay exact (the rest of the block is quantized
without them; a uint8 index each), the tail of ≥ R newest tokens is exact. Exact means fp16:
with `fp16_io` every appended K/V is rounded to fp16 first, as an fp16 engine would hand it
over. Bits are counted from the format (codes, scales, minima, norms, indices, exact
tokens), for the run's length and analytically for any length (bits_at).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from .caches import ExactCache, shape_windows
from .models import MODELS
from .prototype import dequantized, fp16

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "format-candidates")
CONTEXT_8K = 8192


# ---- codebooks and rotations ----------------------------------------------------------
def _normal_cdf(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(np.asarray(x, np.float64) / math.sqrt(2.0)))


def _normal_pdf(x: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * np.asarray(x, np.float64) ** 2) / math.sqrt(2.0 * math.pi)


def lloyd_max_gaussian(bits: int, iterations: int = 2000) -> np.ndarray:
    """The 2^bits reconstruction levels minimizing E(x - x̂)² for x ~ N(0, 1), ascending:
    Lloyd's iteration (cells split at midpoints, each level the conditional mean of its cell)."""
    return lloyd_max_levels(2 ** bits, iterations)


def lloyd_max_levels(n: int, iterations: int = 2000) -> np.ndarray:
    """lloyd_max_gaussian for any number n >= 2 of levels (3: the ternary code)."""
    levels = np.linspace(-2.0, 2.0, n) * (1.0 if n > 2 else 0.5)
    for _ in range(iterations):
        edges = np.concatenate([[-np.inf], (levels[1:] + levels[:-1]) / 2, [np.inf]])
        mass = _normal_cdf(edges[1:]) - _normal_cdf(edges[:-1])
        updated = (_normal_pdf(edges[:-1]) - _normal_pdf(edges[1:])) / mass
        if np.allclose(updated, levels, rtol=0, atol=1e-13):
            break
        levels = updated
    return levels


_CODEBOOKS: dict[int, np.ndarray] = {}


def codebook(bits: int, levels: int = 0) -> np.ndarray:
    n = levels or 2 ** bits
    if n not in _CODEBOOKS:
        _CODEBOOKS[n] = lloyd_max_levels(n)
    return _CODEBOOKS[n]


def allocate_bits(ranges: np.ndarray, average: float, low: int, high: int,
                  midrise: bool, power: float = 1.0) -> np.ndarray:
    """Integer bits per channel [..., d] from the channels' ranges [..., d]: round(average·d)
    bits in all, each between low and high, given greedily where a bit removes the most
    squared error (range² × the error factor f(b): midrise levels f(b) = 4^-b, min/max
    endpoint levels f(b) = (2^b − 1)^-2). f is convex, so the greedy choice is the largest
    round(average·d) − low·d of the gains r²·(f(b) − f(b + 1)), low ≤ b < high, taken at once;
    ties go to the lower channel index, then the lower b. power ≠ 1 weighs a channel's
    error by range^(2·power) instead (power > 1 favours the widest channels further)."""
    d = ranges.shape[-1]
    b = np.arange(low, high)
    f = (lambda k: 4.0 ** -k) if midrise else (lambda k: 1.0 / (2.0 ** k - 1) ** 2)
    gains = ranges[..., :, None] ** (2 * power) * (f(b) - f(b + 1))            # [..., d, high - low]
    flat = gains.reshape(*ranges.shape[:-1], -1)
    extra = int(round(average * d)) - low * d
    order = np.argsort(-flat, axis=-1, kind="stable")[..., :extra]
    chosen = np.zeros(flat.shape, bool)
    np.put_along_axis(chosen, order, True, axis=-1)
    return low + chosen.reshape(gains.shape).sum(-1)


def channel_codes(x: np.ndarray, bits, midrise: bool) -> np.ndarray:
    """x [B, H, d] quantized per channel over the block's B tokens with `bits` (an int, or
    per (head, channel) [H, d]), reconstructed. Endpoint levels (KIVI, DESIGN.md's
    rounding): fp16 minimum rounded down, fp16 scale = range/(2^b − 1) rounded up, codes
    round((x − min)/scale). Midrise levels: fp16 minimum down and maximum up, scale =
    range/2^b, codes floor((x − min)/scale) clamped, value min + (code + ½)·scale; 0 bits: the
    midpoint."""
    from .prototype import fp16_toward
    bits = np.broadcast_to(np.asarray(bits), x.shape[1:]).astype(np.float64)
    lo = fp16_toward(x.min(0), -np.inf)
    if midrise:
        hi = fp16_toward(x.max(0), np.inf)
        scale = (hi - lo) / 2.0 ** bits
        codes = np.clip(np.floor((x - lo) / np.where(scale > 0, scale, 1)), 0, 2.0 ** bits - 1)
        return lo + (codes + 0.5) * scale
    scale = fp16_toward((x.max(0) - lo) / np.maximum(2.0 ** bits - 1, 1), np.inf)
    codes = np.clip(np.rint((x - lo) / np.where(scale > 0, scale, 1)), 0, 2.0 ** bits - 1)
    return codes * scale + lo


def hadamard(d: int) -> np.ndarray:
    """Sylvester's Hadamard matrix of order d (a power of two), entries ±1."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two")
    h = np.ones((1, 1))
    while len(h) < d:
        h = np.block([[h, h], [h, -h]])
    return h


def randomized_hadamard(d: int, rng: np.random.Generator) -> np.ndarray:
    """R = H·diag(s)/√d with random signs s: orthogonal, spreads any vector's energy over
    all d coordinates (x_rot = x·Rᵀ, x = x_rot·R)."""
    return hadamard(d) * rng.choice([-1.0, 1.0], size=d)[None, :] / math.sqrt(d)


# ---- one stored format ----------------------------------------------------------------
@dataclass(frozen=True)
class Codec:
    kind: str                # "exact", "channel" or "token"
    bits: int = 16
    group: int = 0           # token: channels per group (0: the whole head)
    rotate: bool = False     # token: randomized Hadamard rotation first
    lloyd: bool = False      # token: Lloyd-Max Gaussian levels + fp16 group norm
    norm_correct: bool = True  # lloyd: rescale the decoded group to the stored norm
    levels: int = 0          # token lloyd: levels (0: 2^bits; 3: ternary, 5 codes a byte)
    midrise: bool = False    # channel/mixed: levels at cell centres, not min/max endpoints
    average: float = 0.0     # mixed: bits per channel on average (per block and head)
    low: int = 0             # mixed: fewest and most bits of one channel
    high: int = 4
    power: float = 1.0       # mixed: allocation weight range^(2·power)

    def __post_init__(self):
        if self.kind not in ("exact", "channel", "token", "mixed"):
            raise ValueError(f"unknown codec kind {self.kind!r}")

    def label(self) -> str:
        if self.kind == "exact":
            return "fp16"
        if self.kind == "channel":
            return f"ch{self.bits}" + ("m" if self.midrise else "")
        if self.kind == "mixed":
            return (f"mix{self.average:g}[{self.low}-{self.high}]" + ("m" if self.midrise else "")
                    + (f"^{self.power:g}" if self.power != 1 else ""))
        if self.levels == 3:
            return ("rot-" if self.rotate else "") + "lm-ternary"
        g = f"g{self.group}" if self.group else "gd"
        return (("rot-" if self.rotate else "") + ("lm" if self.lloyd else "u")
                + f"{self.bits}{'' if self.lloyd and not self.group else g}"
                + ("" if self.norm_correct or not self.lloyd else "-nocorr"))

    def block_bytes(self, tokens: int, d: int) -> float:
        """Bytes of one block of `tokens` tokens of one kv head."""
        if self.kind == "exact":
            return tokens * d * 2
        if self.kind == "mixed":   # codes, fp16 min + scale and the bit width per channel
            width = math.ceil(math.log2(self.high - self.low + 1))
            return tokens * round(self.average * d) / 8 + d * 4 + d * width / 8
        if self.levels == 3:       # 5 trits a byte
            codes = tokens * math.ceil(d / 5)
        else:
            codes = tokens * d * self.bits / 8
        if self.kind == "channel":
            return codes + d * 4                            # fp16 scale + min per channel
        groups = d // (self.group or d)
        return codes + tokens * groups * (2 if self.lloyd else 4)  # norm | scale + min

    def apply(self, x: np.ndarray, rotation: np.ndarray | None) -> np.ndarray:
        """x [B, H, d] float64 -> its reconstruction."""
        if self.kind == "exact":
            return fp16(x)
        if self.kind == "channel":
            if self.midrise:
                return channel_codes(x, self.bits, True)
            return dequantized(x, self.bits, axis=0)
        if self.kind == "mixed":
            from .prototype import fp16_toward
            ranges = fp16_toward(x.max(0), np.inf) - fp16_toward(x.min(0), -np.inf)   # [H, d]
            bits = allocate_bits(ranges, self.average, self.low, self.high, self.midrise,
                                 self.power)
            return channel_codes(x, bits, self.midrise)
        B, H, d = x.shape
        if self.rotate:
            x = x @ rotation.T
        g = self.group or d
        xg = x.reshape(B, H, d // g, g)
        if self.lloyd:
            norm = fp16(np.linalg.norm(xg, axis=-1, keepdims=True))
            safe = np.where(norm > 0, norm, 1.0)
            levels = codebook(self.bits, self.levels)
            unit = xg * (math.sqrt(g) / safe)
            edges = (levels[1:] + levels[:-1]) / 2
            y = levels[np.searchsorted(edges, unit)]
            if self.norm_correct:
                y_norm = np.linalg.norm(y, axis=-1, keepdims=True)
                y = y * (norm / np.where(y_norm > 0, y_norm, 1.0))
            else:
                y = y * (norm / math.sqrt(g))
        else:
            y = dequantized(xg, self.bits, axis=-1)
        y = y.reshape(B, H, d)
        return y @ rotation if self.rotate else y


EXACT = Codec("exact")


def channel(bits: int) -> Codec:
    return Codec("channel", bits)


def token(bits: int, group: int = 0, rotate: bool = False, lloyd: bool = False,
          norm_correct: bool = True) -> Codec:
    return Codec("token", bits, group, rotate, lloyd, norm_correct)


# ---- a whole candidate ----------------------------------------------------------------
@dataclass(frozen=True)
class Format:
    key: Codec
    value: Codec
    block: int = 128
    residual: int = 32
    sinks: int = 0
    outlier_tokens: int = 0          # per block and kv head, kept exact
    outlier_rule: str = "range"      # "range": largest per-channel z-score; "small": OTT's
    center_keys: bool = False        # subtract a per-(layer, kv head) fp16 mean key, fixed
                                     # from the first block (q·μ is added back exactly)
    boundary_layers: tuple[int, int] = (0, 0)   # first, last layers using the boundary codecs
    boundary_key: Codec | None = None
    boundary_value: Codec | None = None
    value_residual: int = -1         # >= 0: values (per-token codecs) leave the exact tail
                                     # once this many newer tokens follow, not with the keys'
                                     # block (keys and values then have separate boundaries)
    key_layers: tuple[int, ...] | None = None   # only these layers' keys coded, the others
                                                # exact: which layers carry a key format's loss

    def codecs(self, layer: int, num_layers: int) -> tuple[Codec, Codec]:
        first, last = self.boundary_layers
        if layer < first or layer >= num_layers - last:
            return self.boundary_key or self.key, self.boundary_value or self.value
        if self.key_layers is not None and layer not in self.key_layers:
            return EXACT, self.value
        return self.key, self.value

    def label(self) -> str:
        parts = [f"K {self.key.label()}", f"V {self.value.label()}", f"B{self.block}",
                 f"R{self.residual}"]
        if self.sinks:
            parts.append(f"S{self.sinks}")
        if self.outlier_tokens:
            parts.append(f"O{self.outlier_tokens}{'' if self.outlier_rule == 'range' else 's'}")
        if self.center_keys:
            parts.append("centered")
        if self.key_layers is not None:
            parts.append("K layers " + ",".join(map(str, self.key_layers)))
        if any(self.boundary_layers):
            k, v = self.codecs(0 if self.boundary_layers[0] else 10 ** 9, 10 ** 9 + 1)
            parts.append(f"edge {self.boundary_layers[0]}+{self.boundary_layers[1]}: "
                         f"K {k.label()} V {v.label()}")
        return " ".join(parts)

    def layer_bytes(self, layer: int, shape, tokens: int) -> float:
        """Bytes stored for one layer of a sequence of `tokens` tokens (all kv heads)."""
        key, value = self.codecs(layer, shape.num_layers)
        d = shape.head_dim
        exact = min(self.sinks, tokens)
        rest = tokens - exact
        blocks = (rest - self.residual) // self.block if rest >= self.residual + self.block else 0
        exact += rest - blocks * self.block
        per_block = (key.block_bytes(self.block - self.outlier_tokens, d)
                     + value.block_bytes(self.block - self.outlier_tokens, d)
                     + self.outlier_tokens * (2 * d * 2 + 1))
        mean = d * 2 if self.center_keys and blocks else 0
        if self.value_residual >= 0:   # keys by blocks; values token by token
            coded = max(0, rest - self.value_residual)
            keys = exact * d * 2 + blocks * key.block_bytes(self.block, d)
            values = (tokens - coded) * d * 2 + coded * value.block_bytes(1, d)
            return shape.num_kv_heads * (keys + values + mean)
        return shape.num_kv_heads * (exact * 2 * d * 2 + blocks * per_block + mean)

    def bits_at(self, shape, tokens: int) -> float:
        used = sum(self.layer_bytes(layer, shape, tokens) for layer in range(shape.num_layers))
        return 8 * used / (tokens * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2)


class ResearchCache(ExactCache):
    """ExactCache whose quantized blocks are replaced in place by their reconstructions."""

    def __init__(self, name: str, shape, fmt: Format, fp16_io: bool = True, seed: int = 0,
                 reserve_tokens: int = 0):
        super().__init__(shape.num_layers, shape.num_q_heads, shape.num_kv_heads, shape.head_dim,
                         windows=shape_windows(shape))
        if reserve_tokens:   # the run's length known: no geometric growth (Qwen's memory)
            for store in (self.keys, self.values):
                for layer in range(shape.num_layers):
                    store[layer] = np.empty((reserve_tokens, shape.num_kv_heads, shape.head_dim),
                                            np.float32)
        self.name, self.shape, self.fmt, self.fp16_io = name, shape, fmt, fp16_io
        rng = np.random.default_rng(seed)
        self.rotations = [randomized_hadamard(shape.head_dim, rng) for _ in range(shape.num_layers)]
        self.quantized = [fmt.sinks] * shape.num_layers   # [sinks, quantized): blocks
        self.values_coded = [fmt.sinks] * shape.num_layers  # value_residual: [sinks, this)
        if fmt.value_residual >= 0 and (fmt.outlier_tokens or fmt.value.kind != "token"):
            raise ValueError("separate value boundaries need per-token value codes, no outlier tokens")
        self.key_means: list[np.ndarray | None] = [None] * shape.num_layers

    def append(self, layer: int, keys: np.ndarray, values: np.ndarray) -> None:
        if self.fp16_io:
            keys, values = keys.astype(np.float16), values.astype(np.float16)
        super().append(layer, keys, values)
        f = self.fmt
        if f.value_residual >= 0:      # values token by token, past their own tail
            start, end = self.values_coded[layer], self.lengths[layer] - f.value_residual
            if end > start:
                _, value_codec = f.codecs(layer, self.shape.num_layers)
                span = slice(start, end)
                self.values[layer][span] = value_codec.apply(
                    self.values[layer][span].astype(np.float64), self.rotations[layer])
                self.values_coded[layer] = end
        while self.lengths[layer] - self.quantized[layer] >= f.residual + f.block:
            start = self.quantized[layer]
            end = start + f.block
            self._quantize_block(layer, slice(start, end))
            self.quantized[layer] = end

    def _quantize_block(self, layer: int, span: slice) -> None:
        f = self.fmt
        key_codec, value_codec = f.codecs(layer, self.shape.num_layers)
        kb = self.keys[layer][span].astype(np.float64)        # [B, H, d]
        vb = self.values[layer][span].astype(np.float64)
        kept = self._outliers(kb) if f.outlier_tokens else None   # [P, H] token indices
        if kept is not None:   # quantize the others with the kept slots set to their mean
            heads = np.arange(kb.shape[1])
            exact_k, exact_v = kb[kept, heads].copy(), vb[kept, heads].copy()
            mask = np.ones(kb.shape[:2], bool)
            mask[kept, heads] = False
            mean = (kb * mask[..., None]).sum(0) / mask.sum(0)[:, None]
            kb[kept, heads] = np.broadcast_to(mean, kb[kept, heads].shape)
        rotation = self.rotations[layer]
        if f.center_keys:
            if self.key_means[layer] is None:
                self.key_means[layer] = fp16(kb.mean(0))
            mean = self.key_means[layer]
            kq = key_codec.apply(kb - mean, rotation) + mean
        else:
            kq = key_codec.apply(kb, rotation)
        vq = vb if f.value_residual >= 0 else value_codec.apply(vb, rotation)
        if kept is not None:
            kq[kept, heads], vq[kept, heads] = exact_k, exact_v
        self.keys[layer][span] = kq
        self.values[layer][span] = vq

    def _outliers(self, kb: np.ndarray) -> np.ndarray:
        """Indices [P, H] of the block tokens kept exact, per kv head."""
        if self.fmt.outlier_rule == "small":           # OTT: smallest key norms
            score = -np.linalg.norm(kb, axis=-1)
        else:                                          # the tokens that stretch channel ranges
            centre = kb.mean(0)
            spread = kb.std(0) + 1e-6
            score = (np.abs(kb - centre) / spread).max(-1)
        return np.argsort(-score, axis=0, kind="stable")[:self.fmt.outlier_tokens]

    def stats(self) -> dict:
        s = self.shape
        used = sum(self.fmt.layer_bytes(i, s, n) for i, n in enumerate(self.lengths))
        numbers = sum(self.lengths) * s.num_kv_heads * s.head_dim * 2
        tails = sum(max(0, n - q) for n, q in zip(self.lengths, self.quantized))
        sinks = sum(min(self.fmt.sinks, n) for n in self.lengths)
        full = (tails + sinks) * s.num_kv_heads * s.head_dim * 2 * 2
        return {"bits_per_number": 8 * used / numbers, "bytes_used": int(used),
                "bytes_fp16_equivalent": numbers * 2, "bytes_full_precision": full}


# ---- the measured candidates ------------------------------------------------------------
@dataclass
class ResearchConfig:
    """What evaluate.evaluate() needs of a configuration."""
    name: str
    fmt: Format | None            # None: the exact cache with fp16 I/O only
    group: str = "research"
    preset: str = "research"
    fields: dict = field(default_factory=dict)
    reserve_tokens: int = 0        # the run's token count, when known
    uses_library = False           # numpy caches (ResearchCache), windows applied

    def make(self, shape, num_threads: int):
        fmt = self.fmt or Format(EXACT, EXACT, residual=10 ** 9)
        return ResearchCache(self.name, shape, fmt, reserve_tokens=self.reserve_tokens)

    def describe(self) -> str:
        return self.fmt.label() if self.fmt else "fp16 K/V, nothing quantized"

    def bits_at(self, shape, tokens: int) -> float:
        return 16.0 if self.fmt is None else self.fmt.bits_at(shape, tokens)


@dataclass
class QjlPrototypeConfig:
    """The QJL prototype (tools/eval/prototype.py) in this harness; its tail is counted at
    16 bits here (fp16 I/O), as the other candidates' are."""
    name: str
    options: dict
    group: str = "qjl prototype"
    reserve_tokens: int = 0

    def make(self, shape, num_threads: int):
        from .prototype import PrototypeQjlCache
        return PrototypeQjlCache(self.name, shape, **self.options)

    def describe(self) -> str:
        return "prototype " + " ".join(f"{k}={v}" for k, v in self.options.items())

    def bits_at(self, shape, tokens: int) -> float:
        cache = self.make(shape, 1)
        block, residual = cache.block, cache.residual
        blocks = (tokens - residual) // block if tokens >= residual + block else 0
        used = shape.num_kv_heads * (blocks * cache._block_bytes_per_head()
                                     + (tokens - blocks * block) * shape.head_dim * 2 * 2)
        return 8 * used / (tokens * shape.num_kv_heads * shape.head_dim * 2)


@dataclass
class LibraryConfig:
    """A library cache (qjlkv, CPU, fp16 I/O) from a preset and field overrides: the
    candidates that are parameter changes of formats the library already stores, measured
    through the library itself rather than a numpy copy."""
    name: str
    preset: str
    fields: dict = field(default_factory=dict)
    group: str = "library"

    def make(self, shape, num_threads: int):
        from .caches import QjlkvCache
        return QjlkvCache(self.name, self.preset, shape, num_threads=num_threads,
                          dtype="float16", **self.fields)

    def describe(self) -> str:
        return " ".join([self.preset] + [f"{k}={v}" for k, v in self.fields.items()])

    def bits_at(self, shape, tokens: int) -> float:
        """The library's own count for a fresh cache holding `tokens` tokens (random K/V:
        every stored size depends on the token count only)."""
        cache = self.make(shape, 1)
        rng = np.random.default_rng(0)
        kv_shape = (tokens, shape.num_kv_heads, shape.head_dim)
        for layer in range(shape.num_layers):
            cache.append(layer, rng.standard_normal(kv_shape, np.float32),
                         rng.standard_normal(kv_shape, np.float32))
        return float(cache.stats()["bits_per_number"])


def lm(bits: int, group: int = 0) -> Codec:
    """Rotated Lloyd-Max values with a norm per group (the TurboQuant-style "mse" codes)."""
    return token(bits, group, rotate=True, lloyd=True)


def mixed(average: float, low: int = 0, high: int = 4, midrise: bool = True,
          power: float = 1.0) -> Codec:
    """Keys per channel over the block with bits per channel chosen from the block's ranges
    (allocate_bits)."""
    return Codec("mixed", 0, average=average, low=low, high=high, midrise=midrise, power=power)


def ternary(group: int = 0) -> Codec:
    """Rotated Lloyd-Max values with 3 levels (log2 3 bits, 5 codes a byte) and a norm."""
    return Codec("token", 2, group, rotate=True, lloyd=True, levels=3)


def candidate_sets() -> dict[str, list[ResearchConfig]]:
    C = ResearchConfig
    sets = {}
    # Screening: what each ingredient buys, one at a time around two base points.
    sets["screen"] = [
        C("fp16 I/O only", None, "reference"),
        # keys alone (values fp16), then values alone (keys fp16)
        *[C(f"K ch{b} B{B}, V fp16", Format(channel(b), EXACT, block=B), "keys only")
          for b in (2, 3, 4) for B in (64, 128)],
        *[C(f"K fp16, V {c.label()}", Format(EXACT, c), "values only")
          for c in (token(2, 32), token(2, 64), token(2, 64, rotate=True), lm(2), token(3, 64),
                    token(3, 64, rotate=True), lm(3), lm(4), token(4, 64, rotate=True))],
        # sinks / outlier tokens around 2- and 3-bit channel keys (fp16 values)
        C("K ch3 B128 S4, V fp16", Format(channel(3), EXACT, sinks=4), "keys only"),
        C("K ch2 B128 S4, V fp16", Format(channel(2), EXACT, sinks=4), "keys only"),
        C("K ch2 B128 O2, V fp16", Format(channel(2), EXACT, outlier_tokens=2), "keys only"),
        C("K ch3 B128 O2, V fp16", Format(channel(3), EXACT, outlier_tokens=2), "keys only"),
        C("K ch2 B128 O2s, V fp16", Format(channel(2), EXACT, outlier_tokens=2,
                                           outlier_rule="small"), "keys only"),
        C("K rot-lm3, V fp16", Format(lm(3), EXACT), "keys only"),
        # first whole candidates
        C("T3a K ch3 B128, V lm2", Format(channel(3), lm(2)), "tier 3"),
        C("T3b K ch3 B64 R16, V lm2", Format(channel(3), lm(2), block=64, residual=16), "tier 3"),
        C("T4a K ch4 B128, V lm3", Format(channel(4), lm(3)), "tier 4"),
        C("T4b K ch4 B64 R16, V lm3", Format(channel(4), lm(3), block=64, residual=16), "tier 4"),
    ]
    # Whole candidates for the two tiers (≤ 3.0 and ≤ 4.0 bits at 8k, fp16 I/O).
    sets["tiers"] = [
        C("T3a K ch3 B128, V lm2", Format(channel(3), lm(2)), "tier 3"),
        C("T3c K ch3 B128 S4, V lm2", Format(channel(3), lm(2), sinks=4), "tier 3"),
        C("T3e K ch3 B64 R16 S4, V lm2", Format(channel(3), lm(2), block=64, residual=16, sinks=4),
          "tier 3"),
        C("T3i K centered rot-lm3 B128 S4, V lm2",
          Format(lm(3), lm(2), sinks=4, center_keys=True), "tier 3"),
        C("T4a K ch4 B128, V lm3", Format(channel(4), lm(3)), "tier 4"),
        C("T4c K ch4 B128 S4, V lm3", Format(channel(4), lm(3), sinks=4), "tier 4"),
        C("T4e K ch4 B64 R16 S4, V lm3", Format(channel(4), lm(3), block=64, residual=16, sinks=4),
          "tier 4"),
        C("T4i K centered rot-lm4 B128 S4, V lm3",
          Format(lm(4), lm(3), sinks=4, center_keys=True), "tier 4"),
        C("T4j K ch4 B128 S4, V lm3, edges K8 V4",
          Format(channel(4), lm(3), sinks=4, boundary_layers=(1, 1), boundary_key=channel(8),
                 boundary_value=lm(4)), "tier 4 (over budget)"),
    ]
    # Ablations of the recommended formats: what each detail of the value codes and the
    # sinks is worth (does the implementation need it?).
    sets["ablate"] = [
        *[C(f"K fp16, V {c.label()}", Format(EXACT, c), "values only")
          for c in (token(2, 0, rotate=True, lloyd=True, norm_correct=False),
                    token(2, 0, rotate=False, lloyd=True), lm(2, 32), token(2, 32, rotate=True),
                    token(3, 0, rotate=True, lloyd=True, norm_correct=False))],
        *[C(f"T3c with S{n}", Format(channel(3), lm(2), sinks=n), "tier 3 sinks")
          for n in (1, 2, 8)],
        C("T3c with R16", Format(channel(3), lm(2), sinks=4, residual=16), "tier 3"),
        C("T3c with R64", Format(channel(3), lm(2), sinks=4, residual=64), "tier 3 (over budget)"),
    ]
    # QJL with its outlier channels as per-channel 4-bit codes, centered or not, on Qwen,
    # where plain QJL collapses.
    sets["qjl"] = [QjlPrototypeConfig(f"QJL m={m}, 8 outlier channels 4-bit{', centered' if c else ''}",
                                      {"m": m, "m_out": 0, "channels": 8, "outlier_bits": 4,
                                       "center": c})
                   for m, c in ((128, False), (128, True), (256, True))]
    # Qwen (≈ 7 GB for the model alone): the tier candidates that matter, a few at a time.
    by_name = {c.name: c for c in sets["tiers"]}
    sets["qwen"] = [by_name[n] for n in ("T3a K ch3 B128, V lm2", "T3c K ch3 B128 S4, V lm2",
                                         "T3e K ch3 B64 R16 S4, V lm2", "T4c K ch4 B128 S4, V lm3",
                                         "T4e K ch4 B64 R16 S4, V lm3",
                                         "T3i K centered rot-lm3 B128 S4, V lm2")]
    # The 3-bit tier's pass-key misses on SmolLM2: parameter changes of the
    # library's `q3` format, through the library. Seeds 1 and 2 draw other value rotations
    # (the format is unchanged): whether a miss is the format's or one draw's. The rows are
    # spelled out from the first `q3` (blocks of 128, tail 32, 4 sinks) so that they keep
    # their meaning now that the preset is the row "q3 B64 R16 S16".
    L = LibraryConfig
    first = {"block_tokens": 128, "residual_tokens": 32, "sink_tokens": 4}
    sets["q3-params"] = [
        L("first q3", "q3", first, "the first q3"),
        L("q3 seed 1", "q3", {**first, "seed": 1}, "q3, other value rotations"),
        L("q3 seed 2", "q3", {**first, "seed": 2}, "q3, other value rotations"),
        L("q3 B64 R16", "q3", {**first, "block_tokens": 64, "residual_tokens": 16}, "q3 blocks"),
        L("q3 R64", "q3", {**first, "residual_tokens": 64}, "q3 tail"),
        L("q3 S16", "q3", {**first, "sink_tokens": 16}, "q3 sinks"),
        L("q3 B64 R16 S16", "q3", {"block_tokens": 64, "residual_tokens": 16, "sink_tokens": 16},
          "q3 blocks (the q3 preset since)"),
        L("q3 with OTT keys", "q3", {**first, "key_method": "ott"}, "q3 + OTT tracing"),
        L("q3 with OTT keys B64 R16", "q3", {**first, "key_method": "ott", "block_tokens": 64,
                                            "residual_tokens": 16}, "q3 + OTT tracing"),
        L("q4 preset", "q4", group="q4 as shipped"),
    ]
    # The 2-bit tier (≤ 2.5 bits at 8k, d = 128, fp16 I/O): keys are what 2 bits break
    # (K ch2: KL 0.27-0.38 on SmolLM2 with fp16 values), so the candidates spend the bits on
    # the key channels with the widest ranges (mixed), move levels to cell centres (midrise),
    # or take bits from the values (ternary codes) to give them to the keys.
    sets["q2"] = [
        C("Q2a K ch2, V lm2", Format(channel(2), lm(2), sinks=16), "2-bit tier"),
        C("Q2b K ch2 midrise, V lm2", Format(Codec("channel", 2, midrise=True), lm(2), sinks=16),
          "2-bit tier"),
        C("Q2c K mix2.15, V lm2", Format(mixed(2.15), lm(2), sinks=16), "2-bit tier"),
        C("Q2d K mix2.5, V ternary", Format(mixed(2.5), ternary(), sinks=16), "2-bit tier"),
        C("Q2e K mix2.5 endpoints, V ternary", Format(mixed(2.5, 1, 4, midrise=False), ternary(),
                                                      sinks=16), "2-bit tier"),
        C("Q2f K mix2.5 up to 8, V ternary", Format(mixed(2.5, 0, 8), ternary(), sinks=16),
          "2-bit tier"),
        C("Q2g K mix3, V lm1", Format(mixed(3.0), lm(1), sinks=16), "2-bit tier"),
        C("Q2h K centered rot-lm2, V lm2", Format(lm(2), lm(2), sinks=16, center_keys=True),
          "2-bit tier"),
        C("Q2i K mix2.75, V ternary", Format(mixed(2.75), ternary(), sinks=16),
          "2-bit tier (over budget)"),
        C("Q2j K ch3, V lm2", Format(channel(3), lm(2), sinks=16), "2-bit tier (over budget)"),
        # second round, around the first round's best (Q2c: midrise levels, bits per channel
        # from the block's ranges)
        C("Q2k K mix2.3, V lm2, V tail 16", Format(mixed(2.3), lm(2), sinks=16, value_residual=16),
          "2-bit tier, separate value tail"),
        C("Q2l K mix2.15^1.5, V lm2", Format(mixed(2.15, power=1.5), lm(2), sinks=16),
          "2-bit tier"),
        C("Q2m K mix2.15 up to 8, V lm2", Format(mixed(2.15, 0, 8), lm(2), sinks=16), "2-bit tier"),
        C("Q2n K mix2, V lm2", Format(mixed(2.0), lm(2), sinks=16), "2-bit tier"),
        C("Q2o K mix2.15 S4, V lm2", Format(mixed(2.15), lm(2), sinks=4), "2-bit tier"),
        C("Q2p K mix2.7, V ternary, V tail 16",
          Format(mixed(2.7), ternary(), sinks=16, value_residual=16), "2-bit tier, separate value tail"),
        # byte-aligned token rows (round(average·d) a multiple of 8 at d = 64 and 128): the
        # formats a kernel would store
        C("Q2q K mix2.125, V lm2", Format(mixed(2.125), lm(2), sinks=16), "2-bit tier"),
        C("Q2r K mix2.25, V lm2, V tail 16", Format(mixed(2.25), lm(2), sinks=16, value_residual=16),
          "2-bit tier, separate value tail"),
    ]
    # Where q2's keys lose on Gemma 3 270M (normed keys, d = 256, one kv head): keys only
    # (16-bit values), by layer kind (its global layers are 5, 11 and 17) and by the width
    # rule's floor (0-bit channels or not), next to q3's key codes.
    gemma_global = (5, 11, 17)
    gemma_local = tuple(l for l in range(18) if l not in gemma_global)
    sets["gemma-keys"] = [
        C("Gk1 K mix2.125 (q2's keys)", Format(mixed(2.125), EXACT, sinks=16), "q2 keys"),
        C("Gk2 K mix2.125 at least 1 bit", Format(mixed(2.125, 1, 4), EXACT, sinks=16), "q2 keys"),
        C("Gk3 K mix2.125 global layers only",
          Format(mixed(2.125), EXACT, sinks=16, key_layers=gemma_global), "q2 keys by layer"),
        C("Gk4 K mix2.125 local layers only",
          Format(mixed(2.125), EXACT, sinks=16, key_layers=gemma_local), "q2 keys by layer"),
        C("Gk5 K ch3 B64 (q3's keys)", Format(channel(3), EXACT, block=64, residual=16, sinks=16),
          "q3 keys"),
        # second round: other key codes near q2's key bits
        C("Gk6 K centered rot-lm2", Format(lm(2), EXACT, sinks=16, center_keys=True), "other keys"),
        C("Gk7 K rot-lm2", Format(lm(2), EXACT, sinks=16), "other keys"),
        C("Gk8 K mix2.5", Format(mixed(2.5), EXACT, sinks=16), "more key bits"),
        C("Gk9 K mix2.125 B64", Format(mixed(2.125), EXACT, block=64, residual=16, sinks=16),
          "smaller blocks"),
        C("Gk10 K ch2 midrise", Format(Codec("channel", 2, midrise=True), EXACT, sinks=16),
          "what the widths buy"),
    ]
    return sets


# ---- running ------------------------------------------------------------------------------
def run(set_name: str, prefix: int, decode: int, only: str | None, model_name: str,
        out_dir: str) -> list[dict]:
    from .evaluate import DEFAULT_TEXT, evaluate, load_text_tokens
    from .model import load_model

    started = time.time()
    configs = candidate_sets()[set_name]
    if only:
        configs = [c for c in configs if any(o in c.name for o in only.split(","))]
    configs = [replace(c, reserve_tokens=prefix + decode + 1) if isinstance(c, ResearchConfig)
               else c for c in configs]
    model, model_label = load_model(model_name), MODELS[model_name].title
    tokens = load_text_tokens(model, DEFAULT_TEXT, prefix + decode + 1)
    reference_ppl, results = evaluate(model, tokens, prefix, configs)
    seconds = time.time() - started
    rows = []
    for config, r in zip(configs, results):
        rows.append({"name": r.name, "format": r.description, "group": r.group,
                     "bits_at_8k": config.bits_at(model.shape, CONTEXT_8K),
                     "bits_at_run": r.bits_per_number, "mean_kl": r.mean_kl, "p99_kl": r.p99_kl,
                     "top1": r.top1_agreement, "perplexity": r.perplexity})
    meta = {"model": model_label, "set": set_name, "only": only, "prefix": prefix,
            "steps": decode, "seconds": seconds, "reference_perplexity": reference_ppl,
            "command": "python3 -m tools.eval.research " + " ".join(sys.argv[1:])}
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{model_name}-{set_name}-{prefix}+{decode}"
                        + (f"-{''.join(ch for ch in only if ch.isalnum() or ch == ',').replace(',', '_')}"
                           if only else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(markdown(meta, rows))
    return rows


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = [f"{meta['model']}, GPL-3.0 text, {meta['prefix']} prefilled + {meta['steps']} "
             f"teacher-forced tokens, exact perplexity {meta['reference_perplexity']:.3f}; "
             f"`{meta['command']}`, {meta['seconds']:.0f} s.", "",
             "| candidate | format | bits at 8k (fp16 I/O) | bits at run | mean KL | p99 KL | top-1 | perplexity |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | `{r['format']}` | {r['bits_at_8k']:.3f} | {r['bits_at_run']:.3f} "
                     f"| {r['mean_kl']:.4f} | {r['p99_kl']:.3f} | {100 * r['top1']:.1f} % "
                     f"| {r['perplexity']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.research", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="screen", choices=sorted(candidate_sets()))
    p.add_argument("--model", default="smollm2-135m", choices=list(MODELS))
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--decode", type=int, default=512)
    p.add_argument("--only", help="comma-separated substrings of the candidate names to run")
    p.add_argument("--out", default=RESULTS_DIR)
    p.add_argument("--bits", nargs=4, type=int, metavar=("LAYERS", "KV_HEADS", "HEAD_DIM", "TOKENS"),
                   help="only print each candidate's bits for this shape and length")
    p.add_argument("--passkey", type=int, nargs="+", metavar="LENGTH",
                   help="pass-key retrieval (tools/eval/passkey.py) at these haystack lengths instead")
    p.add_argument("--depths", type=int, default=4, help="pass-key needle depths (default 4)")
    a = p.parse_args(argv)
    if a.passkey:
        from . import passkey
        configs = candidate_sets()[a.set]
        if a.only:
            configs = [c for c in configs if any(o in c.name for o in a.only.split(","))]
        out_dir = os.path.join(a.out, f"passkey-{a.model}-{a.set}")
        result = passkey.run(a.model, a.passkey, a.depths, configs, out_dir=out_dir)
        result["meta"]["command"] = "python3 -m tools.eval.research " + " ".join(sys.argv[1:])
        paths = passkey.write(result, out_dir)
        with open(paths["table"]) as f:
            sys.stdout.write(f.read())
        return 0
    if a.bits:
        from types import SimpleNamespace
        shape = SimpleNamespace(num_layers=a.bits[0], num_q_heads=a.bits[1], num_kv_heads=a.bits[1],
                                head_dim=a.bits[2])
        for c in candidate_sets()[a.set]:
            print(f"{c.bits_at(shape, a.bits[3]):7.3f}  {c.name}")
        return 0
    rows = run(a.set, a.prefix, a.decode, a.only, a.model, a.out)
    for r in rows:
        print(f"{r['bits_at_8k']:6.3f} {r['mean_kl']:.4f} {100 * r['top1']:5.1f} {r['perplexity']:8.3f}  {r['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
