"""Decode attention with torch SDPA on a dense bf16 cache: the baseline of bench/gpu/bench_gpu.cu.

Same shape (32 query heads, 8 kv heads, head_dim 128), contexts and batches; the GQA group of a
kv head is passed as 4 query positions of that head (no mask: one decode step), so K and V are
read once and never expanded. Prints lines in bench_gpu's format; exits 0 with a note when
torch or a GPU is missing.

    python3 bench/gpu/bench_sdpa.py [--quick]
"""
import sys


def main() -> int:
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"sdpa: torch is not importable ({e}); baseline skipped")
        return 0
    if not torch.cuda.is_available():
        print("sdpa: torch sees no CUDA device; baseline skipped")
        return 0
    quick = "--quick" in sys.argv
    hq, hkv, d = 32, 8, 128
    group = hq // hkv
    contexts = [4096] if quick else [4096, 16384, 32768, 65536, 131072]
    batches = [1, 4] if quick else [1, 32]
    dev = torch.device("cuda")
    print(f"sdpa: torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    for batch in batches:
        for context in contexts:
            k = torch.randn(batch, hkv, context, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            q = torch.randn(batch, hkv, group, d, device=dev, dtype=torch.bfloat16)
            for _ in range(3):
                F.scaled_dot_product_attention(q, k, v)
            reps = 3 if quick else 20
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                F.scaled_dot_product_attention(q, k, v)
            stop.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(stop) / reps
            read = 2 * k.numel() * k.element_size()
            print(f"attend preset=torch_sdpa_bf16 context={context} batch={batch} time_us={ms * 1e3:.1f} "
                  f"read_GBps={read / (ms * 1e6):.1f} bits_per_number=16.000", flush=True)
            del k, v, q
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
