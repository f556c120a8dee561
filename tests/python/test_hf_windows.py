"""qjlkv.hf.QJLCache on sliding-window models: Gemma 3 (5 local layers to 1 global one).

QJLCache reads each layer's window from the config (``layer_types`` and ``sliding_window``, as
transformers' own caches do) and sets it on the library cache before any token
(``qjlkv.Cache.set_layer_attention(window_tokens=W)``); the fused ``"qjlkv"`` attention then
accepts transformers' sliding-window mask, since the library applies the same window.

A tiny random Gemma 3 (no download) with a window of 8 decodes far past it, with a prompt
longer than the window (each prompt query its own window), in a left-padded batch, and
through generate (greedy, beam search, prompt-lookup decoding): preset "exact" gives eager
attention on a DynamicCache within float rounding; a compressed preset gives, fused, what the
model's own attention gives on the dense reconstruction of the same compressed cache.

Gemma 3 270M (the evaluation's GGUF file, where ``python3 -m tools.eval.models gemma3-270m``
has assembled it; skipped otherwise) decodes 200 tokens past a prompt of 560, window 512:
preset "exact" (fp16 storage) fused against eager attention on a DynamicCache, and q3/q4
within their quantization error.
"""

from __future__ import annotations

import os
import pathlib

import pytest
import torch
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig

import qjlkv
from conftest import raises
from qjlkv.hf import QJLCache, layer_windows, use_qjlkv_attention

VOCAB, WINDOW, PROMPT, STEPS = 512, 8, 20, 24
EXACT = dict(preset="exact", residual_tokens=128, dtype=torch.float32)


def tiny_gemma3(window: int = WINDOW) -> Gemma3ForCausalLM:
    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
                              sliding_window=window, sliding_window_pattern=2, max_position_embeddings=512,
                              attn_implementation="eager")
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():  # logits of several units: the window's effect is far above rounding
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
        model.lm_head.weight.mul_(4.0)
    return model


@pytest.fixture(scope="module")
def gemma3():
    return tiny_gemma3()


