"""Accuracy of compressed KV caches on a real model, measured during decoding.

Protocol (SPEC §7-8): the first `prefix` tokens of the text are prefilled exactly (numpy
attention) and their K/V appended to every cache; the remaining `decode` tokens are then
teacher-forced one at a time, every layer appending the new token's K/V to each cache and
attending with its query through that cache. At each step every cache's next-token
distribution is compared with the reference: a plain float32 numpy cache (ExactCache).
All caches run in one batch, so the dense layers are shared and only attention differs.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from .anchors import BlockQuantCache
from .caches import ExactCache, QjlkvCache, library_has_windows, shape_windows
from .model import LlamaModel, load_model, log_softmax, single_threaded_blas
from .models import DEFAULT_MODEL, MODELS
from .prototype import PrototypeQjlCache

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
DEFAULT_TEXT = os.path.join(DATA_DIR, "GPL-3.0.txt")


@dataclass
class CacheConfig:
    name: str
    preset: str
    fields: dict = field(default_factory=dict)
    group: str = "other"  # the plot's series
    prototype: bool = False  # a numpy PrototypeQjlCache (fields = its options), not qjlkv
    anchor: bool = False     # a llama.cpp format (anchors.BlockQuantCache): preset = q8_0/q4_0

    @property
    def uses_library(self) -> bool:
        """Whether qjlkv stores this cache (the numpy caches apply windows themselves)."""
        return not (self.prototype or self.anchor)

    def make(self, shape, num_threads: int):
        if self.prototype:
            return PrototypeQjlCache(self.name, shape, **self.fields)
        if self.anchor:
            return BlockQuantCache(self.name, self.preset, shape, **self.fields)
        return QjlkvCache(self.name, self.preset, shape, num_threads=num_threads, **self.fields)

    def describe(self) -> str:
        return self.preset + ("" if not self.fields else " " + " ".join(
            f"{k}={v}" for k, v in self.fields.items()))


def qjl(m: int, m_out: int, c: int = 8, **extra) -> dict:
    return {"key_sketch_dim": m, "outlier_sketch_dim": m_out, "outlier_channels": c,
            "initial_layers": 0, **extra}


FP16_IO = {"dtype": "float16"}


def headline_configurations(quick: bool = False) -> list[CacheConfig]:
    """The rows users compare: the library's presets and 4-bit-key variants with fp16 model
    I/O (as an fp16 engine runs them), next to llama.cpp's q8_0, q4_0 and Hadamard-rotated
    q4_0 caches. quick: the exact preset, q4_0 and the qjl, kivi and ott presets."""
    def library(name, preset, group, **fields):
        return CacheConfig(name, preset, {**FP16_IO, **fields}, group=group)

    exact = library("exact preset", "exact", "exact storage")
    q4_0 = CacheConfig("llama.cpp q4_0", "q4_0", group="llama.cpp", anchor=True)
    presets = [library(f"{p} preset", p, "presets") for p in ("qjl", "kivi", "ott")]
    if quick:
        return [exact, q4_0, *presets]
    return [exact,
            CacheConfig("llama.cpp f16", "f16", group="llama.cpp", anchor=True),
            CacheConfig("llama.cpp q8_0", "q8_0", group="llama.cpp", anchor=True),
            q4_0,
            CacheConfig("llama.cpp q4_0, Hadamard", "q4_0", {"rotate": True}, group="llama.cpp",
                        anchor=True),
            *presets,
            # blocks of 128 (the preset's 32): measured, not shipped (docs/ACCURACY.md, "Tried and not kept")
            library("qjl B128", "qjl", "qjl variants", block_tokens=128),
            library("q2 preset", "q2", "2-, 3- and 4-bit tiers"),
            library("q3 preset", "q3", "2-, 3- and 4-bit tiers"),
            library("q4 preset", "q4", "2-, 3- and 4-bit tiers"),
            library("kivi k4", "kivi", "4-bit keys", key_bits=4),
            library("ott k4", "ott", "4-bit keys", key_bits=4),
            library("kivi k4 v4", "kivi", "4-bit keys", key_bits=4, value_bits=4),
            library("ott k4 v4", "ott", "4-bit keys", key_bits=4, value_bits=4)]


def configurations(quick: bool = False) -> list[CacheConfig]:
    """The measured set: the presets as shipped; QJL bits-vs-quality curves over the sketch
    size without outliers and with the preset's outlier ratio (m_out = m/4, 8 channels);
    QJL outlier, initial-layer, block, tail and value variants; KIVI/OTT at 2 and 4 bits.
    Rows with 16-bit values or exact keys isolate the key and the value error."""
    presets = [CacheConfig("exact preset", "exact", group="exact storage"),
               CacheConfig("qjl preset", "qjl", group="presets"),
               CacheConfig("kivi preset", "kivi", group="presets"),
               CacheConfig("ott preset", "ott", group="presets")]
    if quick:
        return presets
    return presets + [
        CacheConfig("exact keys, 2-bit values", "exact", {"value_bits": 2}, group="values only"),
        CacheConfig("exact keys, 4-bit values", "exact", {"value_bits": 4}, group="values only"),
        *[CacheConfig(f"qjl m={m} no outliers", "qjl", qjl(m, 0, c=0), group="qjl, no outliers")
          for m in (64, 128, 256, 512)],
        *[CacheConfig(f"qjl m={m} o={m // 4}", "qjl", qjl(m, m // 4), group="qjl, 8 outliers, o=m/4")
          for m in (64, 128, 256, 512)],
        CacheConfig("qjl m=128 o=32 c=2", "qjl", qjl(128, 32, c=2), group="qjl variants"),
        CacheConfig("qjl m=128 o=64 c=4", "qjl", qjl(128, 64, c=4), group="qjl variants"),
        CacheConfig("qjl m=128 o=64 c=4 g=64", "qjl", qjl(128, 64, c=4, value_group_size=64),
                    group="qjl variants"),
        CacheConfig("qjl m=128 o=64 c=2", "qjl", qjl(128, 64, c=2), group="qjl variants"),
        CacheConfig("qjl m=128 o=128 c=4", "qjl", qjl(128, 128, c=4), group="qjl variants"),
        CacheConfig("qjl m=192 o=64 c=4", "qjl", qjl(192, 64, c=4), group="qjl variants"),
        CacheConfig("qjl m=128 o=128", "qjl", qjl(128, 128), group="qjl variants"),
        CacheConfig("qjl m=256 o=256", "qjl", qjl(256, 256), group="qjl variants"),
        CacheConfig("qjl m=256 o=64, layers<4 m=512 o=128", "qjl",
                    qjl(256, 64, initial_layers=4, initial_key_sketch_dim=512,
                        initial_outlier_sketch_dim=128), group="qjl variants"),
        # the reference's Llama-2 setting: half the layers 512/128, the rest 256/256
        CacheConfig("qjl reference setting", "qjl",
                    qjl(256, 256, initial_layers=15, initial_key_sketch_dim=512,
                        initial_outlier_sketch_dim=128), group="qjl variants"),
        CacheConfig("qjl m=128 o=32, B=128", "qjl", qjl(128, 32, block_tokens=128),
                    group="qjl variants"),
        CacheConfig("qjl m=128 o=32, R=128", "qjl", qjl(128, 32, residual_tokens=128),
                    group="qjl variants"),
        CacheConfig("qjl m=128 o=32, 4-bit values", "qjl", qjl(128, 32, value_bits=4),
                    group="qjl variants"),
        CacheConfig("qjl m=256 no outliers, 16-bit values", "qjl", qjl(256, 0, c=0, value_bits=16),
                    group="keys only"),
        CacheConfig("kivi k2, 16-bit values", "kivi", {"key_bits": 2, "value_bits": 16},
                    group="keys only"),
        *[CacheConfig(f"{method} k{kb} v{vb}", method, {"key_bits": kb, "value_bits": vb},
                      group=method)
          for method in ("kivi", "ott") for kb, vb in ((2, 2), (4, 2), (4, 4))],
        # the error of the 2- and 3-bit presets split into their keys' and their values' share
        # (fp16 I/O, as the presets' headline rows)
        CacheConfig("q2 keys, 16-bit values", "q2", {**FP16_IO, "value_bits": 16, "value_method": 0},
                    group="keys vs values"),
        CacheConfig("q3 keys, 16-bit values", "q3", {**FP16_IO, "value_bits": 16, "value_method": 0},
                    group="keys vs values"),
        CacheConfig("exact keys, q2 values", "q2", {**FP16_IO, "key_method": "exact"}, group="keys vs values"),
    ]


def prototype_configurations() -> list[CacheConfig]:
    """QJL remedies measured with the numpy prototype (docs/ACCURACY.md), next to the
    library rows they compare with. The first two prototypes mirror library settings: their
    KL must come out close to the library's (same estimator, another sketch draw)."""
    def proto(name, m, m_out, c, group, **options):
        return CacheConfig(name, "prototype", {"m": m, "m_out": m_out, "channels": c, **options},
                           group=group, prototype=True)

    return [
        CacheConfig("qjl m=128 o=32", "qjl", qjl(128, 32), group="library"),
        CacheConfig("qjl m=128 no outliers", "qjl", qjl(128, 0, c=0), group="library"),
        CacheConfig("kivi k2 v2", "kivi", {"key_bits": 2, "value_bits": 2}, group="library"),
        CacheConfig("ott k2 v2", "ott", {"key_bits": 2, "value_bits": 2}, group="library"),
        CacheConfig("kivi k4 v2", "kivi", {"key_bits": 4, "value_bits": 2}, group="library"),
        proto("proto m=128 o=32", 128, 32, 8, "prototype = library"),
        proto("proto m=128 no outliers", 128, 0, 0, "prototype = library"),
        proto("proto m=128 no outliers, centered", 128, 0, 0, "centered", center=True),
        proto("proto m=256 no outliers, centered", 256, 0, 0, "centered", center=True),
        proto("proto m=64 o=64, centered", 64, 64, 8, "centered", center=True),
        proto("proto m=128 o=32, centered", 128, 32, 8, "centered", center=True),
        proto("proto m=64, 8 outliers 4-bit", 64, 0, 8, "4-bit outliers", outlier_bits=4),
        proto("proto m=128, 8 outliers 4-bit", 128, 0, 8, "4-bit outliers", outlier_bits=4),
        proto("proto m=64, 8 outliers 4-bit, centered", 64, 0, 8, "centered + 4-bit outliers",
              outlier_bits=4, center=True),
        proto("proto m=128, 8 outliers 4-bit, centered", 128, 0, 8, "centered + 4-bit outliers",
              outlier_bits=4, center=True),
        proto("proto m=128, 16 outliers 4-bit, centered", 128, 0, 16, "centered + 4-bit outliers",
              outlier_bits=4, center=True),
    ]


