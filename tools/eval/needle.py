"""How well a cache stores the pass key itself: for each pass-key prompt (tools/eval/passkey.py),
the reconstruction error of the needle's digit tokens next to that of every other
quantized token, per layer, through the library's own reconstruct().

For each depth: where the needle's digits fall (block and offset in it, after the sinks),
and over the layers the median and the largest ratio of the digits' mean relative error
‖k̂ − k‖/‖k‖ (and ‖v̂ − v‖/‖v‖) to that of all quantized tokens of the layer. A ratio well
above 1 means the needle is stored worse than the text around it.

python3 -m tools.eval.needle [--model NAME] [--length 4096] [--depths 8] [--preset q3] [FIELD=VALUE ...]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from .model import load_model
from .models import DEFAULT_MODEL, MODELS
from .passkey import make_prompts, spread_order
from .research import LibraryConfig


def relative_errors(exact: np.ndarray, stored: np.ndarray) -> np.ndarray:
    """Per token (mean over kv heads) ‖stored − exact‖/‖exact‖; exact, stored [T, Hkv, d]."""
    exact = exact.astype(np.float16).astype(np.float64)  # the fp16 input the cache received
    error = np.linalg.norm(stored - exact, axis=-1) / np.maximum(np.linalg.norm(exact, axis=-1), 1e-30)
    return error.mean(axis=-1)


def needle_report(model, config: LibraryConfig, head_kv, prompt) -> dict:
    s = model.shape
    past = [(k[:prompt.prefix_tokens], v[:prompt.prefix_tokens]) for k, v in head_kv]
    _, rest_kv = model.forward(prompt.rest, start_pos=prompt.prefix_tokens, past=past, all_logits=False)
    needle_ids = model.tokenizer.encode(f"\n\nThe pass key is {prompt.key}. Remember it. "
                                        f"{prompt.key} is the pass key.\n\n")
    digits = [prompt.prefix_tokens + i for i, t in enumerate(needle_ids)
              if model.tokenizer.decode([t]).strip().isdigit()]
    cache = config.make(s, 1)
    fields = cache.cache.config
    sinks, block = fields.sink_tokens, fields.block_tokens
    ratios = {"keys": [], "values": []}
    for layer in range(s.num_layers):
        k = np.concatenate([past[layer][0], rest_kv[layer][0]])
        v = np.concatenate([past[layer][1], rest_kv[layer][1]])
        cache.append(layer, k, v)
        k_hat, v_hat = cache.cache.reconstruct(layer, 0)
        after_sinks = len(k) - sinks  # DESIGN.md: floor((T - R)/B) blocks once T >= R + B
        quantized = sinks + max(0, (after_sinks - fields.residual_tokens) // block) * block
        for name, exact, stored in (("keys", k, k_hat), ("values", v, v_hat)):
            errors = relative_errors(exact, stored)
            body = errors[sinks:quantized]
            ratios[name].append(errors[digits].mean() / body.mean())
    return {"depth": prompt.depth, "key": prompt.key, "digit_positions": digits,
            "blocks": sorted({(p - sinks) // block for p in digits}),
            "offsets": [(p - sinks) % block for p in digits],
            **{f"{name}_ratio_median": float(np.median(r)) for name, r in ratios.items()},
            **{f"{name}_ratio_max": float(np.max(r)) for name, r in ratios.items()},
            **{f"{name}_worst_layer": int(np.argmax(r)) for name, r in ratios.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.needle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS))
    p.add_argument("--length", type=int, default=4096, help="haystack tokens (default 4096)")
    p.add_argument("--depths", type=int, default=8, help="needle depths from 5%% to 95%% (default 8)")
    p.add_argument("--preset", default="q3", help="library preset (default q3)")
    p.add_argument("fields", nargs="*", metavar="FIELD=VALUE", help="config fields to change")
    a = p.parse_args(argv)
    fields = {}
    for item in a.fields:
        name, _, value = item.partition("=")
        fields[name] = int(value) if value.lstrip("-").isdigit() else value
    config = LibraryConfig(" ".join([a.preset, *a.fields]), a.preset, fields)
    model = load_model(a.model)
    depths = [round(float(d), 4) for d in np.linspace(0.05, 0.95, a.depths)]
    head, prompts = make_prompts(model, a.length, depths)
    _, head_kv = model.forward(head, all_logits=False)
    print(f"{MODELS[a.model].title}, {a.length}-token haystack, cache `{config.describe()}`: "
          "needle digits' relative error / all quantized tokens' (per layer: median, max)\n")
    print("| depth | key | blocks | offsets in block | keys: median | keys: max (layer) | values: median | values: max (layer) |")
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    for prompt in sorted(spread_order(prompts), key=lambda q: q.depth):
        r = needle_report(model, config, head_kv, prompt)
        print(f"| {r['depth']:.0%} | {r['key']} | {', '.join(map(str, r['blocks']))} "
              f"| {', '.join(map(str, r['offsets']))} | {r['keys_ratio_median']:.2f} "
              f"| {r['keys_ratio_max']:.2f} ({r['keys_worst_layer']}) | {r['values_ratio_median']:.2f} "
              f"| {r['values_ratio_max']:.2f} ({r['values_worst_layer']}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
