"""qjlkv.hf.QJLCache on tiny random models whose attention is not plain softmax (no download):
Gemma 2 (attn_logit_softcapping) and gpt-oss (learned sinks, ``self_attn.sinks``).

The variant must be applied exactly once: by the model's own attention function on the dense
reconstruction, or, with the fused ``"qjlkv"`` attention, by the exact prompt attention and then
by the library (``Cache.set_layer_attention``). The caches below keep every token exact
(``residual_tokens`` above the sequence length), so either path gives the logits of eager
attention on a DynamicCache within float rounding, far closer than the variant's own effect.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import DynamicCache, Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

from qjlkv.hf import QJLCache, use_qjlkv_attention

PROMPT, STEPS, VOCAB = 40, 16, 1024
SOFTCAP = 2.0  # Gemma 2 uses 50; a cap of a few units bites on a small random model
EXACT = dict(preset="exact", residual_tokens=128)  # every token stays in the exact tail


def tiny_gemma2() -> Gemma2ForCausalLM:
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                          attn_logit_softcapping=SOFTCAP, final_logit_softcapping=None, sliding_window=4096,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # larger queries: logits of several units, which the cap bends
            layer.self_attn.q_proj.weight.mul_(8.0)
        model.lm_head.weight.mul_(5.0)
    return model


def tiny_gpt_oss() -> GptOssForCausalLM:
    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                          num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=64, sliding_window=128, attn_implementation="eager")
    model = GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # sinks from negligible to dominant
            layer.self_attn.sinks.copy_(torch.linspace(-1.0, 3.0, 4))
        model.lm_head.weight.mul_(5.0)
    return model


@pytest.fixture(scope="module", params=["gemma2", "gpt_oss"])
def model(request):
    return {"gemma2": tiny_gemma2, "gpt_oss": tiny_gpt_oss}[request.param]()


@pytest.fixture(autouse=True)
def eager_after_each_test(model):
    yield
    model.set_attn_implementation("eager")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def logits_of(model, tokens, cache) -> torch.Tensor:
    """The next-token logits of the prompt's end and of each later token fed one at a time."""
    out = model(tokens[:, :PROMPT], cache=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for t in range(PROMPT, tokens.shape[1]):
        logits.append(model(tokens[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(logits).float()


def plain_attention(model) -> None:
    """The model without its variant: no soft-cap, sinks that take no weight."""
    for layer in model.model.layers:
        attention = layer.self_attn
        if hasattr(attention, "attn_logit_softcapping"):
            attention.attn_logit_softcapping = None
        if hasattr(attention, "sinks"):
            attention.sinks.data.fill_(-1e4)


@pytest.mark.parametrize("attention", ["eager", "qjlkv"])
def test_the_variant_is_applied_exactly_once(model, tokens, attention):
    want = logits_of(model, tokens, DynamicCache(config=model.config))
    if attention == "qjlkv":
        use_qjlkv_attention(model)
    cache = QJLCache(model.config, **EXACT)
    got = logits_of(model, tokens, cache)
    error = (got - want).abs().max().item()
    assert error < 1e-3 * want.abs().max().item(), error

    # The variant matters far more than that: without it the logits move by much more.
    plain = tiny_gemma2() if hasattr(model.model.layers[0].self_attn, "attn_logit_softcapping") else tiny_gpt_oss()
    plain_attention(plain)
    effect = (logits_of(plain, tokens, DynamicCache(config=plain.config)) - want).abs().max().item()
    assert effect > 100 * error, (effect, error)


def test_gemma2_soft_cap_is_set_on_every_layer_of_the_library_cache(tokens):
    """From the model config, when the library cache is created: with the dense reconstruction
    too (where the model's own attention applies it and the library's attend is not used)."""
    model = tiny_gemma2()
    cache = QJLCache(model.config, **EXACT)
    with torch.no_grad():
        model(tokens[:, :PROMPT], cache=cache, use_cache=True)
    lib, seq = cache.library_cache, cache.rows[0]
    query = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 4
    for layer in range(2):
        window = cache.windows[layer]  # the sliding layers' window stays (it is set before any token)
        capped = lib.attend(layer, seq, query)
        lib.set_layer_attention(layer, logit_softcap=SOFTCAP, window_tokens=window)  # what it holds: no change
        np.testing.assert_array_equal(lib.attend(layer, seq, query), capped)
        lib.set_layer_attention(layer, window_tokens=window)
        assert not np.array_equal(lib.attend(layer, seq, query), capped)


def test_gpt_oss_sinks_reach_the_library_cache_once(tokens):
    """The fused attention hands each layer's sinks (the module's parameter) to the library when
    the layer first attends, and not again while they stay the same."""
    model = use_qjlkv_attention(tiny_gpt_oss())
    cache = QJLCache(model.config, **EXACT)
    calls = []
    with torch.no_grad():
        model(tokens[:, :PROMPT], cache=cache, use_cache=True)
        lib = cache.library_cache
        original = lib.set_layer_attention
        lib.set_layer_attention = lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs)
        model(tokens[:, PROMPT:PROMPT + 1], cache=cache, use_cache=True)
    assert calls == []  # set during the prompt, kept for the decoding steps
    sinks = model.model.layers[0].self_attn.sinks.detach().numpy()
    seq, query = cache.rows[0], np.ones((4, 64), np.float32)
    with_sinks = lib.attend(0, seq, query)
    original(0, 0.0, sinks, cache.windows[0])  # what it already holds: no change
    np.testing.assert_array_equal(lib.attend(0, seq, query), with_sinks)
