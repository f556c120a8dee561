"""What the library's cache holds for Gemma 3 270M's shape with and without its windows.

python3 -m tools.eval.windowbytes [--presets exact q2 q3 q4] [--tokens 2560 8192 32768]

Gemma 3 270M: 18 layers, 4 query heads sharing one KV head of d = 256; 15 local layers
attend to their newest 512 positions (every 6th layer is global). For each preset, two
libqjlkv caches (CPU, fp16 I/O, one sequence) take the same random keys and values:
`no windows` (every layer plain) and `windows` (each local layer's window set through
Cache.set_layer_attention(layer, window_tokens=512) before any token). Tokens are appended
in chunks; at each count a decoding query attends on every layer (an engine's decode step),
and qjlkv's stats()["bytes_used"] is read. Where the library frees the blocks a window has
left behind, the windowed cache stays bounded in its 15 local layers; otherwise both hold
the same bytes. The fp16 row is the arithmetic of caches.window_bytes (2 bytes a number;
every position, or each local layer's newest 512).

The weights are not needed (the shape is Gemma 3 270M's GGUF metadata, written out below);
the bytes of these formats do not depend on the values.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

from .caches import window_bytes

GEMMA3_270M = SimpleNamespace(num_layers=18, num_q_heads=4, num_kv_heads=1, head_dim=256,
                              windows=tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18)))
DEFAULT_PRESETS = ("exact", "q2", "q3", "q4")
DEFAULT_TOKENS = (2560, 8192, 32768)
CHUNK = 512


def measure(preset: str, tokens: list[int], windows: bool, shape=GEMMA3_270M, seed: int = 0) -> dict:
    """bytes_used of one library cache of `preset` at each count of `tokens` (ascending)."""
    import qjlkv

    config = qjlkv.Config(preset, num_layers=shape.num_layers, num_q_heads=shape.num_q_heads,
                          num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim, dtype="float16")
    cache = qjlkv.Cache(config)
    if windows:
        for layer, window in enumerate(shape.windows):
            if window is not None:
                cache.set_layer_attention(layer, window_tokens=window)
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((1, shape.num_q_heads, shape.head_dim)).astype(np.float16)
    held, appended = {}, 0
    for target in sorted(tokens):
        while appended < target:
            n = min(CHUNK, target - appended)
            k = rng.standard_normal((n, shape.num_kv_heads, shape.head_dim)).astype(np.float16)
            v = rng.standard_normal((n, shape.num_kv_heads, shape.head_dim)).astype(np.float16)
            for layer in range(shape.num_layers):
                cache.append(layer, 0, k, v)
            appended += n
        for layer in range(shape.num_layers):  # a decoding step at this length
            cache.attend(layer, 0, query)
        held[target] = int(cache.stats()["bytes_used"])
    return held


def run(presets, tokens, shape=GEMMA3_270M) -> dict:
    import qjlkv

    started = time.time()
    rows = [{"preset": "fp16 (arithmetic)",
             "no windows": {t: window_bytes(shape, t, 2)["full"] for t in tokens},
             "windows": {t: window_bytes(shape, t, 2)["windowed"] for t in tokens}}]
    for preset in presets:
        rows.append({"preset": preset, "no windows": measure(preset, tokens, False, shape),
                     "windows": measure(preset, tokens, True, shape)})
    return {"meta": {"qjlkv": qjlkv.__version__, "tokens": list(tokens),
                     "seconds": round(time.time() - started, 1)}, "rows": rows}


def markdown(result: dict) -> str:
    tokens = result["meta"]["tokens"]
    mib = lambda b: f"{b / 2**20:.1f}"
    head = "| cache | " + " | ".join(f"{t:,} tokens: no windows / windows (MiB)" for t in tokens) + " |"
    lines = [head, "|---|" + "---:|" * len(tokens)]
    for row in result["rows"]:
        cells = []
        for t in tokens:
            full, windowed = row["no windows"][t], row["windows"][t]
            cells.append(f"{mib(full)} / {mib(windowed)} ({full / windowed:.1f}×)")
        lines.append(f"| {row['preset']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + f"\n\nqjlkv {result['meta']['qjlkv']}; {result['meta']['seconds']} s.\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.windowbytes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    p.add_argument("--out", help="folder for windowbytes.md and .json (default: print only)")
    a = p.parse_args(argv)
    result = run(a.presets, sorted(a.tokens))
    text = markdown(result)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "windowbytes.md"), "w") as f:
            f.write(text)
        with open(os.path.join(a.out, "windowbytes.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
