"""The numpy forward of Gemma 3 270M (gemma3 architecture: QK-norm, post-norms, GeLU,
scaled embeddings, 5 local layers with a 512-position window for each global one, two RoPE
bases, SentencePiece vocabulary) against Hugging Face transformers reading the same GGUF.

The prompt is longer than the window, so that the local layers' windows change the logits
of its last positions. transformers runs first, in a subprocess (tests/eval/hf_reference.py).
"""

import numpy as np
import pytest
from conftest import transformers_reference

from tools.eval.anchors import BlockQuantCache
from tools.eval.caches import ExactCache, QjlkvCache
from tools.eval.evaluate import DEFAULT_TEXT
from tools.eval.model import single_threaded_blas

WINDOW = 512
# The BOS Gemma reads a document after, then the GPL text: 580 tokens
PROMPT_CHARS = 2600
# Measured 4.0e-4 apart on logits up to 49.7 (8e-6 of their scale): the bound of the
# other models (1e-4 of the scale) leaves a 12x margin. Without the windows the logits
# past position 512 are 8.7 apart.
LOGIT_TOLERANCE = 1e-4


def prompt() -> str:
    with open(DEFAULT_TEXT, encoding="utf-8") as f:
        return "<bos>" + f.read()[:PROMPT_CHARS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return transformers_reference("gemma3-270m", prompt(), tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def gemma(reference):
    from tools.eval.model import load_model

    return load_model("gemma3-270m")


def test_shape_windows_and_norms_from_metadata(gemma):
    s = gemma.shape
    assert (s.num_layers, s.dim, s.num_q_heads, s.num_kv_heads, s.head_dim, s.vocab_size) == \
        (18, 640, 4, 1, 256, 262144)
    assert (s.architecture, s.rope_type, s.rope_base, s.rope_base_local) == \
        ("gemma3", "neox", 1e6, 1e4)
    # every 6th layer is global
    assert s.windows == tuple(None if i % 6 == 5 else WINDOW for i in range(18))
    layer = gemma.layers[0]
    assert layer.q_norm.shape == layer.k_norm.shape == (256,)
    # the converter stores Gemma's norm weights as 1 + w: mostly positive scales
    assert np.median(layer.post_attn_norm) > 0 and gemma.final_softcap is None
    assert gemma.tokenizer.bos_prefix == [2]


def test_token_ids_equal_transformers(gemma, reference):
    ids = gemma.tokenizer.encode(prompt(), allow_special=True)
    assert ids == reference["ids"].tolist()
    assert len(ids) > WINDOW + 50  # the windows matter for the last positions
    assert gemma.tokenizer.decode(ids[1:]) == prompt()[len("<bos>"):]


def test_logits_match_transformers(gemma, reference):
    ids = reference["ids"].tolist()
    logits, _ = gemma.forward(ids)
    expected = reference["logits"]
    scale = np.abs(expected).max()
    assert scale > 10 and bool(reference["tied"])
    np.testing.assert_allclose(logits, expected, rtol=0, atol=LOGIT_TOLERANCE * scale)
    assert (logits.argmax(-1) == expected.argmax(-1)).all()


def test_decoding_through_windowed_caches_matches_transformers(gemma, reference):
    """Prefill short of the window, then decode past it through the exact, the f16 and the
    library's exact cache: their masks, not the forward's, must drop the oldest positions."""
    ids = reference["ids"].tolist()
    expected = reference["logits"]
    s = gemma.shape
    # positions 510..517: the last 6 queries' windows have dropped 1..6 of the oldest keys
    prefix, end = WINDOW - 2, WINDOW + 6
    caches = [ExactCache.of(s), BlockQuantCache("f16", "f16", s), QjlkvCache("exact", "exact", s)]
    with single_threaded_blas():  # small matmuls: one thread is faster (model.py)
        stepped = [np.repeat(gemma.prefill(ids[:prefix], caches)[None], 3, axis=0)]
        for pos in range(prefix, end):
            stepped.append(gemma.decode_step([ids[pos]] * 3, pos, caches))
    stepped = np.array(stepped)  # [steps, caches, vocab]: predictions of positions prefix-1..
    scale = np.abs(expected).max()
    np.testing.assert_allclose(stepped[:, 0], expected[prefix - 1:end], rtol=0,
                               atol=LOGIT_TOLERANCE * scale)
    for cache in (1, 2):  # fp16 storage: rounding only
        assert np.abs(stepped[:, cache] - stepped[:, 0]).max() < 0.05 * scale
