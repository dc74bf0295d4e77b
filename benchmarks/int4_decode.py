"""int4 weights (torchao's `IntxWeightOnlyConfig`, as `gpn generate --dtype int4` quantizes) through
`generate()`: the plain loop (`use_fast_path = False`: what such a model ran before the fast path took it) against
the fast path on the int4 products (the int4 values read as int4), the fast path on the matrices dequantized to bf16
(`GPN_INT4_KERNEL=0`: what it ran before the int4 products), beside the same model in bf16 and int8 on the fast path,
alternated in one process (`--skip-plain` leaves the slow plain loop out).

    python benchmarks/int4_decode.py --preset small --threads 1

Per model, medians over `--repeats` of: time to the first token of a `--prompt`-token prompt (`max_new_tokens=1`:
the prefill, and for the fast path its weights derived once, the int4 matrices dequantized), and the decode time
a token (`--tokens` more new tokens, the difference over them). Greedy, no end-of-sequence token. Run nothing
else meanwhile.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch

from modeling_gpn.bench import build_gpn


def timed_generate(model, prompt: torch.Tensor, new_tokens: int) -> float:
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return time.perf_counter() - start


@contextlib.contextmanager
def dequantized(on: bool):
    """`GPN_INT4_KERNEL=0` for the block where `on` (the int4 weights' matrices dequantized, as before the int4
    products); read where a call derives its weights, so set around whole calls."""
    if not on:
        yield
        return
    os.environ["GPN_INT4_KERNEL"] = "0"
    try:
        yield
    finally:
        del os.environ["GPN_INT4_KERNEL"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-plain", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = {
        "int4 plain loop": build_gpn(args.preset, "int4", "cpu", 64).eval(),
        "int4 fast path, int4 products": build_gpn(args.preset, "int4", "cpu", 64).eval(),
        "int4 fast path, dequantized to bf16 (before)": build_gpn(args.preset, "int4", "cpu", 64).eval(),
        "bf16 fast path": build_gpn(args.preset, "bfloat16", "cpu", 64).eval(),
        "int8 fast path": build_gpn(args.preset, "int8", "cpu", 64).eval(),
    }
    models["int4 plain loop"].model.use_fast_path = False
    if args.skip_plain:
        del models["int4 plain loop"]
    vocab = models["bf16 fast path"].config.vocab_size
    prompt = torch.randint(1, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    first, per_token = {name: [] for name in models}, {name: [] for name in models}
    for name, model in models.items():  # (warm-up: kernels built, first calls made)
        with dequantized("dequantized" in name):
            timed_generate(model, prompt[:, :8], 2)
    for _ in range(args.repeats):
        for name, model in models.items():
            with dequantized("dequantized" in name):
                one = timed_generate(model, prompt, 1)
                more = timed_generate(model, prompt, 1 + args.tokens)
            first[name].append(one)
            per_token[name].append((more - one) / args.tokens)
    print(f"{args.preset}, {args.threads} thread(s), {args.prompt}-token prompt, medians of {args.repeats}\n")
    print("| model | first token ms | decode ms/token | path |\n|---|---|---|---|")
    for name, model in models.items():
        print(
            f"| {name} | {statistics.median(first[name]) * 1e3:.1f} | {statistics.median(per_token[name]) * 1e3:.3f} "
            f"| {model.model.last_recurrence_path} |"
        )


if __name__ == "__main__":
    main()
