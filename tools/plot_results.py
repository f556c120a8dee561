#!/usr/bin/env python3
"""Draws the documentation's pictures from the stored results (one command, no arguments):

  docs/quality_per_bit.png   bits per number at 8,192 tokens against mean next-token KL (log
                             scale), one panel per evaluated model: every preset, the llama.cpp
                             cache formats and the 4-bit-key variants, with the Pareto front
                             (the lowest KL reached at that many bits or fewer) drawn as steps.
                             From tools/eval/results/<model>/kl-*/accuracy.json.
  docs/decode_vs_context.png ms per decode step of one layer against context (1k-128k tokens),
                             each preset and the exact cache, one panel per model shape.
                             From bench/results/decode_ms_per_step.csv.

    python3 tools/plot_results.py        # needs matplotlib (in build/eval-venv: tools/eval/install.sh)
"""
import csv
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "tools", "eval", "results")
BENCH = os.path.join(ROOT, "bench", "results", "decode_ms_per_step.csv")
DOCS = os.path.join(ROOT, "docs")

# Per model, the runs whose rows are today's figures, oldest first: a row of a later run
# replaces the row of the same name in an earlier one.
MODELS = [
    ("SmolLM2-135M (d = 64), 2,048 + 512 tokens",
     "smollm2-135m", ["kl-all-formats", "kl-kivi-ott-qjl", "kl-qjl", "kl-q3-q4"]),
    ("Qwen2.5-Coder-1.5B (d = 128), 1,024 + 128 tokens",
     "qwen2.5-1.5b", ["kl-all-formats", "kl-qjl", "kl-q3-q4"]),
]
# Rows drawn, and how: name in the results -> (label, kind).
ROWS = {
    "q3 preset": ("q3 (default)", "preset"),
    "q4 preset": ("q4", "preset"),
    "qjl preset": ("qjl", "preset"),
    "kivi preset": ("kivi", "preset"),
    "ott preset": ("ott", "preset"),
    "exact preset": ("exact (fp16)", "preset"),
    "llama.cpp q8_0": ("q8_0", "llama.cpp"),
    "llama.cpp q4_0": ("q4_0", "llama.cpp"),
    "llama.cpp q4_0, Hadamard": ("q4_0 + Hadamard", "llama.cpp"),
    "kivi k4": ("kivi k4", "variant"),
    "ott k4": ("ott k4", "variant"),
    "kivi k4 v4": ("kivi k4 v4", "variant"),
    "ott k4 v4": ("ott k4 v4", "variant"),
}
# Label offsets (points) where labels of close points would overlap.
OFFSETS = {("smollm2-135m", "kivi preset"): (-4, 7), ("smollm2-135m", "ott preset"): (5, -13),
           ("smollm2-135m", "qjl preset"): (7, -2), ("smollm2-135m", "ott k4"): (6, -6)}
STYLE = {"preset": dict(color="tab:blue", marker="o", s=46, zorder=4),
         "llama.cpp": dict(color="tab:red", marker="s", s=46, zorder=4),
         "variant": dict(color="0.55", marker="^", s=34, zorder=3)}
PRESET_COLORS = {"exact": "black", "q3": "tab:blue", "q4": "tab:cyan", "qjl": "tab:purple",
                 "kivi": "tab:orange", "ott": "tab:green"}
BENCH_MODELS = {"llama3_8b": "Llama-3-8B layer (32 q / 8 kv heads, d = 128)",
                "smollm2_135m": "SmolLM2-135M layer (9 q / 3 kv heads, d = 64)"}


