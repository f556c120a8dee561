"""Long-context evaluation: next-token KL over the last positions of a long text, pass-key
retrieval at several depths and multi-key retrieval, at 8k-32k tokens, for the library's
presets, llama.cpp's formats and the research candidates (tools/eval/research.py).

python3 -m tools.eval.longctx --model smollm2-135m --length 8192
python3 -m tools.eval.longctx --model qwen2.5-1.5b --length 16384 --tasks kl

Tasks (each item's result is written to the results folder as soon as it is measured, and
a run started again with the same folder skips what is there: stop and resume at will):
  kl        the text (tools/eval/data: the GNU licence texts, one after another, 24k tokens)
            prefilled exactly up to `length - positions`, then `positions` tokens (default
            512) teacher-forced through every cache: KL(exact || cache) of each next-token
            distribution, top-1 agreement, perplexity. One item per row; the rows still
            missing decode together in one batch (the dense layers are shared). The exact
            prefill's K/V is kept in the work folder, so a resumed run does not redo it.
  passkey   tools/eval/passkey.py's prompt with a haystack of the long text filling the
            context (`length` tokens in all), the needle at `depths` depths from 5 % to 95 %;
            one item per depth (the answers of every row). The needle-free haystack's K/V
            is computed once (work folder) and shared by the depths.
  multikey  `trials` haystacks, each with `keys` needles "The pass key of the <colour> door
            is NNNNN ..." at random depths (one per stratum of 5 %-95 %); each question asks
            for one door's key: one item per (trial, question). An answer scores when its
            first number is the asked key; answering another door's key is recorded apart.

Every cache holds one sequence; fp16 I/O for the library and the research rows, float32
for llama.cpp's (their own quantization). Bits per number: at 8,192 tokens (the headline
count) and at the end of the KL run. Wall times: per batch and per item in the items, per
invocation in runs.json. summary.md/.json are rewritten from all items after each task.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
import time
from dataclasses import replace

import numpy as np

from .evaluate import DATA_DIR, BITS_LENGTH, bits_at_length, decode_through, headline_configurations
from .model import LlamaModel, blas_threads, load_model
from .models import MODELS
from .passkey import (CHATML_TURNS, SYSTEM_TURN, TURNS, answer_key, answer_through,
                      haystack_paragraphs, make_prompts, prompt_kv, spread_order)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "long-context")
WORK = os.path.join(ROOT, "build-eval", "long-context-work")
# verbatim GNU licence texts (tools/eval/data/README.md): about 24k tokens together
TEXTS = ("GPL-3.0.txt", "GPL-2.0.txt", "LGPL-2.1.txt", "GFDL-1.3.txt", "LGPL-3.0.txt")
# the library's tiers and the formats users would otherwise pick (tools/eval/evaluate.py)
DEFAULT_ROWS = ("q2 preset", "q3 preset", "q4 preset", "llama.cpp q8_0", "llama.cpp q4_0",
                "llama.cpp q4_0, Hadamard")
EXACT_ROW = "exact (numpy fp32)"
TASKS = ("kl", "passkey", "multikey")
DOORS = ("red", "blue", "green", "yellow", "white", "black", "orange", "purple")
MULTI_INSTRUCTION = ("There are several pass keys hidden inside a lot of irrelevant text, each "
                     "the key of a door of another colour. Find them and memorize them. I will "
                     "quiz you about one of them.\n\n")
QUESTION_RESERVE = 192  # tokens of the prompt that are not haystack (header, needle, question)


def long_text() -> str:
    parts = []
    for name in TEXTS:
        with open(os.path.join(DATA_DIR, name), encoding="utf-8") as f:
            parts.append(f.read().strip())
    return "\n\n".join(parts) + "\n"


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()


def row_configs(names: list[str], research: list[str], total_tokens: int) -> list:
    """The rows by name: headline rows (library presets with fp16 I/O, llama.cpp's formats)
    and research candidates (research.py's `q2` set and the tier sets), the latter with room
    reserved for `total_tokens` tokens."""
    from .research import ResearchConfig, candidate_sets

    headline = {c.name: c for c in headline_configurations()}
    found = []
    for name in names:
        if name not in headline:
            raise SystemExit(f"unknown row {name!r}; headline rows: {sorted(headline)}")
        found.append(headline[name])
    candidates = {}
    for configs in candidate_sets().values():
        for c in configs:
            candidates.setdefault(c.name, c)
    for name in research:
        if name not in candidates:
            raise SystemExit(f"unknown research candidate {name!r}")
        c = candidates[name]
        found.append(replace(c, reserve_tokens=total_tokens) if isinstance(c, ResearchConfig) else c)
    return found


def bits_8k(config, shape, kv) -> float:
    if hasattr(config, "bits_at"):
        return float(config.bits_at(shape, BITS_LENGTH))
    return bits_at_length(config, shape, kv, BITS_LENGTH)


# ---- the results folder -------------------------------------------------------------------
class Store:
    """Items as JSON files under out/<task>/, each written whole (tmp file, then rename)."""

    def __init__(self, out: str):
        self.out = out

    def path(self, task: str, item: str) -> str:
        return os.path.join(self.out, task, item + ".json")

    def get(self, task: str, item: str) -> dict | None:
        path = self.path(task, item)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def put(self, task: str, item: str, data: dict) -> None:
        path = self.path(task, item)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)

    def items(self, task: str) -> list[dict]:
        folder = os.path.join(self.out, task)
        if not os.path.isdir(folder):
            return []
        found = []
        for name in sorted(os.listdir(folder)):
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    found.append(json.load(f))
        return found


def cached_prefill(path: str, model: LlamaModel, tokens: list[int], progress: bool,
                   threads: int = 1):
    """Per-layer (keys, values) float32 of the exact prefill of `tokens` on `threads` BLAS
    threads, kept in `path` (.npz) for resumed runs."""
    if os.path.exists(path):
        with np.load(path) as z:
            keys, values = z["k"], z["v"]  # each z[...] reads the whole array again
        return list(zip(keys, values))
    with blas_threads(threads):
        kv = model.forward(tokens, all_logits=False, progress=progress)[1]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez(path + ".tmp.npz", k=np.stack([k for k, _ in kv]), v=np.stack([v for _, v in kv]))
    os.replace(path + ".tmp.npz", path)
    return kv


# ---- tasks ----------------------------------------------------------------------------------
def run_kl(model: LlamaModel, model_name: str, length: int, positions: int, configs: list,
           store: Store, work: str, progress: bool, threads: int = 1) -> int:
    pending = [c for c in configs if store.get("kl", slug(c.name)) is None]
    if not pending:
        return 0
    tokens = model.tokenizer.encode(long_text())
    if len(tokens) < length + 1:
        raise SystemExit(f"the long text has {len(tokens)} tokens, {length + 1} are needed")
    tokens = tokens[:length + 1]
    prefix = length - positions
    started = time.time()
    kv = cached_prefill(os.path.join(work, f"{model_name}-kl-{prefix}.npz"), model,
                        tokens[:prefix], progress, threads)
    prefill_seconds = time.time() - started
    if store.get("kl", "reference") is None:
        store.put("kl", "reference", {"name": EXACT_ROW, "prefix": prefix, "positions": positions,
                                      "prefill_seconds": prefill_seconds})
    caches = [c.make(model.shape, 1) for c in pending]
    started = time.time()
    _, kl, agree, nll = decode_through(model, tokens, prefix, caches, prompt_kv=kv,
                                       progress=progress)
    seconds = time.time() - started
    reference = store.get("kl", "reference")
    reference.update(perplexity=float(np.exp(nll[:, 0].mean())))
    store.put("kl", "reference", reference)
    for i, (config, cache) in enumerate(zip(pending, caches)):
        st = cache.stats()
        store.put("kl", slug(config.name), {
            "name": config.name, "description": config.describe(), "prefix": prefix,
            "positions": positions, "bits_at_8k": bits_8k(config, model.shape, kv),
            "bits_at_run": float(st["bits_per_number"]), "mean_kl": float(kl[:, i].mean()),
            "p99_kl": float(np.percentile(kl[:, i], 99)), "max_kl": float(kl[:, i].max()),
            "top1": float(agree[:, i].mean()), "perplexity": float(np.exp(nll[:, i + 1].mean())),
            "reference_perplexity": reference["perplexity"],
            "batch_rows": len(pending), "batch_decode_seconds": seconds,
            "kl_per_position": [round(float(x), 7) for x in kl[:, i]]})
    return len(pending)


def needs(item: dict | None, configs: list) -> bool:
    exact, missing = pending_rows(item, configs)
    return exact or bool(missing)


def pending_rows(item: dict | None, configs: list) -> tuple[bool, list]:
    """(exact row missing, configs missing) of a retrieval item."""
    answers = item["answers"] if item else {}
    return EXACT_ROW not in answers, [c for c in configs if c.name not in answers]


def answer(model: LlamaModel, kv, question: list[int], configs: list, item: dict, key: int,
           other_keys, started: float, store: Store, task: str, name: str,
           label: str | None) -> None:
    """The rows of `item` still missing answer `question` after the prompt's K/V `kv`; the
    item is written with their answers (and the time since `started`), and printed under
    `label` when one is given."""
    exact, missing = pending_rows(item, configs)
    answers, _ = answer_through(model, kv, question, missing, exact=exact)
    rows = ([EXACT_ROW] if exact else []) + [c.name for c in missing]
    record(item, rows, answers, key, other_keys, seconds=time.time() - started)
    store.put(task, name, item)
    if label:
        print(f"{label}: key {key}, " + ", ".join(f"{n}: {a!r}" for n, a in zip(rows, answers)),
              flush=True)


def record(item: dict, names: list[str], answers: list[str], key: int, other_keys=(), seconds=0.0):
    for name, answer in zip(names, answers):
        found = answer_key(answer)
        item["answers"][name] = answer
        item["correct"][name] = found == key
        if other_keys:
            item.setdefault("other_key", {})[name] = found in other_keys
    item["seconds"] = item.get("seconds", 0.0) + seconds


def run_passkey(model: LlamaModel, model_name: str, length: int, depths: int, configs: list,
                store: Store, work: str, progress: bool, threads: int = 1) -> int:
    haystack = length - QUESTION_RESERVE
    levels = [round(float(d), 4) for d in np.linspace(0.05, 0.95, depths)]
    todo = [d for d in levels if needs(store.get("passkey", f"depth-{d:.4f}"), configs)]
    if not todo:
        return 0
    head, prompts = make_prompts(model, haystack, levels, text=long_text())
    started = time.time()
    head_kv = cached_prefill(os.path.join(work, f"{model_name}-passkey-{haystack}.npz"), model,
                             head, progress, threads)
    head_seconds = time.time() - started
    done = 0
    for prompt in spread_order([p for p in prompts if p.depth in todo]):
        started = time.time()
        name = f"depth-{prompt.depth:.4f}"
        item = store.get("passkey", name) or {
            "length": haystack, "depth": prompt.depth, "key": prompt.key,
            "prompt_tokens": prompt.prefix_tokens + len(prompt.rest) + len(prompt.question),
            "head_prefill_seconds": head_seconds, "answers": {}, "correct": {}}
        answer(model, prompt_kv(model, head_kv, prompt, threads), prompt.question, configs, item,
               prompt.key, (), started, store, "passkey", name,
               f"pass key depth {prompt.depth:.0%}" if progress else None)
        done += 1
    return done


def multikey_prompt(model: LlamaModel, length: int, keys: int, trial: int):
    """(prompt tokens, [(door, key, depth, question tokens)]) of one multi-key haystack."""
    tok = model.tokenizer
    rng = np.random.default_rng(1000 * trial + length)
    system = SYSTEM_TURN.get(model.shape.architecture, "")
    user, answer = TURNS.get(model.shape.architecture, CHATML_TURNS)
    header = tok.encode(system + user + MULTI_INSTRUCTION, allow_special=True)
    paragraphs = haystack_paragraphs(model, length, text=long_text())
    starts = np.cumsum([0] + [len(p) for p in paragraphs])
    doors = [str(d) for d in rng.permutation(DOORS)[:keys]]
    numbers = [int(x) for x in rng.choice(np.arange(10000, 100000), size=keys, replace=False)]
    strata = np.linspace(0.05, 0.95, keys + 1)
    depths = [float(rng.uniform(strata[i], strata[i + 1])) for i in range(keys)]
    boundaries = [int(np.abs(starts - d * length).argmin()) for d in depths]
    for i in range(1, keys):            # distinct boundaries, in order
        boundaries[i] = max(boundaries[i], boundaries[i - 1] + 1)
    if boundaries[-1] > len(paragraphs):
        raise ValueError(f"{keys} keys do not fit a {length}-token haystack's paragraphs")
    needles = dict(zip(boundaries, zip(doors, numbers)))

    def needle_tokens(door, number):
        return tok.encode(f"\n\nThe pass key of the {door} door is {number}. Remember it. "
                          f"{number} is the pass key of the {door} door.\n\n")

    body = []
    for index, paragraph in enumerate(paragraphs):
        if index in needles:
            body += needle_tokens(*needles[index])
        body += paragraph
    if len(paragraphs) in needles:     # a needle after the last paragraph
        body += needle_tokens(*needles[len(paragraphs)])
    questions = []
    for door, number, boundary in zip(doors, numbers, boundaries):
        question = tok.encode(f"\n\nWhat is the pass key of the {door} door? Answer with the "
                              f"number only.{answer}The pass key of the {door} door is",
                              allow_special=True)
        questions.append((door, number, round(float(starts[boundary]) / length, 4), question))
    return header + body, questions


def run_multikey(model: LlamaModel, model_name: str, length: int, trials: int, keys: int,
                 configs: list, store: Store, work: str, progress: bool, threads: int = 1) -> int:
    haystack = length - QUESTION_RESERVE - keys * 32
    done = 0
    for trial in range(trials):
        names = [f"trial-{trial}-key-{j}" for j in range(keys)]
        if not any(needs(store.get("multikey", n), configs) for n in names):
            continue
        prompt, questions = multikey_prompt(model, haystack, keys, trial)
        started = time.time()
        kv = cached_prefill(os.path.join(work, f"{model_name}-multikey-{haystack}-{keys}-{trial}.npz"),
                            model, prompt, progress, threads)
        prefill_seconds = time.time() - started
        all_keys = [q[1] for q in questions]
        for name, (door, number, depth, question) in zip(names, questions):
            item = store.get("multikey", name) or {
                "length": haystack, "trial": trial, "door": door, "key": number, "depth": depth,
                "keys_in_haystack": all_keys, "prompt_tokens": len(prompt) + len(question),
                "prefill_seconds": prefill_seconds, "answers": {}, "correct": {}}
            if not needs(item, configs):
                continue
            answer(model, kv, question, configs, item, number,
                   [k for k in all_keys if k != number], time.time(), store, "multikey", name,
                   f"multi-key trial {trial}, {door} door ({depth:.0%})" if progress else None)
            done += 1
    return done


# ---- summary --------------------------------------------------------------------------------
def summarize(store: Store, meta: dict) -> str:
    kl_items = {i["name"]: i for i in store.items("kl") if "mean_kl" in i}
    reference = store.get("kl", "reference")
    pk, mk = store.items("passkey"), store.items("multikey")
    runs = []
    if os.path.exists(os.path.join(store.out, "runs.json")):
        with open(os.path.join(store.out, "runs.json")) as f:
            runs = json.load(f)
    names = [EXACT_ROW] + list(dict.fromkeys(
        [n for n in kl_items] + [n for i in pk + mk for n in i["answers"] if n != EXACT_ROW]))

    def score(items, name):
        answered = [i for i in items if name in i["correct"]]
        if not answered:
            return "—"
        return f"{sum(i['correct'][name] for i in answered)}/{len(answered)}"

    def other(items, name):
        return sum(i.get("other_key", {}).get(name, False) for i in items)

    lines = [f"{meta['model']}, {meta['length']:,}-token context; long text = the GNU licence "
             "texts of tools/eval/data one after another.", ""]
    if reference and "perplexity" in reference:
        lines.append(f"KL: {reference['prefix']:,} tokens prefilled exactly, the last "
                     f"{reference['positions']} positions teacher-forced; exact perplexity "
                     f"{reference['perplexity']:.3f}.")
    if pk:
        lines.append(f"Pass-key: {len(pk)} depths, {pk[0]['length']:,}-token haystack "
                     f"({max(i['prompt_tokens'] for i in pk):,} prompt tokens at most).")
    if mk:
        lines.append(f"Multi-key: {len({i['trial'] for i in mk})} haystacks of "
                     f"{mk[0]['length']:,} tokens with {len(mk[0]['keys_in_haystack'])} keys each, "
                     f"one question per key ({len(mk)} questions); '(n)' counts answers that "
                     "gave another door's key.")
    lines += ["", "| configuration | bits at 8,192 tokens | bits at run end | mean KL | p99 KL "
              "| top-1 | perplexity | pass-key | multi-key |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in names:
        r = kl_items.get(name)
        if name == EXACT_ROW:
            cells = ["32", "32", "0", "0", "100 %",
                     f"{reference['perplexity']:.3f}" if reference and "perplexity" in reference else "—"]
        elif r:
            cells = [f"{r['bits_at_8k']:.2f}", f"{r['bits_at_run']:.2f}", f"{r['mean_kl']:.4f}",
                     f"{r['p99_kl']:.3f}", f"{100 * r['top1']:.1f} %", f"{r['perplexity']:.3f}"]
        else:
            cells = ["—"] * 6
        wrong = other(mk, name)
        cells += [score(pk, name), score(mk, name) + (f" ({wrong})" if wrong else "")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if runs:
        lines += ["", "Wall time per task (all invocations, summed; a 2-core machine, alone or "
                  "shared with other work):", ""]
        for task in TASKS:
            spent = [r for r in runs if r["task"] == task]
            if spent:
                lines.append(f"- {task}: {sum(r['seconds'] for r in spent):.0f} s over "
                             f"{len(spent)} invocation(s), {sum(r['items'] for r in spent)} items: "
                             f"`{spent[-1]['command']}`")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(store.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(store.out, "summary.json"), "w") as f:
        json.dump({"meta": meta, "reference": reference, "kl": kl_items,
                   "passkey": {n: score(pk, n) for n in names},
                   "multikey": {n: score(mk, n) for n in names}}, f, indent=1)
    return text


def log_run(out: str, task: str, seconds: float, items: int, command: str) -> None:
    path = os.path.join(out, "runs.json")
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
    runs.append({"task": task, "seconds": round(seconds, 1), "items": items, "command": command,
                 "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    with open(path + ".tmp", "w") as f:
        json.dump(runs, f, indent=1)
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.longctx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=list(MODELS))
    p.add_argument("--length", type=int, default=8192, help="context length in tokens (default 8192)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--positions", type=int, default=512, help="KL positions at the end (default 512)")
    p.add_argument("--depths", type=int, default=8, help="pass-key depths (default 8)")
    p.add_argument("--trials", type=int, default=2, help="multi-key haystacks (default 2)")
    p.add_argument("--keys", type=int, default=4, help="keys per multi-key haystack (default 4)")
    p.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS),
                   help="headline rows by name (default: q3, q4, q8_0, q4_0, rotated q4_0)")
    p.add_argument("--research", nargs="*", default=[],
                   help="research candidates by name (tools/eval/research.py), e.g. its q2 rows")
    p.add_argument("--out", help="results folder (default tools/eval/results/long-context/MODEL-LENGTH)")
    p.add_argument("--work", default=WORK, help="where prefill K/V are kept for resuming")
    p.add_argument("--prefill-threads", type=int, default=1,
                   help="BLAS threads of the exact prefills (default 1: two lose on a busy machine; "
                        "alone, 2 of 2 cores are faster)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    out = a.out or os.path.join(RESULTS, f"{a.model}-{a.length}")
    store = Store(out)
    command = "python3 -m tools.eval.longctx " + shlex.join(sys.argv[1:] if argv is None else argv)
    model = load_model(a.model, progress=not a.quiet)
    configs = row_configs(a.rows, a.research, a.length + 64)
    meta = {"model": MODELS[a.model].title, "length": a.length}
    for task in a.tasks:
        started = time.time()
        if task == "kl":
            items = run_kl(model, a.model, a.length, a.positions, configs, store, a.work, not a.quiet,
                           a.prefill_threads)
        elif task == "passkey":
            items = run_passkey(model, a.model, a.length, a.depths, configs, store, a.work,
                                not a.quiet, a.prefill_threads)
        else:
            items = run_multikey(model, a.model, a.length, a.trials, a.keys, configs, store,
                                 a.work, not a.quiet, a.prefill_threads)
        if items:
            log_run(out, task, time.time() - started, items, command)
        summary = summarize(store, meta)
    sys.stdout.write(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
