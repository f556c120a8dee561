"""The evaluation on a short text, through real qjlkv caches, checks its own invariants."""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from tools.eval.evaluate import (DEFAULT_TEXT, CacheConfig, bits_at_length, evaluate,
                                 headline_configurations, load_text_tokens, write_outputs)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PREFIX, DECODE = 104, 24  # > residual + block of every preset: blocks get quantized


@pytest.fixture(scope="module")
def measured(model):
    configs = [
        # everything stays in the float32 tail: attention is exact up to summation order
        CacheConfig("exact, all in tail", "exact", {"residual_tokens": 65536}),
        # quantized blocks of the exact preset hold fp16 copies of the float32 K/V
        CacheConfig("exact preset", "exact"),
        # The formats' own bytes: at 128 fp32 tokens one rollback copy of a 32-token block would
        # be a fifth of the cache (rollback copies are measured in bench/, RollbackBits).
        CacheConfig("qjl preset", "qjl", {"rollback_tokens": 0}),
        CacheConfig("kivi k2 v2", "kivi", {"key_bits": 2, "value_bits": 2, "block_tokens": 32, "rollback_tokens": 0}),
        CacheConfig("kivi k8 v8", "kivi", {"key_bits": 8, "value_bits": 8, "block_tokens": 32, "rollback_tokens": 0}),
    ]
    tokens = load_text_tokens(model, DEFAULT_TEXT, PREFIX + DECODE + 1)
    ref_ppl, results = evaluate(model, tokens, PREFIX, configs, progress=False)
    return tokens, ref_ppl, {r.name: r for r in results}


def test_exact_storage_gives_the_reference_distribution(measured):
    _, ref_ppl, r = measured
    tail = r["exact, all in tail"]
    assert tail.max_kl < 1e-9 and tail.top1_agreement == 1.0
    assert math.isclose(tail.perplexity, ref_ppl, rel_tol=1e-5)
    fp16 = r["exact preset"]
    # fp16 rounding (relative 2^-11) of stored keys whose |q||k|/sqrt(d) is 25-40 moves
    # logits by ~1e-2: KL tiny, but not zero
    assert 0 < fp16.mean_kl < 1e-6 and fp16.max_kl < 1e-5
    assert fp16.top1_agreement == 1.0
    assert math.isclose(fp16.perplexity, ref_ppl, rel_tol=1e-3)


def test_quantized_caches_are_smaller_and_lossy(measured):
    _, _, r = measured
    for name in ("qjl preset", "kivi k2 v2", "kivi k8 v8"):
        res = r[name]
        assert res.mean_kl > 1e-6 and np.isfinite(res.p99_kl) and res.p99_kl >= res.mean_kl * 0.5, name
        assert 0 <= res.top1_agreement <= 1
    # at this short length the float32 tail (>= 32 tokens of 128) weighs a lot, yet the
    # 2-bit caches must still be smaller than fp16
    for name in ("qjl preset", "kivi k2 v2"):
        assert r[name].bits_per_number < 16 and r[name].compression > 1, name
    # more bits, less error
    assert r["kivi k8 v8"].mean_kl < r["kivi k2 v2"].mean_kl
    assert r["kivi k8 v8"].bits_per_number > r["kivi k2 v2"].bits_per_number


def test_memory_figures_come_from_the_library(measured):
    tokens, _, r = measured
    res = r["exact preset"]
    # K and V, 30 layers, 3 kv heads, 64 dims, fp16
    assert res.bytes_fp16_equivalent == (PREFIX + DECODE) * 30 * 3 * 64 * 2 * 2
    assert math.isclose(res.bits_per_number, 8 * res.bytes_used / (res.bytes_fp16_equivalent / 2),
                        rel_tol=1e-9)


def test_reference_perplexity_is_that_of_a_language_model(measured):
    _, ref_ppl, _ = measured
    assert 1.5 < ref_ppl < 60  # English legal text; a broken model gives thousands


def test_outputs_table_json_and_plot(measured, tmp_path):
    _, ref_ppl, r = measured
    meta = {"model": "m", "text": "t", "prefix": PREFIX, "steps": DECODE, "seconds": 1.0}
    paths = write_outputs(str(tmp_path), meta, ref_ppl, list(r.values()))
    table = open(paths["table"]).read()
    assert table.count("\n| ") == 2 + len(r)  # header, reference row, one row per config
    data = json.load(open(paths["json"]))
    assert {x["name"] for x in data["results"]} == set(r)
    with open(paths["plot"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_command_line_quick_run(tmp_path):
    """The documented command, on a very short run of two presets picked by two --only."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.eval", "--quick", "--prefix", "40", "--decode", "4",
         "--only", "exact", "--only", "ott", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split(" | ")[0] for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert rows[2:] == ["| exact preset", "| ott preset"]  # after the header and the reference
    assert (out / "bits_vs_kl.png").exists() and (out / "accuracy.json").exists()


def test_headline_rows_count_bits_with_fp16_io(model):
    """The headline rows: library caches with fp16 I/O (the exact tail in fp16) and
    llama.cpp's formats; bits at 8,192 tokens are measured on a cache filled that far."""
    configs = headline_configurations(quick=True) + [CacheConfig("kivi, float32 I/O", "kivi")]
    tokens = load_text_tokens(model, DEFAULT_TEXT, PREFIX + DECODE + 1)
    _, results = evaluate(model, tokens, PREFIX, configs, progress=False, bits_length=8192)
    r = {x.name: x for x in results}
    assert 16 <= r["exact preset"].bits_at_length < 16.01  # fp16 blocks plus a little bookkeeping
    assert r["llama.cpp q4_0"].bits_at_length == 4.5 and r["llama.cpp q4_0"].full_precision_bits == 0
    for name in ("qjl preset", "kivi preset", "ott preset"):
        assert r[name].bits_at_length < 4 < r[name].bits_per_number, name  # 128 tokens: mostly tail
        assert r[name].length_tokens == 8192
    # the same cache with a float32 tail: the tail's bits halve with fp16 I/O
    fp16, fp32 = r["kivi preset"], r["kivi, float32 I/O"]
    assert fp16.full_precision_bits > 0
    assert math.isclose(fp32.full_precision_bits, 2 * fp16.full_precision_bits, rel_tol=1e-9)
    assert math.isclose(fp32.bits_per_number - fp16.bits_per_number, fp16.full_precision_bits,
                        rel_tol=1e-9)
    assert r["llama.cpp q4_0"].mean_kl > 0 and r["exact preset"].mean_kl < 1e-5


@pytest.mark.parametrize("head_dim", [64, 128])
def test_headline_tiers_fit_their_bit_budgets(head_dim):
    """The tiers' size goals for the q3/q4 headline rows: at most 3.0 and 4.0 bits per number
    at 8,192 tokens with fp16 I/O (stored sizes depend on the token count only, so random
    K/V of the two models' head sizes stand for theirs)."""
    rows = {c.name: c for c in headline_configurations()}
    shape = SimpleNamespace(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=head_dim)
    rng = np.random.default_rng(0)
    kv = [(rng.standard_normal((300, 1, head_dim), dtype=np.float32),
           rng.standard_normal((300, 1, head_dim), dtype=np.float32))]
    for name, budget in (("q3 preset", 3.0), ("q4 preset", 4.0)):
        assert rows[name].fields == {"dtype": "float16"} and rows[name].preset == name[:2]
        assert budget - 0.2 < bits_at_length(rows[name], shape, kv, 8192) <= budget, name
