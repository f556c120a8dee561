"""qjlkv.hf.QJLCache on a tiny random Llama (no download): 4 layers, 8 query heads, 2 kv
heads (GQA), head_dim 64, RoPE applied before the cache.

Random weights at initializer_range 0.02 give near-uniform next-token distributions, so
the LM head is scaled by 5: greedy tokens then have clear margins, and a KL divergence
between next-token distributions measures what the cache changes. (Larger random weights
make the model chaotic: there even 2-bit KIVI loses top-1 agreement, so they measure
nothing.) Accuracy is measured during decoding, token by token, with teacher forcing
on the tokens the exact DynamicCache generated.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import qjlkv
from qjlkv.hf import QJLCache, use_qjlkv_attention

PROMPT, STEPS = 1024, 32

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")


def tiny_llama(dtype=torch.float32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)
    return model.to(dtype)


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(autouse=True)
def sdpa_after_each_test(model):
    yield
    model.set_attn_implementation("sdpa")


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(0, 1024, (1, PROMPT), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def teacher_forced_logits(model, prompt, tokens, cache, steps=STEPS):
    """Next-token logits of the prompt's end and of each fed token: (steps, vocab) float32."""
    out = model(prompt, cache=cache, use_cache=True)
    logits = [out.logits[:, -1].float()]
    for t in range(steps - 1):
        out = model(tokens[:, t:t + 1], cache=cache, use_cache=True)
        logits.append(out.logits[:, -1].float())
    return torch.cat(logits)


@pytest.fixture(scope="module")
def reference(model, prompt):
    """Greedy decoding with the exact DynamicCache: its tokens (1, STEPS), the logits that
    chose them (STEPS, vocab) and the dense cache."""
    dense = DynamicCache(config=model.config)
    logits, tokens = [], []
    with torch.no_grad():
        out = model(prompt, cache=dense, use_cache=True)
        for _ in range(STEPS):
            logits.append(out.logits[:, -1].float())
            tokens.append(logits[-1].argmax(-1, keepdim=True))
            if len(tokens) < STEPS:
                out = model(tokens[-1], cache=dense, use_cache=True)
    return torch.cat(tokens, dim=1), torch.cat(logits), dense


def kl_and_top1(reference_logits, logits):
    p, q = torch.log_softmax(reference_logits, -1), torch.log_softmax(logits, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    return kl.mean().item(), kl.max().item(), (reference_logits.argmax(-1) == logits.argmax(-1)).float().mean().item()


def dense_cache_bytes(cache: DynamicCache) -> int:
    return sum(l.keys.numel() * l.keys.element_size() + l.values.numel() * l.values.element_size()
               for l in cache.layers)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "qjlkv"])
def test_exact_preset_generates_the_dynamic_cache_tokens(model, attention):
    model.set_attn_implementation(attention)
    prompt = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=32, do_sample=False, cache=DynamicCache(config=model.config))
        cache = QJLCache(model.config, preset="exact")
        got = model.generate(prompt, max_new_tokens=32, do_sample=False, past_key_values=cache)
    assert got.shape == want.shape == (1, 72)
    assert torch.equal(got, want)
    # Blocks of 32 tokens were stored 16-bit: the library held them, not a dense copy.
    stats = cache.stats()
    assert stats["tokens"] == 4 * 71 and stats["bytes_keys_quantized"] > 0
    assert cache.get_seq_length() == 71


def test_qjl_long_context_accuracy_and_memory(model, prompt, reference, capsys):
    tokens, ref_logits, dense = reference
    use_qjlkv_attention(model)
    cache = QJLCache(model.config, preset="qjl")
    logits = teacher_forced_logits(model, prompt, tokens, cache)
    kl_mean, kl_max, top1 = kl_and_top1(ref_logits, logits)
    stats = cache.stats()
    assert stats == cache.library_cache.stats()  # the HF cache reports the library's own count
    tokens_cached = 4 * (PROMPT + STEPS - 1)
    assert stats["tokens"] == tokens_cached
    assert stats["bytes_fp16_equivalent"] * 2 == dense_cache_bytes(dense)  # fp32 model: twice fp16
    smaller = dense_cache_bytes(dense) / stats["bytes_used"]
    with capsys.disabled():
        print(f"\n[qjlkv.hf] tiny Llama fp32, qjl preset, {PROMPT}+{STEPS} tokens: KL mean {kl_mean:.2e} "
              f"max {kl_max:.2e}, top-1 agreement {top1:.3f}, cache {smaller:.2f}x smaller than the "
              f"DynamicCache ({stats['compression_ratio']:.2f}x vs fp16, {stats['bits_per_number']:.2f} bits/number)")
    assert smaller >= 4
    assert kl_mean < 0.05 and top1 >= 0.9


