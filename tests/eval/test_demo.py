"""The README demo (tools/eval/demo.py)."""
import os
import subprocess
import sys

from tools.eval.demo import generate

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def test_exact_storage_generates_the_exact_text(model):
    tok = model.tokenizer
    ids = tok.encode("<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
                     allow_special=True)
    r = generate(model, ids, "exact", 6, {"residual_tokens": 65536})
    assert r["exact"] == r["compressed"] and len(r["exact"]) == 6
    assert r["kl"].max() < 1e-9 and r["top1"] == 1.0
    assert r["stats"]["tokens"] == (len(ids) + 5) * model.shape.num_layers


def test_command_line_prints_both_texts_memory_and_kl():
    proc = subprocess.run([sys.executable, "-m", "tools.eval.demo", "--tokens", "3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for expected in ("== exact KV cache (float32) ==", '== libqjlkv "q3" ==', "bits per number",
                     "Next-token KL(exact || q3)", "MiB"):
        assert expected in out, expected
