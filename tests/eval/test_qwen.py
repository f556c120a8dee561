"""The numpy forward of Qwen2.5-Coder-1.5B-Instruct (qwen2 architecture: q/k/v biases, NEOX
RoPE, Qwen2 pre-tokenizer) against Hugging Face transformers reading the same GGUF file.

transformers runs first, in a subprocess (tests/eval/hf_reference.py), so that its ~7 GB
are freed before the numpy weights (~6 GB) load; the numpy model lives for this module only.
"""

import numpy as np
import pytest
from conftest import transformers_reference

from tools.eval.caches import ExactCache
from tools.eval.evaluate import DEFAULT_TEXT, CacheConfig, evaluate, load_text_tokens
from tools.eval.passkey import answer_key, make_prompts, run_prompt
from tools.eval.tokenizer import pre_tokenize_qwen2

SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
PROMPT = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
          "What is the capital of France? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n")
# The numpy and torch float32 forwards sum in different orders: measured 6.4e-5 apart on
# logits up to 25.7 (2.5e-6 of their scale); the bound leaves a 40x margin.
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return transformers_reference("qwen2.5-1.5b", PROMPT, tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def qwen(reference):
    from tools.eval.model import load_model

    return load_model("qwen2.5-1.5b")


def test_shape_and_architecture_from_metadata(qwen):
    s = qwen.shape
    assert (s.num_layers, s.dim, s.num_q_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == \
        (28, 1536, 12, 2, 128, 151936)
    assert (s.architecture, s.rope_type, s.rope_base) == ("qwen2", "neox", 1e6)
    layer = qwen.layers[0]
    assert layer.b_qkv.shape == ((12 + 2 * 2) * 128,)
    # the key bias of layer 0 is huge (|b| > 300): constant key components
    assert np.abs(layer.b_qkv[1536:1536 + 256]).max() > 300
    # output.weight is stored (Q6_K), not tied to the Q4_K embedding
    assert not np.array_equal(qwen.output[:, :10], qwen.embedding[np.arange(10)].T)


def test_token_ids_equal_transformers(qwen, reference):
    assert qwen.tokenizer.encode(PROMPT, allow_special=True) == reference["ids"].tolist()


def test_logits_match_transformers(qwen, reference):
    ids = reference["ids"].tolist()
    logits, _ = qwen.forward(ids)
    expected = reference["logits"]
    scale = np.abs(expected).max()
    assert scale > 10  # real logits
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGIT_TOLERANCE * scale)
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_qwen2_pre_tokenizer_splits_digits_one_by_one():
    assert pre_tokenize_qwen2("Pass key 12345.\n\nIt's 3 ok") == \
        ["Pass", " key", " ", "1", "2", "3", "4", "5", ".\n\n", "It", "'s", " ", "3", " ok"]


def test_greedy_answer_through_the_exact_cache(qwen):
    tok = qwen.tokenizer
    ids = tok.encode(PROMPT, allow_special=True)
    s = qwen.shape
    cache = ExactCache(s.num_layers, s.num_q_heads, s.num_kv_heads, s.head_dim)
    logits = qwen.prefill(ids, [cache])
    out = []
    for pos in range(len(ids), len(ids) + 10):
        out.append(int(np.argmax(logits)))
        if out[-1] == tok.eos_id:
            break
        logits = qwen.decode_step([out[-1]], pos, [cache])[0]
    assert tok.decode(out) == "The capital of France is Paris.<|im_end|>"


def test_end_to_end_short_run(qwen):
    """The accuracy run and the pass-key task on Qwen, very short: fp16 storage is nearly
    lossless, q4_0 is not, and the model finds a key in a 256-token haystack."""
    configs = [CacheConfig("exact preset", "exact", {"dtype": "float16"}),
               CacheConfig("q4_0, Hadamard", "q4_0", {"rotate": True}, anchor=True)]
    tokens = load_text_tokens(qwen, DEFAULT_TEXT, 40 + 4 + 1)
    ref_ppl, results = evaluate(qwen, tokens, 40, configs, progress=False, bits_length=8192)
    exact, rotated = results
    assert 1 < ref_ppl < 100
    assert exact.mean_kl < 1e-4 and exact.top1_agreement == 1.0
    assert rotated.mean_kl > exact.mean_kl
    assert 16 <= exact.bits_at_length < 16.01 and rotated.bits_at_length == 4.5

    head, prompts = make_prompts(qwen, 256, [0.5])
    _, head_kv = qwen.forward(head, all_logits=False)
    answers, _ = run_prompt(qwen, head_kv, prompts[0], configs[:1])
    assert [answer_key(a) for a in answers] == [prompts[0].key] * 2
