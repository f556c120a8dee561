"""The per-layer key statistics behind the QJL analysis in docs/ACCURACY.md."""
import math

from tools.eval.evaluate import DEFAULT_TEXT, load_text_tokens
from tools.eval.keystats import kernel_error, layer_statistics


def test_layer_statistics_on_a_short_text(model):
    rows = layer_statistics(model, load_text_tokens(model, DEFAULT_TEXT, 96), last=16)
    assert len(rows) == model.shape.num_layers
    for r in rows:
        assert 0 < r["spread"] < r["scale"]  # Cauchy-Schwarz: |q·k| <= |q||k|
        assert math.isclose(r["qjl_err"], math.sqrt(math.pi / 2 - 1) * r["scale"] / math.sqrt(128))
        assert 0 < r["mean_share"] <= 1 and 8 / 64 <= r["top8"] <= 1
    # the property the analysis rests on: QJL's error scale dwarfs the logit spread
    assert sum(r["scale"] / r["spread"] for r in rows) / len(rows) > 5


def test_fast_path_logit_error_is_within_the_budget_on_real_keys(model):
    # SPEC §9: the fast path's arithmetic adds at most 5 % of the method's own error. QJL's
    # own error is large, so the default path (integer on AVX-512 VNNI) must stay far below it.
    rows = kernel_error(model, load_text_tokens(model, DEFAULT_TEXT, 96), "qjl", last=16)
    assert len(rows) == model.shape.num_layers
    for r in rows:
        assert r["method"] > 0
        assert r["kernel"] <= 0.05 * r["method"]
