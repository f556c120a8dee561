"""The needle diagnostic (tools/eval/needle.py) on SmolLM2, a short haystack."""
import numpy as np

from tools.eval.needle import needle_report, relative_errors
from tools.eval.passkey import make_prompts
from tools.eval.research import LibraryConfig


def test_relative_errors_are_per_token_means_over_heads():
    exact = np.ones((2, 2, 4), np.float32)
    stored = exact.astype(np.float64).copy()
    stored[1, 0] = 0.0   # token 1: one head entirely lost (error 1), the other exact
    np.testing.assert_allclose(relative_errors(exact, stored), [0.0, 0.5])


def test_a_needle_in_the_exact_tail_has_no_error_and_one_in_a_block_has_some(model):
    head, prompts = make_prompts(model, 512, [0.05, 0.95])
    _, head_kv = model.forward(head, all_logits=False)
    # q3's format with blocks of 128 and a tail of 32, so that the needle at 95 % of 512 tokens
    # is among the newest R + B tokens, kept exact
    config = LibraryConfig("q3 B128 R32 S4", "q3", {"block_tokens": 128, "residual_tokens": 32, "sink_tokens": 4})
    early, late = (needle_report(model, config, head_kv, p) for p in prompts)
    assert early["blocks"] == [0] and early["digit_positions"]
    assert 0.3 < early["keys_ratio_median"] < 3 and 0.3 < early["values_ratio_median"] < 3
    assert late["keys_ratio_max"] == 0 and late["values_ratio_max"] == 0
