"""Pass-key retrieval: can the model find a 5-digit number hidden in a long text when its
KV cache is compressed?

A prompt (ChatML, the chat template of both instruct models; Gemma's turns for Gemma 3,
whose base model knows them) asks for the pass key hidden
in a haystack: the GPL v3 text (tools/eval/data) cut to `length` tokens, with the sentence
"The pass key is NNNNN. Remember it. NNNNN is the pass key." inserted at a paragraph
boundary at each depth (5 % ... 95 % of the haystack). The system turn, instruction and
haystack are prefilled exactly (numpy attention) and their K/V appended to every cache;
the question and the start of the answer ("The pass key is") are then decoded through each
cache (teacher-forced, the same tokens for all), and each cache generates the answer
greedily. A cache scores when the first number of its answer equals the key. The exact
cache (float32) is the ceiling: its misses are the model's, not the cache's.

Prefill work is shared: the haystack's K/V is computed once without the needle; the
prompt of a depth reuses the K/V of the text before the needle and prefills the rest.

python3 -m tools.eval.passkey [--model NAME] [--lengths 2048 4096] [--depths 8]

Prototype formats that are not presets are run through the research module's --passkey
option, which calls into this module (never the other way).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import dataclass

import numpy as np

from .caches import ExactCache
from .evaluate import (DEFAULT_TEXT, BITS_LENGTH, CacheConfig, bits_at_length,
                       headline_configurations, runnable_configurations)
from .model import LlamaModel, blas_threads, load_model, single_threaded_blas
from .models import DEFAULT_MODEL, MODELS

# Qwen2.5's default system turn (its chat template adds it when there is none); SmolLM2's
# template adds none.
SYSTEM_TURN = {"qwen2": "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
                        "You are a helpful assistant.<|im_end|>\n"}
# (start of the user turn, end of it and start of the answer turn) by architecture
TURNS = {"gemma3": ("<bos><start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n")}
CHATML_TURNS = ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
INSTRUCTION = ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about the pass key.\n\n")
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_START = "The pass key is"
ANSWER_TOKENS = 6  # greedy tokens after ANSWER_START: a space and 5 digits (split one by one)


def needle(key: int) -> str:
    return f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"


@dataclass
class Prompt:
    length: int           # haystack tokens
    depth: float          # requested depth of the needle
    key: int
    prefix_tokens: int    # shared tokens (system, instruction, haystack before the needle)
    rest: list[int]       # needle and the haystack after it: prefilled after the shared part
    question: list[int]   # end of the user turn, assistant header, ANSWER_START


def haystack_paragraphs(model: LlamaModel, length: int, text_path: str = DEFAULT_TEXT,
                        text: str | None = None) -> list[list[int]]:
    """Token ids of the text's paragraphs ("\\n\\n"-separated, each ending with its
    separator) up to `length` tokens in all; `text` replaces the file's text when given."""
    if text is None:
        with open(text_path, encoding="utf-8") as f:
            text = f.read()
    pieces = [p + "\n\n" for p in text.split("\n\n") if p.strip()]
    paragraphs, total = [], 0
    for piece in pieces:
        ids = model.tokenizer.encode(piece)
        if total + len(ids) > length:
            ids = ids[:length - total]
        paragraphs.append(ids)
        total += len(ids)
        if total >= length:
            return paragraphs
    raise ValueError(f"the haystack text has fewer than {length} tokens")


def make_prompts(model: LlamaModel, length: int, depths: list[float], seed: int = 0,
                 text: str | None = None):
    """(shared head tokens, [Prompt per depth]): the head is system + instruction +
    the whole haystack (the GPL text, or `text`); prompt i shares its first prefix_tokens
    tokens."""
    tok = model.tokenizer
    rng = np.random.default_rng(seed + length)
    system = SYSTEM_TURN.get(model.shape.architecture, "")
    user, answer = TURNS.get(model.shape.architecture, CHATML_TURNS)
    header = tok.encode(system + user + INSTRUCTION, allow_special=True)
    paragraphs = haystack_paragraphs(model, length, text=text)
    starts = np.cumsum([0] + [len(p) for p in paragraphs])  # token offset of each boundary
    head = header + [t for p in paragraphs for t in p]
    question = tok.encode(QUESTION + answer + ANSWER_START, allow_special=True)
    prompts = []
    for depth in depths:
        boundary = int(np.abs(starts - depth * length).argmin())
        key = int(rng.integers(10000, 100000))
        after = [t for p in paragraphs[boundary:] for t in p]
        prompts.append(Prompt(length, depth, key, len(header) + int(starts[boundary]),
                              tok.encode(needle(key)) + after, question))
    return head, prompts