@dataclass
class Result:
    name: str
    description: str
    group: str
    bits_per_number: float
    bytes_used: int
    bytes_fp16_equivalent: int
    mean_kl: float
    p99_kl: float
    max_kl: float
    top1_agreement: float
    perplexity: float
    full_precision_bits: float | None = None  # share of bits_per_number in exact tails/pools
    bits_at_length: float | None = None  # bits per number with the cache filled to length_tokens
    length_tokens: int | None = None

    @property
    def compression(self) -> float:
        return self.bytes_fp16_equivalent / self.bytes_used


def load_text_tokens(model: LlamaModel, path: str, count: int) -> list[int]:
    """The first `count` tokens of the text as the model reads a document: after the BOS
    token where its GGUF asks for one (Gemma 3)."""
    with open(path, encoding="utf-8") as f:
        tokens = model.tokenizer.bos_prefix + model.tokenizer.encode(f.read())
    if len(tokens) < count:
        raise ValueError(f"{path} has {len(tokens)} tokens, {count} are needed")
    return tokens[:count]


BITS_LENGTH = 8192  # the context length of the headline bits column


def bits_at_length(config: CacheConfig, shape, kv, length: int = BITS_LENGTH) -> float:
    """Bits per number of a fresh cache of `config` holding `length` tokens: the model's
    own K/V (kv: per-layer (keys, values) of a prompt) repeated up to that length. Every
    format here stores a size that depends on the token count only, not on the numbers."""
    cache = config.make(shape, 1)
    for layer, (k, v) in enumerate(kv):
        reps = -(-length // len(k))
        cache.append(layer, np.tile(k, (reps, 1, 1))[:length], np.tile(v, (reps, 1, 1))[:length])
    return float(cache.stats()["bits_per_number"])


def decode_through(model: LlamaModel, tokens: list[int], prefix: int, caches: list,
                   prompt_kv=None, progress: bool = True):
    """Exact prefill of tokens[:prefix] (or its given per-layer K/V, prompt_kv), appended to
    the reference cache and to every cache; then teacher-forced decoding of the rest through
    all of them in one batch. Returns (prompt_kv, kl [steps, caches], top-1 agreement
    [steps, caches], nll [steps, 1 + caches]: column 0 is the reference's)."""
    from tqdm import tqdm

    s = model.shape
    reference = ExactCache.of(s)
    everyone = [reference] + caches
    for cache in everyone:
        if isinstance(cache, ExactCache):
            cache.reserve(len(tokens))
    if prompt_kv is None:
        _, prompt_kv = model.forward(tokens[:prefix], all_logits=False, progress=progress)
    for cache in everyone:
        for layer, (k, v) in enumerate(prompt_kv):
            cache.append(layer, k, v)

    steps = len(tokens) - prefix - 1
    kl = np.zeros((steps, len(caches)))
    agree = np.zeros((steps, len(caches)), dtype=bool)
    nll = np.zeros((steps, len(everyone)))
    with single_threaded_blas():
        for step in tqdm(range(steps), desc="teacher-forced decoding", unit="tok",
                         disable=not progress):
            position = prefix + step
            logits = model.decode_step([tokens[position]] * len(everyone), position, everyone)
            logp = log_softmax(logits)
            ref = logp[0]
            kl[step] = (np.exp(ref) * (ref - logp[1:])).sum(axis=-1)
            agree[step] = logp[1:].argmax(axis=-1) == ref.argmax()
            nll[step] = -logp[:, tokens[position + 1]]
    return prompt_kv, kl, agree, nll


def evaluate(model: LlamaModel, tokens: list[int], prefix: int, configs: list[CacheConfig],
             num_threads: int = 1, progress: bool = True, bits_length: int | None = None):
    """Returns (reference perplexity, [Result per config]) over the len(tokens) - prefix - 1
    teacher-forced predictions after the exact prefill of tokens[:prefix]. With
    bits_length, each result also has its bits per number at that many tokens."""
    s = model.shape
    caches = [c.make(s, num_threads) for c in configs]
    prompt_kv, kl, agree, nll = decode_through(model, tokens, prefix, caches, progress=progress)

    results = []
    for i, (config, cache) in enumerate(zip(configs, caches)):
        st = cache.stats()
        results.append(Result(
            name=config.name, description=config.describe(), group=config.group,
            bits_per_number=float(st["bits_per_number"]), bytes_used=int(st["bytes_used"]),
            bytes_fp16_equivalent=int(st["bytes_fp16_equivalent"]),
            mean_kl=float(kl[:, i].mean()), p99_kl=float(np.percentile(kl[:, i], 99)),
            max_kl=float(kl[:, i].max()), top1_agreement=float(agree[:, i].mean()),
            perplexity=float(math.exp(nll[:, i + 1].mean())),
            full_precision_bits=8 * st["bytes_full_precision"] / (st["bytes_fp16_equivalent"] / 2),
            bits_at_length=None if bits_length is None else bits_at_length(config, s, prompt_kv,
                                                                           bits_length),
            length_tokens=bits_length))
    return float(math.exp(nll[:, 0].mean())), results


def markdown_table(reference_ppl: float, results: list[Result], run_tokens: int | None = None) -> str:
    """One row per configuration. Bits per number at the headline length (when measured)
    and at the end of the run (run_tokens, when given), K and V of all layers as stored."""
    lengths = sorted({r.length_tokens for r in results if r.length_tokens})
    at_length = f"bits/number at {lengths[0]:,} tokens | " if len(lengths) == 1 else ""
    at_end = f"at {run_tokens:,} tokens (run end)" if run_tokens else "at run end"
    lines = [f"| configuration | settings | {at_length}bits/number {at_end} | of which exact tail "
             "| vs fp16 | mean KL | p99 KL | top-1 agree | perplexity |",
             "|---|---|" + ("---:|" if at_length else "") + "---:|---:|---:|---:|---:|---:|---:|",
             f"| exact (numpy fp32, the reference) | — | {'32 | ' if at_length else ''}32 | 32 "
             f"| 0.5× | 0 | 0 | 100.0 % | {reference_ppl:.3f} |"]
    for r in results:
        length_cell = ""
        if at_length:
            length_cell = "— | " if r.bits_at_length is None else f"{r.bits_at_length:.2f} | "
        lines.append(f"| {r.name} | `{r.description}` | {length_cell}{r.bits_per_number:.2f} "
                     f"| {'—' if r.full_precision_bits is None else f'{r.full_precision_bits:.2f}'} "
                     f"| {r.compression:.2f}× "
                     f"| {r.mean_kl:.2e} | {r.p99_kl:.2e} | {100 * r.top1_agreement:.1f} % "
                     f"| {r.perplexity:.3f} |")
    return "\n".join(lines) + "\n"


CURVES = ("qjl, ", "kivi", "ott", "4-bit outliers", "centered + ")  # groups drawn as lines


def plot(results: list[Result], path: str, title: str) -> None:
    """Mean KL against bits per number. The 16-bit rows (KL ~1e-7) are left out: they
    would squash the quantized ones; the table has them. Identical settings (a preset and
    its explicit twin) share one point and one label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6.5))
    points: dict[tuple, list[Result]] = {}
    def bits(r: Result) -> float:
        return r.bits_per_number if r.bits_at_length is None else r.bits_at_length

    lengths = {r.length_tokens for r in results}
    for r in results:
        if bits(r) < 12 or r.mean_kl > 1e-4:
            points.setdefault((bits(r), r.mean_kl), []).append(r)
    groups: dict[str, list[tuple]] = {}
    for key, same in points.items():
        groups.setdefault(same[-1].group, []).append(key)
    for group, keys in groups.items():
        keys.sort()
        style = "o-" if group.startswith(CURVES) else "o"
        ax.plot([k[0] for k in keys], [k[1] for k in keys], style, label=group, markersize=5)
        for k in keys:
            ax.annotate(" = ".join(r.name for r in points[k]), k, textcoords="offset points",
                        xytext=(4, 2), fontsize=6.5)
    ax.set_yscale("log")
    ax.set_xlabel("bits per cached number (K and V, all layers, as stored"
                  + (f", at {lengths.pop():,} tokens)" if len(lengths) == 1 and None not in lengths
                     else ", at the end of the run)"))
    ax.set_ylabel("mean KL(exact || cache) of the next-token distribution (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(json_path: str, out_dir: str) -> dict:
    """Table and plot again from a run's accuracy.json (no model run)."""
    with open(json_path) as f:
        data = json.load(f)
    fields = set(Result.__dataclass_fields__)
    results = [Result(**{k: v for k, v in r.items() if k in fields}) for r in data["results"]]
    return write_outputs(out_dir, data["meta"], data["reference_perplexity"], results)


def write_outputs(out_dir: str, meta: dict, reference_ppl: float, results: list[Result]) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"table": os.path.join(out_dir, "accuracy.md"),
             "plot": os.path.join(out_dir, "bits_vs_kl.png"),
             "json": os.path.join(out_dir, "accuracy.json")}
    table = markdown_table(reference_ppl, results, meta.get("prefix", 0) + meta.get("steps", 0) or None)
    with open(paths["table"], "w") as f:
        f.write(f"Model {meta['model']}; text {meta['text']}; {meta['prefix']} tokens exact "
                f"prefill, {meta['steps']} teacher-forced decode steps; {meta['seconds']:.0f} s.\n\n")
        f.write(table)
    with open(paths["json"], "w") as f:
        json.dump({"meta": meta, "reference_perplexity": reference_ppl,
                   "results": [dict(r.__dict__, compression=r.compression) for r in results]},
                  f, indent=1)
    plot(results, paths["plot"],
         f"{meta['model']}: {meta['prefix']} prefilled + {meta['steps']} decoded tokens")
    return paths