def test_qjl_memory_in_bfloat16_is_4x_below_the_dense_cache():
    """In a 16-bit model the library's fp16-relative count is the dense cache it replaces."""
    model = tiny_llama(torch.bfloat16)
    prompt = torch.randint(0, 1024, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    dense, cache = DynamicCache(config=model.config), QJLCache(model.config, preset="qjl")
    with torch.no_grad():
        model(prompt, cache=dense, use_cache=True)
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert out.shape == (1, PROMPT + 4)
    stats = cache.stats()
    assert stats["tokens"] == 4 * (PROMPT + 3)
    assert stats["bytes_fp16_equivalent"] == dense_cache_bytes(dense) * (PROMPT + 3) // PROMPT
    assert stats["compression_ratio"] >= 4


def test_fused_attention_and_dense_reconstruction_agree(model, prompt, reference):
    """sdpa on the reconstruction (k-hat, dequantized V) computes what the library's fused
    attention computes."""
    tokens = reference[0]
    fused = teacher_forced_logits(use_qjlkv_attention(model), prompt, tokens, QJLCache(model.config), steps=6)
    model.set_attn_implementation("sdpa")
    dense = teacher_forced_logits(model, prompt, tokens, QJLCache(model.config), steps=6)
    torch.testing.assert_close(dense, fused, rtol=1e-4, atol=1e-3)


def test_key_estimate_matters_and_is_accurate(model, prompt, reference):
    """With exact values, the QJL preset's keys cost little and a tiny sketch costs much more:
    the model really attends to the estimated scores."""
    tokens, ref_logits, _ = reference
    use_qjlkv_attention(model)
    preset_kl = kl_and_top1(ref_logits[:12], teacher_forced_logits(
        model, prompt, tokens, QJLCache(model.config, preset="qjl", value_bits=16), steps=12))[0]
    tiny_kl = kl_and_top1(ref_logits[:12], teacher_forced_logits(
        model, prompt, tokens, QJLCache(model.config, preset="qjl", value_bits=16, key_sketch_dim=8,
                                        outlier_channels=0), steps=12))[0]
    assert preset_kl < 2e-3 and preset_kl * 10 < tiny_kl


@pytest.mark.parametrize("attention", ["sdpa", "qjlkv"])
def test_batch_rows_are_independent_sequences(model, attention):
    model.set_attn_implementation(attention)
    prompts = torch.randint(0, 1024, (2, 70), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        batched = model.generate(prompts, max_new_tokens=8, do_sample=False,
                                 past_key_values=QJLCache(model.config, preset="qjl"))
        for b in range(2):
            single = model.generate(prompts[b:b + 1], max_new_tokens=8, do_sample=False,
                                    past_key_values=QJLCache(model.config, preset="qjl"))
            assert torch.equal(batched[b], single[0])


def test_reset_makes_the_cache_reusable(model):
    use_qjlkv_attention(model)
    prompt = torch.randint(0, 1024, (1, 50), generator=torch.Generator().manual_seed(5))
    cache = QJLCache(model.config, preset="qjl")
    with torch.no_grad():
        first = model.generate(prompt, max_new_tokens=6, do_sample=False, past_key_values=cache)
        cache.reset()
        assert cache.get_seq_length() == 0 and cache.stats()["bytes_used"] == 0
        second = model.generate(prompt, max_new_tokens=6, do_sample=False, past_key_values=cache)
    assert torch.equal(first, second)


def test_qjlkv_attention_without_a_qjl_cache_is_sdpa(model):
    prompt = torch.randint(0, 1024, (1, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want = model(prompt).logits
        got = use_qjlkv_attention(model)(prompt).logits
    torch.testing.assert_close(got, want)


def test_unsupported_uses_raise(model):
    prompt = torch.randint(0, 1024, (2, 20), generator=torch.Generator().manual_seed(7))
    cache = QJLCache(model.config)
    with torch.no_grad():
        use_qjlkv_attention(model)
        padding = torch.ones_like(prompt)
        padding[0, 5:8] = 0  # a hole, not left padding
        with pytest.raises(qjlkv.Unsupported, match="left padding"):
            model.generate(prompt, attention_mask=padding, max_new_tokens=3, do_sample=False, cache=cache)
        for call in (lambda layer: layer.crop(-1), lambda layer: layer.reorder_cache(torch.tensor([0])),
                     lambda layer: layer.batch_repeat_interleave(2),
                     lambda layer: layer.batch_select_indices(torch.tensor([0]))):
            with pytest.raises(qjlkv.Unsupported, match="call QJLCache"):
                call(cache.layers[0])
    with pytest.raises(qjlkv.InvalidArgument, match="preset"):
        QJLCache(model.config, preset="nope")
    with pytest.raises(qjlkv.InvalidArgument, match="config.value_bits is 5"):
        QJLCache(model.config, value_bits=5)


def test_padded_batch_works_with_sdpa_reconstruction(model):
    """Padding is transformers' mask over the dense reconstruction: same tokens as unpadded."""
    prompt = torch.randint(0, 1024, (1, 30), generator=torch.Generator().manual_seed(8))
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), prompt], dim=1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 30, dtype=torch.long)], dim=1)
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=5, do_sample=False,
                              past_key_values=QJLCache(model.config, preset="exact"))[:, 30:]
        got = model.generate(padded, attention_mask=mask, max_new_tokens=5, do_sample=False,
                             past_key_values=QJLCache(model.config, preset="exact"))[:, 34:]
    assert torch.equal(got, want)


