"""python3 -m tools.eval [--model NAME] [--quick]: accuracy of the qjlkv presets on a real
model (default SmolLM2-135M; qwen2.5-1.5b: Qwen2.5-Coder-1.5B-Instruct; gemma3-270m: Gemma 3
270M, whose sliding-window layers the library's rows need qjlkv window support for).

Writes accuracy.md (table), accuracy.json and bits_vs_kl.png to --out."""
import argparse
import sys

from .evaluate import DEFAULT_TEXT, replot, run
from .models import DEFAULT_MODEL, MODELS

# (prefix, decode) of a full run: the 1.5B model decodes ~10x slower than SmolLM2-135M;
# Gemma 3 270M's 262k-token output matrix makes each step ~3x SmolLM2's
FULL_RUN = {"smollm2-135m": (2048, 1024), "qwen2.5-1.5b": (1024, 128), "gemma3-270m": (2048, 512)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS),
                   help=f"the model (default {DEFAULT_MODEL}); fetched on first use "
                        "(python3 -m tools.eval.models)")
    p.add_argument("--quick", action="store_true",
                   help="5 rows (exact, q4_0, the presets), 256 prefilled + 64 decoded tokens")
    p.add_argument("--sweep", action="store_true",
                   help="the 38-configuration sweep of the library's settings (float32 I/O) "
                        "instead of the headline rows (fp16 I/O, llama.cpp's formats)")
    p.add_argument("--prefix", type=int,
                   help="tokens prefilled exactly (default 2048, qwen2.5-1.5b 1024; quick 256)")
    p.add_argument("--decode", type=int,
                   help="teacher-forced decode steps (default 1024, qwen2.5-1.5b 128; quick 64)")
    p.add_argument("--text", default=DEFAULT_TEXT, help="UTF-8 text file to evaluate on")
    p.add_argument("--out", default="build-eval", help="output folder (default build-eval)")
    p.add_argument("--threads", type=int, default=1,
                   help="qjlkv worker threads per cache (default 1: the calls are tiny)")
    p.add_argument("--only", action="append",
                   help="run only the configurations whose name contains this (repeatable: "
                        "those that contain any of them)")
    p.add_argument("--prototypes", action="store_true",
                   help="measure the numpy prototypes of QJL remedies (tools/eval/prototype.py) "
                        "next to library rows, instead of the library set")
    p.add_argument("--replot", metavar="JSON",
                   help="only rewrite the table and plot of a previous run's accuracy.json")
    a = p.parse_args(argv)
    if a.replot:
        paths = replot(a.replot, a.out)
        print(f"wrote {paths['table']}, {paths['plot']}")
        return 0
    full_prefix, full_decode = FULL_RUN[a.model]
    prefix = a.prefix if a.prefix is not None else (256 if a.quick else full_prefix)
    decode = a.decode if a.decode is not None else (64 if a.quick else full_decode)
    reference_ppl, results, paths = run(prefix, decode, a.quick, a.out, a.text, a.threads, a.only,
                                        a.prototypes, a.model, a.sweep)
    with open(paths["table"]) as f:
        sys.stdout.write(f.read())
    print(f"\nwrote {paths['table']}, {paths['json']}, {paths['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
