import os
import sys

import pytest

# The tools under test live in the repository (tools/eval), not in an installed package.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


@pytest.fixture(scope="session")
def model():
    from tools.eval.model import LlamaModel

    return LlamaModel()