def test_library_cache_dtype_and_device_follow_the_model(model):
    cache = QJLCache(model.config, preset="kivi", seed=3)
    assert cache.library_cache is None and cache.get_seq_length() == 0
    with torch.no_grad():
        model(torch.randint(0, 1024, (1, 10)), cache=cache, use_cache=True)
    cfg = cache.library_cache.config
    assert (cfg.dtype, cfg.device, cfg.key_method, cfg.seed) == ("float32", -1, "kivi", 3)
    assert (cfg.num_layers, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 8, 2, 64)
    assert cache.get_seq_length() == 10 and cache.get_mask_sizes(1, 0) == (11, 0)


def test_public_callables_have_docstrings():
    from qjlkv import hf
    from qjlkv.hf import QJLLayer, qjlkv_attention_forward

    for fn in (qjlkv_attention_forward, use_qjlkv_attention):
        assert (fn.__doc__ or "").strip(), fn.__name__
    for cls in (QJLCache, QJLLayer):
        assert (cls.__doc__ or "").strip(), cls.__name__
        for name, member in vars(cls).items():
            if not name.startswith("_") and (callable(member) or isinstance(member, property)):
                assert (getattr(cls, name).__doc__ or "").strip(), f"{cls.__name__}.{name}"
    assert set(hf.__all__) <= set(dir(hf))


def test_default_preset_is_the_library_default(model):
    cache = QJLCache(model.config)
    with torch.no_grad():
        model(torch.randint(0, 1024, (1, 10)), cache=cache, use_cache=True)
    cfg = cache.library_cache.config
    assert (cfg.preset, cfg.key_method, cfg.key_bits, cfg.sink_tokens) == ("q3", "kivi", 3, 16)


@pytest.mark.parametrize("attention", ["sdpa", "qjlkv"])
def test_float16_cache_on_a_float32_model(model, attention):
    """dtype=torch.float16 stores fp16 whatever the model computes in (converted at the boundary)."""
    model.set_attn_implementation(attention)
    prompt = torch.randint(0, 1024, (1, 200), generator=torch.Generator().manual_seed(9))
    half, full = QJLCache(model.config, dtype=torch.float16), QJLCache(model.config)
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=8, do_sample=False, cache=half)
        want = model.generate(prompt, max_new_tokens=8, do_sample=False, cache=full)
    assert half.library_cache.config.dtype == "float16"
    assert half.stats()["bytes_full_precision"] * 2 == full.stats()["bytes_full_precision"]
    assert got.shape == want.shape == (1, 208) and torch.equal(got[:, :201], want[:, :201])


@pytest.mark.parametrize("preset", ["q2", "q3", "qjl"])
def test_left_padded_batch_rows_decode_as_they_do_alone(model, preset):
    """Fused attention: padding is never stored, each row is a sequence of its own length."""
    use_qjlkv_attention(model)
    gen = torch.Generator().manual_seed(10)
    prompts = [torch.randint(1, 1024, (n,), generator=gen) for n in (150, 97, 40)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):], mask[b, width - len(p):] = p, 1
    cache = QJLCache(model.config, preset=preset)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, cache=cache)
        assert cache.pads == [width - len(p) for p in prompts]
        lib = cache.library_cache
        assert [lib.length(0, s) for s in cache.rows] == [len(p) + 11 for p in prompts]  # no padding stored
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=12, do_sample=False, cache=QJLCache(model.config,
                                                                                                preset=preset))
            assert torch.equal(batched[b, width:], alone[0, len(p):]), b


