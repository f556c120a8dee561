"""Logits and token ids of a prompt from Hugging Face transformers loading a GGUF file:
the oracle of the numpy model (tests/eval/test_qwen.py and test_gemma.py run it in a
subprocess, so that its memory is freed before the numpy weights load).

python3 tests/eval/hf_reference.py GGUF PROMPT_FILE OUT.npz
"""
import sys

import numpy as np


def main(gguf_path: str, prompt_path: str, out_path: str) -> None:
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    folder, name = os.path.split(os.path.abspath(gguf_path))
    with open(prompt_path, encoding="utf-8") as f:
        prompt = f.read()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].numpy()
    np.savez(out_path, ids=np.array(ids), logits=logits,
             tied=np.array(model.config.tie_word_embeddings))


if __name__ == "__main__":
    main(*sys.argv[1:])
