import os
import subprocess
import sys

import pytest

# The tools under test live in the repository (tools/eval), not in an installed package.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


@pytest.fixture(scope="session")
def model():
    from tools.eval.model import LlamaModel

    return LlamaModel()


def transformers_reference(model_name: str, prompt: str, folder):
    """transformers' ids and logits for `prompt` on the GGUF of `model_name`, computed in a
    subprocess (tests/eval/hf_reference.py) so that its memory is freed before the numpy
    weights load."""
    import numpy as np

    from tools.eval.models import fetch

    path = fetch(model_name, progress=False)
    (folder / "prompt.txt").write_text(prompt, encoding="utf-8")
    out = folder / "reference.npz"
    proc = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "hf_reference.py"), path,
                           str(folder / "prompt.txt"), str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(out)
