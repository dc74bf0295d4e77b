"""The one-token step of one preset in several dtypes, alternated in one process (ABBA order), each with its
own byte limit read in every repeat: whether int8 decodes within the bf16 time (issue 28) is a comparison of
two timings that a noisy machine's spells would otherwise hit unequally.

    python benchmarks/ab_dtypes.py --preset small --dtype bfloat16 int8 --threads 2
    python benchmarks/ab_dtypes.py --preset small --dtype int4 int4-dequantized int8 --threads 1

`int4-dequantized`: the int4 model with `GPN_INT4_KERNEL=0` set around its steps (not timed): its matrices
dequantized to bf16, as the fast path multiplied int4 weights before the int4 products.

Medians over the repeats; with one thread the clock is the thread's CPU time, with more wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from modeling_gpn.bench import ReadProbe, build_gpn, one_token_step_fn, step_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "int8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="one-token steps per timing")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    steps, limits = {}, {}

    def switched(dtype: str, on: bool) -> None:
        if dtype == "int4-dequantized":
            if on:
                os.environ["GPN_INT4_KERNEL"] = "0"
            else:
                del os.environ["GPN_INT4_KERNEL"]

    for dtype in args.dtype:
        model = build_gpn(args.preset, dtype.removesuffix("-dequantized"), "cpu", 0).eval()
        switched(dtype, True)
        steps[dtype] = one_token_step_fn(model, 1, model.config.vocab_size, "cpu")
        switched(dtype, False)
        limits[dtype] = ReadProbe(step_bytes(model))
    times = {key: [] for key in [*args.dtype, *(f"limit {dtype}" for dtype in args.dtype)]}
    for repeat in range(args.repeats):
        forward = args.dtype if repeat % 2 == 0 else args.dtype[::-1]
        for dtype in [*forward, *forward[::-1]]:
            switched(dtype, True)
            steps[dtype]()  # (untimed: the first step after another model's refills the caches)
            start = clock()
            for _ in range(args.steps):
                steps[dtype]()
            times[dtype].append((clock() - start) / args.steps)
            switched(dtype, False)
        for dtype in args.dtype:
            start = clock()
            for _ in range(args.steps):
                limits[dtype]()
            times[f"limit {dtype}"].append((clock() - start) / args.steps)
    ms = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    print(f"{args.preset}, {args.threads} threads, medians of {args.repeats} repeats x 2 timings:")
    for dtype in args.dtype:
        limit = ms[f"limit {dtype}"]
        print(f"  {dtype}: step {ms[dtype]:.3f} ms, {ms[dtype] / limit:.2f}x its limit {limit:.3f} ms")


if __name__ == "__main__":
    main()