def model_rows(folder: str, runs: list[str]) -> dict[str, dict]:
    rows = {}
    for run in runs:
        with open(os.path.join(RESULTS, folder, run, "accuracy.json")) as f:
            for r in json.load(f)["results"]:
                if r["name"] in ROWS:
                    rows[r["name"]] = r
    return rows


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The lowest KL reached with at most x bits, as the corners of a staircase."""
    front, best = [], float("inf")
    for x, y in sorted(points):
        if y < best:
            front.append((x, y))
            best = y
    return front


def plot_quality(path: str) -> None:
    fig, axes = plt.subplots(1, len(MODELS), figsize=(13, 5.4))
    for ax, (title, folder, runs) in zip(axes, MODELS):
        rows = model_rows(folder, runs)
        points = []
        for name, r in rows.items():
            label, kind = ROWS[name]
            x, y = r["bits_at_length"], r["mean_kl"]
            points.append((x, y))
            ax.scatter([x], [y], **STYLE[kind])
            ax.annotate(label, (x, y), textcoords="offset points",
                        xytext=OFFSETS.get((folder, name), (6, 3)), fontsize=8.5,
                        color=STYLE[kind]["color"] if kind != "variant" else "0.35")
        front = pareto(points)
        xs, ys = [], []
        for i, (x, y) in enumerate(front):
            xs += [x, front[i + 1][0] if i + 1 < len(front) else 17]
            ys += [y, y]
        ax.plot(xs, ys, color="tab:blue", alpha=0.35, lw=2, zorder=1,
                label="Pareto front (lowest KL at ≤ x bits)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([2.5, 3, 4, 5, 8, 16])
        ax.set_xticklabels(["2.5", "3", "4", "5", "8", "16"])
        ax.set_xlim(2.5, 18)
        ax.set_yscale("log")
        ax.set_xlabel("bits per number at 8,192 tokens (fp16 I/O)")
        ax.set_ylabel("mean next-token KL vs exact (nats, log)")
        ax.set_title(title, fontsize=10.5)
        ax.grid(True, which="both", alpha=0.25)
    handles = [plt.Line2D([], [], linestyle="", **{k: v for k, v in STYLE[kind].items()
                                                   if k in ("color", "marker")}, label=text)
               for kind, text in (("preset", "libqjlkv presets"), ("llama.cpp", "llama.cpp cache formats"),
                                  ("variant", "kivi / ott with 4-bit keys (and values)"))]
    handles.append(plt.Line2D([], [], color="tab:blue", alpha=0.35, lw=2,
                              label="Pareto front (lowest KL at ≤ x bits)"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle("Quality per bit: lower and further left is better", fontsize=12)
    fig.tight_layout(rect=(0, 0.06, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_decode(path: str) -> None:
    data: dict[str, dict[str, list[tuple[int, float, str]]]] = {}
    with open(BENCH) as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            data.setdefault(row["model"], {}).setdefault(row["preset"], []).append(
                (int(row["context"]), float(row["ms"]), row["note"]))
    fig, axes = plt.subplots(1, len(BENCH_MODELS), figsize=(13, 5.2))
    for ax, (model, title) in zip(axes, BENCH_MODELS.items()):
        for preset, color in PRESET_COLORS.items():
            pts = sorted(data[model][preset])
            ax.plot([c for c, _, _ in pts], [ms for _, ms, _ in pts], color=color, marker="o",
                    lw=2.2 if preset in ("exact", "q3") else 1.4, label=preset, markersize=4)
            for c, ms, note in pts:
                if note:
                    ax.scatter([c], [ms], s=90, facecolors="none", edgecolors=color, zorder=5)
                    ax.annotate(note, (c, ms), textcoords="offset points", xytext=(-60, 6),
                                fontsize=8, color=color)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({c for pts in data[model].values() for c, _, _ in pts})
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{c // 1024}k" for c in ticks])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step of one layer (log)")
        ax.set_title(title, fontsize=10.5)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=9)
    fig.suptitle("Decode attention on the CPU, 2 threads (Intel Xeon VM, AVX-512 VNNI)", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    outputs = [(plot_quality, os.path.join(DOCS, "quality_per_bit.png")),
               (plot_decode, os.path.join(DOCS, "decode_vs_context.png"))]
    for draw, path in outputs:
        draw(path)
        print(f"wrote {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