@pytest.fixture(autouse=True)
def eager_after_each_test(gemma3):
    yield
    gemma3.set_attn_implementation("eager")


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def logits_of(model, tokens, cache, prompt: int = PROMPT) -> torch.Tensor:
    """The next-token logits of the prompt's end and of each later token fed one at a time."""
    out = model(tokens[:, :prompt], cache=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for t in range(prompt, tokens.shape[1]):
        logits.append(model(tokens[:, t:t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(logits).float()


def test_windows_from_the_config():
    from transformers import Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig, Qwen2Config

    assert layer_windows(tiny_gemma3().config) == [WINDOW, 0, WINDOW, 0]
    assert layer_windows(Gemma3TextConfig(num_hidden_layers=7, sliding_window=512)) == [512] * 5 + [0, 512]
    assert layer_windows(Gemma2Config(num_hidden_layers=3, sliding_window=64)) == [64, 0, 64]
    assert layer_windows(GptOssConfig(num_hidden_layers=2, sliding_window=128)) == [128, 0]
    assert layer_windows(Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=32,
                                     max_window_layers=2)) == [0, 0, 32, 32]
    assert layer_windows(Qwen2Config(num_hidden_layers=2, sliding_window=32)) == [0, 0]  # not used
    assert layer_windows(MistralConfig(num_hidden_layers=2, sliding_window=16)) == [16, 16]
    assert layer_windows(LlamaConfig(num_hidden_layers=2)) == [0, 0]
    assert QJLCache(tiny_gemma3().config).windows == [WINDOW, 0, WINDOW, 0]


def test_the_window_is_set_on_the_library_cache_before_any_token(gemma3, tokens):
    cache = QJLCache(gemma3.config, **EXACT)
    with torch.no_grad():
        gemma3(tokens[:, :PROMPT], cache=cache, use_cache=True)
    lib, seq = cache.library_cache, cache.rows[0]
    query = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).numpy() * 4
    windowed = lib.attend(0, seq, query)
    lib.set_layer_attention(0, window_tokens=WINDOW)  # what it already holds: accepted, no change
    assert (lib.attend(0, seq, query) == windowed).all()
    with raises(qjlkv.InvalidArgument, "window"):  # a layer holding tokens keeps its window
        lib.set_layer_attention(0)


@pytest.mark.parametrize("attention", ["qjlkv", "eager"])
def test_decoding_past_the_window_equals_eager_attention(gemma3, tokens, attention):
    """A prompt of 20 tokens (2.5 windows), then 24 steps, each query seeing its newest 8
    positions: fused on the library's window, or with the model's mask on the reconstruction."""
    want = logits_of(gemma3, tokens, DynamicCache(config=gemma3.config))
    if attention == "qjlkv":
        use_qjlkv_attention(gemma3)
    got = logits_of(gemma3, tokens, QJLCache(gemma3.config, **EXACT))
    error = (got - want).abs().max().item()
    assert error < 1e-4 * want.abs().max().item(), error

    # The window matters far more than that: with a window of the whole sequence the logits move.
    unwindowed = tiny_gemma3(window=PROMPT + STEPS)
    effect = (logits_of(unwindowed, tokens, DynamicCache(config=unwindowed.config)) - want).abs().max().item()
    assert effect > 1000 * error, (effect, error)


@pytest.mark.parametrize("preset", ["q3", "q4"])
def test_compressed_fused_equals_the_models_attention_on_the_reconstruction(gemma3, tokens, preset):
    """The same compressed cache, attended fused (the library's window) and by the model's eager
    attention on the dense reconstruction (transformers' sliding-window mask): the same logits
    up to float rounding, both within the preset's quantization error of the exact logits."""
    fields = dict(preset=preset, dtype=torch.float32)
    dense = logits_of(gemma3, tokens, QJLCache(gemma3.config, **fields))
    use_qjlkv_attention(gemma3)
    fused = logits_of(gemma3, tokens, QJLCache(gemma3.config, **fields))
    gemma3.set_attn_implementation("eager")
    exact = logits_of(gemma3, tokens, DynamicCache(config=gemma3.config))
    scale = exact.abs().max().item()
    assert (fused - dense).abs().max().item() < 1e-3 * scale
    quantization = (fused - exact).abs().max().item()
    assert 0 < quantization < 0.3 * scale, quantization


def test_a_left_padded_batch_decodes_each_row_as_alone(gemma3, tokens):
    """Rows of 20 and 14 prompt tokens (6 of padding), both past the window."""
    use_qjlkv_attention(gemma3)
    alone = [logits_of(gemma3, tokens, QJLCache(gemma3.config, **EXACT)),
             logits_of(gemma3, tokens[:, 6:], QJLCache(gemma3.config, **EXACT), prompt=PROMPT - 6)]
    batch = torch.cat([tokens, torch.cat([torch.zeros(1, 6, dtype=tokens.dtype), tokens[:, 6:]], 1)])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    cache = QJLCache(gemma3.config, **EXACT)
    with torch.no_grad():
        out = gemma3(batch[:, :PROMPT], attention_mask=mask[:, :PROMPT], cache=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for t in range(PROMPT, batch.shape[1]):
            out = gemma3(batch[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache, use_cache=True)
            logits.append(out.logits[:, -1])
    got = torch.stack(logits).float()  # (steps, rows, vocab)
    assert cache.pads == [0, 6]
    for row in range(2):
        error = (got[:, row] - alone[row]).abs().max().item()
        assert error < 1e-4 * alone[row].abs().max().item(), (row, error)


@pytest.mark.parametrize("mode", [dict(), dict(num_beams=3), dict(prompt_lookup_num_tokens=4)],
                         ids=["greedy", "beam search", "prompt lookup"])
def test_generate_past_the_window_gives_the_tokens_of_eager_attention(gemma3, mode):
    # A repetitive prompt, so that prompt lookup finds drafts to accept and reject.
    prompt = torch.arange(6).repeat(4).unsqueeze(0) + 7
    settings = dict(max_new_tokens=30, do_sample=False, **mode)
    with torch.no_grad():
        want = gemma3.generate(prompt, cache=DynamicCache(config=gemma3.config), **settings)
        use_qjlkv_attention(gemma3)
        cache = QJLCache(gemma3.config, **EXACT)
        got = gemma3.generate(prompt, cache=cache, **settings)
    assert got.tolist() == want.tolist()
    assert cache.get_seq_length() > 3 * WINDOW


def test_a_mask_other_than_causal_window_and_padding_is_refused(gemma3, tokens):
    use_qjlkv_attention(gemma3)
    cache = QJLCache(gemma3.config, **EXACT)
    with torch.no_grad():
        gemma3(tokens[:, :PROMPT], cache=cache, use_cache=True)
        hole = torch.ones(1, PROMPT + 1, dtype=torch.long)
        hole[0, 12] = 0  # a position in the middle masked: not left padding
        with raises(qjlkv.Unsupported, "qjlkv attention"):
            gemma3(tokens[:, PROMPT:PROMPT + 1], attention_mask=hole, cache=cache, use_cache=True)


# -- Gemma 3 270M --------------------------------------------------------------------------------
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
REPO = pathlib.Path(__file__).resolve().parents[2]


def gemma_gguf() -> pathlib.Path | None:
    folder = os.environ.get("QJLKV_EVAL_MODELS") or REPO / "build-eval" / "models"
    path = pathlib.Path(folder) / GEMMA_FILE
    return path if path.exists() else None


@pytest.fixture(scope="module")
def gemma270m():
    path = gemma_gguf()
    if path is None:
        pytest.skip(f"{GEMMA_FILE} not assembled (python3 -m tools.eval.models gemma3-270m; "
                    "QJLKV_EVAL_MODELS names its folder)")
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.set_attn_implementation("eager")
    text = (REPO / "tools" / "eval" / "data" / "GPL-3.0.txt").read_text(encoding="utf-8")
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, :760]
    yield model, ids
    model.set_attn_implementation("eager")


def test_gemma3_270m_decodes_past_its_window(gemma270m):
    """560 prompt tokens (48 past the window of 512), then 200 teacher-forced steps to position
    760: preset "exact" (fp16 storage) fused gives eager attention's logits on a DynamicCache
    to fp16 rounding; q4 and q3 stay within their quantization error (the same next token nearly
    everywhere, small KL)."""
    model, ids = gemma270m
    prompt = 560
    assert QJLCache(model.config).windows == [512] * 5 + [0] + [512] * 5 + [0] + [512] * 5 + [0]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = logits_of(model, ids, DynamicCache(config=model.config), prompt)
        use_qjlkv_attention(model)
        got = {preset: logits_of(model, ids, QJLCache(model.config, preset=preset, dtype=torch.float32,
                                                      num_threads=1), prompt)
               for preset in ("exact", "q4", "q3")}
    finally:
        model.set_attn_implementation("eager")
        torch.set_num_threads(threads)
    scale = want.abs().max().item()
    error = (got["exact"] - want).abs().max().item()
    # The exact preset stores fp16 keys and values past its tail: 3.4e-4 of the scale measured,
    # where leaving out the windows moves them by about 0.18 of it (tests/eval/test_gemma.py).
    assert error < 2e-3 * scale, (error, scale)
    reference = torch.log_softmax(want, -1)
    for preset, bound in (("q4", 0.05), ("q3", 0.1)):
        logp = torch.log_softmax(got[preset], -1)
        kl = (reference.exp() * (reference - logp)).sum(-1).mean().item()
        agree = (got[preset].argmax(-1) == want.argmax(-1)).float().mean().item()
        assert kl < bound and agree > 0.85, (preset, kl, agree)