def test_crop_is_an_exact_rollback(model):
    """Draft tokens appended and cropped away leave the bytes of a cache that never saw them."""
    use_qjlkv_attention(model)
    gen = torch.Generator().manual_seed(11)
    prompt, more, draft = (torch.randint(0, 1024, (1, n), generator=gen) for n in (100, 5, 20))
    want, got = QJLCache(model.config), QJLCache(model.config)
    assert got.is_croppable
    with torch.no_grad():
        for cache in (want, got):
            model(prompt, cache=cache, use_cache=True)
            model(more, cache=cache, use_cache=True)
        model(draft, cache=got, use_cache=True)
        assert got.get_seq_length() == 125
        got.crop(-20)
        assert got.get_seq_length() == 105
        assert got.library_cache.export_bytes(got.rows[0]) == want.library_cache.export_bytes(want.rows[0])
        step = torch.randint(0, 1024, (1, 1), generator=gen)
        torch.testing.assert_close(model(step, cache=got).logits, model(step, cache=want).logits, rtol=0, atol=0)
        got.crop(50)  # the older spelling: keep the first 50
        assert got.get_seq_length() == 50


def test_multi_token_steps_attend_as_single_steps(model):
    """Each query sees the cache as it stood when its own token came in, so feeding tokens in
    one forward or one at a time gives the same attention."""
    use_qjlkv_attention(model)
    gen = torch.Generator().manual_seed(12)
    prompt, more = torch.randint(0, 1024, (1, 120), generator=gen), torch.randint(0, 1024, (1, 40), generator=gen)
    together, apart = QJLCache(model.config), QJLCache(model.config)
    with torch.no_grad():
        model(prompt, cache=together, use_cache=True)
        model(prompt, cache=apart, use_cache=True)
        logits = model(more, cache=together, use_cache=True).logits[0]
        singles = torch.cat([model(more[:, t:t + 1], cache=apart, use_cache=True).logits[0] for t in range(40)])
    torch.testing.assert_close(logits, singles, rtol=1e-4, atol=1e-4)


def small_assistant(model, layers=1):
    """A smaller draft model: the first `layers` decoder layers of `model` (same vocabulary)."""
    import copy

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    assistant = LlamaForCausalLM(config).eval()
    assistant.load_state_dict(model.state_dict(), strict=False)
    assistant.set_attn_implementation("sdpa")
    return assistant


@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant"])
def test_assisted_decoding_gives_the_tokens_of_greedy_decoding(model, mode):
    use_qjlkv_attention(model)
    gen = torch.Generator().manual_seed(13)
    piece = torch.randint(0, 1024, (1, 30), generator=gen)
    prompt = torch.cat([piece, torch.randint(0, 1024, (1, 50), generator=gen), piece, piece[:, :10]], dim=1)
    extra = dict(prompt_lookup_num_tokens=10) if mode == "prompt_lookup" else dict(assistant_model=small_assistant(model))
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=40, do_sample=False, cache=QJLCache(model.config))
        cache = QJLCache(model.config)
        got = model.generate(prompt, max_new_tokens=40, do_sample=False, cache=cache, **extra)
    assert torch.equal(got, want)
    assert cache.get_seq_length() == got.shape[1] - 1


@pytest.mark.parametrize("attention", ["qjlkv", "sdpa"])
def test_beam_search_and_sampling_share_the_prompt(model, attention):
    """Four beams or samples of one prompt hold its compressed blocks once (the equal prompt
    rows are forked, and so is each kept beam): each copies only its exact rows (16 sinks and
    a tail of 16 to 79 tokens), so at 4,000 tokens they take little more than one sequence."""
    model.set_attn_implementation(attention)
    prompt = torch.randint(0, 1024, (1, 4000), generator=torch.Generator().manual_seed(14))
    one = QJLCache(model.config, dtype=torch.float16)
    modes = [dict(num_beams=4, num_return_sequences=4, do_sample=False)]
    if attention == "qjlkv":  # the sdpa path rebuilds every row densely each step: one mode is enough
        modes += [dict(do_sample=True, num_return_sequences=4), dict(num_beams=4, num_return_sequences=4,
                                                                     do_sample=True)]
    with torch.no_grad():
        model.generate(prompt, max_new_tokens=6, do_sample=False, cache=one)
        for kwargs in modes:
            cache = QJLCache(model.config, dtype=torch.float16)
            torch.manual_seed(0)
            out = model.generate(prompt, max_new_tokens=6, cache=cache, **kwargs)
            assert out.shape == (4, 4006), kwargs
            stats = cache.stats()
            assert stats["bytes_shared"] > 0.5 * stats["bytes_used"], (kwargs, stats)
            assert stats["bytes_used"] < 1.5 * one.stats()["bytes_used"], (kwargs, stats, one.stats())
