"""python3 -m tools.eval.keystats: why QJL's error is large on this model, per layer.

From an exact forward pass over the first --tokens tokens of the evaluation text, for the
queries of the last 64 positions against all keys (post-RoPE), averaged over query heads:
  spread     std over keys of the attention logits q·k/√d (what softmax responds to);
  scale      ‖q‖·‖k‖/√d, which QJL's error is proportional to: one sketch row gives an
             error of std ≈ √(π/2 − 1)·scale, so m rows give ≈ 0.76·scale/√m;
  qjl err    that predicted error std for the qjl preset's m = 128 (no outliers);
  mean share ‖mean key‖ / mean ‖k‖: the part of every key shared across tokens, which
             shifts all logits alike (softmax ignores it) but counts in ‖k‖;
  top-8      share of the key energy in the 8 largest channels (QJL's outliers).

--kernel-error PRESET instead: per layer, the CPU fast path's arithmetic error on these real keys
and queries next to the method's own (SPEC §9 allows it 5 %): the rms difference of the logits
the library estimates (qjlkv_cache_scores) on the default instruction set (or --isa) and on the
scalar reference kernels, and the rms difference of the latter and the exact q·k.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

from .evaluate import DEFAULT_TEXT, load_text_tokens
from .model import LlamaModel, causal_mask, grouped_attention, load_model
from .models import DEFAULT_MODEL, MODELS


def layer_qkv(model: LlamaModel, tokens: list[int]):
    """Yields each layer's (q, k, v) of an exact forward pass over `tokens` (post-RoPE)."""
    n = len(tokens)
    x = model.embed(np.asarray(tokens))
    positions = np.arange(n)
    for layer in model.layers:
        q, k, v = model._qkv(layer, x, positions)
        yield q, k, v
        # each layer's own mask: Gemma 3's local layers see their window only
        mask = causal_mask(positions, 0, n, layer.window)
        x = model._finish_layer(layer, x, grouped_attention(q, k, v, mask))


def layer_statistics(model: LlamaModel, tokens: list[int], last: int = 64) -> list[dict]:
    s = model.shape
    group = s.num_q_heads // s.num_kv_heads
    rows = []
    for q, k, _ in layer_qkv(model, tokens):
        qs = q[-last:].astype(np.float64)                        # [last, Hq, d]
        ks = k.astype(np.float64)[:, np.arange(s.num_q_heads) // group]  # [n, Hq, d]
        logits = np.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(s.head_dim)
        scale = (np.linalg.norm(qs, axis=-1).mean(0) * np.linalg.norm(ks, axis=-1).mean(0)
                 / math.sqrt(s.head_dim))
        energy = np.sort((k.astype(np.float64) ** 2).sum(0), axis=-1)[:, ::-1]  # [Hkv, d]
        rows.append({
            "spread": float(logits.std(-1).mean()),
            "scale": float(scale.mean()),
            "qjl_err": float(math.sqrt(math.pi / 2 - 1) * scale.mean() / math.sqrt(128)),
            "mean_share": float((np.linalg.norm(k.mean(0), axis=-1)
                                 / np.linalg.norm(k, axis=-1).mean(0)).mean()),
            "top8": float((energy[:, :8].sum(-1) / energy.sum(-1)).mean()),
        })
    return rows


def _estimated_logits(shape, preset: str, isa: str | None, keys: np.ndarray, values: np.ndarray,
                      queries: np.ndarray) -> np.ndarray:
    """[queries, Hq, keys] logits of a one-layer `preset` cache on instruction set `isa`
    (QJLKV_CPU_ISA, read when a cache is created; None: the library's choice)."""
    import qjlkv

    saved = os.environ.pop("QJLKV_CPU_ISA", None)
    if isa is not None:
        os.environ["QJLKV_CPU_ISA"] = isa
    try:
        cache = qjlkv.Cache(qjlkv.Config(preset, num_layers=1, num_q_heads=shape.num_q_heads,
                                         num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim))
    finally:
        os.environ.pop("QJLKV_CPU_ISA", None)
        if saved is not None:
            os.environ["QJLKV_CPU_ISA"] = saved
    try:
        cache.append(0, 0, np.ascontiguousarray(keys, np.float32), np.ascontiguousarray(values, np.float32))
        return np.stack([cache.scores(0, 0, np.ascontiguousarray(q, np.float32)) for q in queries])
    finally:
        cache.close()


def kernel_error(model: LlamaModel, tokens: list[int], preset: str, isa: str | None = None,
                 last: int = 64) -> list[dict]:
    """Per layer, over the last `last` queries against every key: `kernel`, the rms of the `isa`
    path's logits minus the scalar path's; `method`, the rms of the scalar path's minus q·k."""
    s = model.shape
    group = s.num_q_heads // s.num_kv_heads
    rows = []
    for q, k, v in layer_qkv(model, tokens):
        exact = np.einsum("qhd,khd->qhk", q[-last:].astype(np.float64),
                          k.astype(np.float64)[:, np.arange(s.num_q_heads) // group])
        reference = _estimated_logits(s, preset, "scalar", k, v, q[-last:])
        fast = _estimated_logits(s, preset, isa, k, v, q[-last:])
        rows.append({"kernel": float(np.sqrt(np.mean((fast - reference) ** 2))),
                     "method": float(np.sqrt(np.mean((reference - exact) ** 2)))})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.keystats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS),
                   help=f"the model (default {DEFAULT_MODEL})")
    p.add_argument("--tokens", type=int, default=1024, help="text tokens (default 1024)")
    p.add_argument("--kernel-error", metavar="PRESET", help="the fast path's logit error for PRESET instead")
    p.add_argument("--isa", help="with --kernel-error: the instruction set (default: the library's choice)")
    a = p.parse_args(argv)
    model = load_model(a.model)
    if a.kernel_error:
        rows = kernel_error(model, load_text_tokens(model, DEFAULT_TEXT, a.tokens), a.kernel_error, a.isa)
        print(f"| layer | {a.isa or 'default'} − scalar, rms | scalar − q·k, rms | ratio |")
        print("|---:|---:|---:|---:|")
        for i, r in enumerate(rows):
            print(f"| {i} | {r['kernel']:.3e} | {r['method']:.3e} | {r['kernel'] / r['method']:.2e} |")
        kernel = math.sqrt(np.mean([r["kernel"] ** 2 for r in rows]))
        method = math.sqrt(np.mean([r["method"] ** 2 for r in rows]))
        print(f"| all | {kernel:.3e} | {method:.3e} | {kernel / method:.2e} |")
        return 0
    rows = layer_statistics(model, load_text_tokens(model, DEFAULT_TEXT, a.tokens))
    print("| layer | logit spread | ‖q‖‖k‖/√d | QJL m=128 error | mean-key share | top-8 channel energy |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(rows):
        print(f"| {i} | {r['spread']:.2f} | {r['scale']:.1f} | {r['qjl_err']:.2f} "
              f"| {r['mean_share']:.2f} | {r['top8']:.2f} |")
    avg = {key: np.mean([r[key] for r in rows]) for key in rows[0]}
    print(f"| all | {avg['spread']:.2f} | {avg['scale']:.1f} | {avg['qjl_err']:.2f} "
          f"| {avg['mean_share']:.2f} | {avg['top8']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