def spread_order(items: list) -> list:
    """First, last, then the midpoints of the gaps, widest first: a run stopped early has
    depths spread over the whole range, not only the shallow ones."""
    n = len(items)
    order = list(range(min(n, 2)))
    if n > 1:
        order[1] = n - 1
    gaps = [(0, n - 1)] if n > 2 else []
    while gaps:
        low, high = gaps.pop(0)
        middle = (low + high) // 2
        order.append(middle)
        gaps += [g for g in ((low, middle), (middle, high)) if g[1] - g[0] > 1]
    return [items[i] for i in order]


def answer_key(text: str) -> int | None:
    found = re.search(r"\d+", text)
    return int(found.group()) if found else None


def run_prompt(model: LlamaModel, head_kv, prompt: Prompt, configs: list[CacheConfig],
               num_threads: int = 1, answer_tokens: int = ANSWER_TOKENS) -> tuple[list[str], list]:
    """The answers of the exact cache and of each config's cache, and the caches."""
    return answer_through(model, prompt_kv(model, head_kv, prompt), prompt.question, configs,
                          num_threads, answer_tokens=answer_tokens)


def prompt_kv(model: LlamaModel, head_kv, prompt: Prompt, threads: int = 1) -> list:
    """Per-layer (keys, values) of the prompt up to its question: the shared head's K/V
    before the needle, then the needle and the haystack after it prefilled exactly, on
    `threads` BLAS threads (on a shared machine one beats two: model.py)."""
    past = [(k[:prompt.prefix_tokens], v[:prompt.prefix_tokens]) for k, v in head_kv]
    with blas_threads(threads):
        _, rest_kv = model.forward(prompt.rest, start_pos=prompt.prefix_tokens, past=past,
                                   all_logits=False)
    return [(np.concatenate([p[0], r[0]]), np.concatenate([p[1], r[1]]))
            for p, r in zip(past, rest_kv)]


def answer_through(model: LlamaModel, kv, question: list[int], configs: list[CacheConfig],
                   num_threads: int = 1, exact: bool = True,
                   answer_tokens: int = ANSWER_TOKENS) -> tuple[list[str], list]:
    """Fresh caches (the exact one first unless exact=False, then one per config) filled
    with the prompt's per-layer K/V `kv`; the question decoded through each (teacher-forced),
    then `answer_tokens` greedy tokens. Returns the decoded answers and the caches."""
    s = model.shape
    caches = [ExactCache.of(s)] if exact else []
    caches += [c.make(s, num_threads) for c in configs]
    position = len(kv[0][0])
    for cache in caches:
        if isinstance(cache, ExactCache):  # no geometric growth past the prompt
            cache.reserve(position + len(question) + answer_tokens)
        for layer in range(s.num_layers):
            cache.append(layer, kv[layer][0], kv[layer][1])
    with single_threaded_blas():
        for index, token in enumerate(question):
            last = index + 1 == len(question)  # the first answer token's logits
            logits = model.decode_step([token] * len(caches), position, caches, logits=last)
            position += 1
        answers = [[] for _ in caches]
        for step in range(answer_tokens):
            next_tokens = logits.argmax(axis=-1)
            for answer, token in zip(answers, next_tokens):
                answer.append(int(token))
            if step + 1 < answer_tokens:  # the last token's own logits are not needed
                logits = model.decode_step(next_tokens, position, caches)
                position += 1
    return [model.tokenizer.decode(a) for a in answers], caches


def run(model_name: str, lengths: list[int], num_depths: int, configs: list[CacheConfig],
        num_threads: int = 1, progress: bool = True, out_dir: str | None = None,
        answer_tokens: int = ANSWER_TOKENS) -> dict:
    """All prompts through all caches; with out_dir, the table so far is rewritten after
    every prompt (a long run stopped early keeps what it measured), and a run started again
    with the same model, depths and rows continues from the prompts recorded there."""
    from tqdm import tqdm

    started = time.time()
    model = load_model(model_name, progress=progress)
    configs = runnable_configurations(model, configs)  # windowed models: what can run them
    depths = [round(float(d), 4) for d in np.linspace(0.05, 0.95, num_depths)]
    names = ["exact (numpy fp32)"] + [c.name for c in configs]
    records, bits, earlier_seconds = resumed(out_dir, MODELS[model_name].title, depths, names, lengths,
                                             answer_tokens)

    def result() -> dict:
        return {"meta": {"model": MODELS[model_name].title, "lengths": lengths, "depths": depths,
                         "bits_length": BITS_LENGTH, "answer_tokens": answer_tokens,
                         "seconds": earlier_seconds + time.time() - started},
                "rows": [{"name": n, "description": "float32 numpy, exact attention" if i == 0
                          else configs[i - 1].describe(),
                          "bits_at_length": 32.0 if i == 0 else bits[n]}
                         for i, n in enumerate(names)],
                "records": records}

    for length in lengths:
        head, prompts = make_prompts(model, length, depths)
        done = {r["depth"] for r in records if r["length"] == length}
        prompts = [p for p in prompts if p.depth not in done]
        if not prompts:
            continue
        with single_threaded_blas():
            _, head_kv = model.forward(head, all_logits=False, progress=progress)
        bits.update({c.name: bits_at_length(c, model.shape, head_kv, BITS_LENGTH)
                     for c in configs if c.name not in bits})
        for prompt in tqdm(spread_order(prompts), desc=f"pass key in {length} tokens",
                           unit="depth", disable=not progress):
            answers, _ = run_prompt(model, head_kv, prompt, configs, num_threads, answer_tokens)
            records.append({"length": length, "depth": prompt.depth, "key": prompt.key,
                            "prompt_tokens": prompt.prefix_tokens + len(prompt.rest) + len(prompt.question),
                            "answers": dict(zip(names, answers)),
                            "correct": {n: answer_key(a) == prompt.key for n, a in zip(names, answers)}})
            if out_dir:
                write(result(), out_dir)
    return result()