def runnable_configurations(model: LlamaModel, configs: list[CacheConfig]) -> list[CacheConfig]:
    """configs less the library's rows on a model with sliding windows when the installed
    qjlkv cannot apply them, each refusal said on stderr (never run with full attention:
    that is another model). Raises when nothing is left."""
    import sys

    library = [c for c in configs if c.uses_library]
    if shape_windows(model.shape) is None or not library:
        return configs
    import qjlkv

    if library_has_windows(qjlkv):
        return configs
    for c in library:
        print(f"refused: {c.name} — the installed qjlkv {qjlkv.__version__} has no sliding-window "
              "attention, which this model's local layers need", file=sys.stderr)
    kept = [c for c in configs if not c.uses_library]
    if not kept:
        raise ValueError("every configuration needs the library's sliding windows, which the "
                         "installed qjlkv lacks: run llama.cpp's formats (q8_0, q4_0) instead")
    return kept


def run(prefix: int, decode: int, quick: bool, out_dir: str, text: str = DEFAULT_TEXT,
        num_threads: int = 1, only: list[str] | None = None, prototypes: bool = False,
        model_name: str = DEFAULT_MODEL, sweep: bool = False):
    """prototypes: the QJL prototype rows; sweep: the 38-configuration sweep (float32 I/O)
    of the recorded SmolLM2 run; otherwise the headline rows (fp16 I/O and llama.cpp's).
    only: keep the configurations whose name contains one of these strings."""
    started = time.time()
    model = load_model(model_name, progress=True)
    tokens = load_text_tokens(model, text, prefix + decode + 1)
    if prototypes:
        configs = prototype_configurations()
    else:
        configs = configurations(quick) if sweep else headline_configurations(quick)
    if only:
        configs = [c for c in configs if any(o in c.name for o in only)]
    configs = runnable_configurations(model, configs)
    reference_ppl, results = evaluate(model, tokens, prefix, configs, num_threads=num_threads,
                                      bits_length=BITS_LENGTH)
    meta = {"model": MODELS[model_name].title,
            "text": os.path.basename(text), "prefix": prefix, "steps": decode,
            "seconds": time.time() - started}
    return reference_ppl, results, write_outputs(out_dir, meta, reference_ppl, results)