def resumed(out_dir: str | None, model_title: str, depths: list[float], names: list[str],
            lengths: list[int], answer_tokens: int = ANSWER_TOKENS) -> tuple[list[dict], dict, float]:
    """(records, bits per row, seconds) of an earlier run in out_dir with the same model,
    depths and answer length whose rows are the first of `names` (its prompts are the same: a key depends on
    the seed and the length only; rows added since have no answers for its prompts);
    nothing when there is none."""
    path = os.path.join(out_dir, "passkey.json") if out_dir else None
    if not path or not os.path.exists(path):
        return [], {}, 0.0
    with open(path) as f:
        earlier = json.load(f)
    if (earlier["meta"]["model"] != model_title or earlier["meta"]["depths"] != depths
            or earlier["meta"].get("answer_tokens", ANSWER_TOKENS) != answer_tokens
            or [row["name"] for row in earlier["rows"]] != names[:len(earlier["rows"])]):
        return [], {}, 0.0
    records = [r for r in earlier["records"] if r["length"] in lengths]
    bits = {row["name"]: row["bits_at_length"] for row in earlier["rows"][1:]}
    return records, bits, float(earlier["meta"]["seconds"])


def markdown(result: dict) -> str:
    meta, records = result["meta"], result["records"]
    lengths = meta["lengths"]
    lines = [f"| configuration | bits/number at {meta['bits_length']:,} tokens | "
             + " | ".join(f"{length:,}-token haystack" for length in lengths) + " | all |",
             "|---|---:|" + "---:|" * (len(lengths) + 1)]
    for row in result["rows"]:
        cells = []
        for subset in [[r for r in records if r["length"] == length] for length in lengths] + [records]:
            answered = [r for r in subset if row["name"] in r["correct"]]  # a row added on resuming
            right = sum(r["correct"][row["name"]] for r in answered)
            cells.append(f"{right}/{len(answered)}" if answered or not subset else "—")
        lines.append(f"| {row['name']} | {row['bits_at_length']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"table": os.path.join(out_dir, "passkey.md"), "json": os.path.join(out_dir, "passkey.json")}
    meta = result["meta"]
    with open(paths["table"], "w") as f:
        f.write(f"Pass-key retrieval, model {meta['model']}: {len(meta['depths'])} depths "
                f"({', '.join(f'{d:.0%}' for d in meta['depths'])}) per haystack length; "
                f"exact matches of the 5-digit key; {meta['seconds']:.0f} s.\n\n")
        f.write(markdown(result))
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.passkey", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS))
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096],
                   help="haystack lengths in tokens (default 2048 4096)")
    p.add_argument("--depths", type=int, default=8, help="needle depths from 5%% to 95%% (default 8)")
    p.add_argument("--only", action="append", default=[],
                   help="run only the configurations whose name contains this (repeatable: "
                        "those that contain any of them)")
    p.add_argument("--without", action="append", default=[],
                   help="leave out the configurations whose name contains this (repeatable)")
    p.add_argument("--quick", action="store_true", help="the 5 quick rows of tools.eval")
    p.add_argument("--out", default="build-eval", help="output folder (default build-eval)")
    p.add_argument("--threads", type=int, default=1, help="qjlkv worker threads per cache")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                   help=f"greedy tokens of each answer (default {ANSWER_TOKENS}: a space and 5 digits "
                        "split one by one; a tokenizer that answers ' a 12345' needs 7)")
    a = p.parse_args(argv)
    configs = headline_configurations(a.quick)
    if a.only:
        configs = [c for c in configs if any(o in c.name for o in a.only)]
    configs = [c for c in configs if not any(w in c.name for w in a.without)]
    paths = write(run(a.model, a.lengths, a.depths, configs, a.threads, out_dir=a.out,
                      answer_tokens=a.answer_tokens), a.out)
    with open(paths["table"]) as f:
        sys.stdout.write(f.read())
    print(f"\nwrote {paths['table']}, {paths['json']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
