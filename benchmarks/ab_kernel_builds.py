"""A/B of two builds of the C kernels in one process: the same source compiled with two sets of extra compiler
flags (by default with and without AVX512-VNNI, `-mno-avx512vnni`: the int8 products on integer dot products
against converting each weight to float), swapped under one model in ABBA order, with the byte limit's read
in every repeat, so the machine's noisy spells hit both builds alike.

    python benchmarks/ab_kernel_builds.py --preset small gpn-m-1l-130m --dtype int8 --threads 2
    python benchmarks/ab_kernel_builds.py --dtype bfloat16 --a=-DPREFETCH=0 --b=

Per preset and dtype, medians over the repeats: the one-token step (a forward of one token with its cache,
batch 1) and a prompt's prefill per token (`--prompt` tokens), each over its byte limit (`bench.limit`). The steps
and the prompts continue one cache, so what they derive from the weights (int4 packed, int8 tiles) is derived once,
as inside one generate() call, whichever build runs.
Each build is compiled into a kernel cache of its own under the system's temporary folder. With one thread
the clock is the thread's CPU time (a descheduled thread does not accrue it); with more, wall time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from modeling_gpn import memory_kernels
from modeling_gpn.bench import ReadProbe, build_gpn, prefill_bytes, step_and_prefill_fns, step_bytes


def build(extra_flags: str, folder: str):
    """The kernels compiled with `extra_flags` added, cached in `folder` (this user's own, as the module asks)."""
    cache = os.environ.get("GPN_KERNEL_CACHE")
    os.environ["GPN_KERNEL_CACHE"] = folder
    try:
        return memory_kernels.variant(tuple(extra_flags.split()))
    finally:
        if cache is None:
            os.environ.pop("GPN_KERNEL_CACHE")
        else:
            os.environ["GPN_KERNEL_CACHE"] = cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["small"])
    parser.add_argument("--dtype", nargs="+", default=["int8"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--a", default="", help="extra compiler flags of build A (default: none)")
    parser.add_argument("--b", default="-mno-avx512vnni", help="extra compiler flags of build B")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens of the prefill timing")
    parser.add_argument("--steps", type=int, default=20, help="one-token steps per timing")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not memory_kernels.available():
        raise SystemExit(f"the C kernels are unavailable: {memory_kernels.unavailable_reason()}")
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with tempfile.TemporaryDirectory() as scratch:
        builds = {side: build(flags, os.path.join(scratch, side)) for side, flags in (("A", args.a), ("B", args.b))}
        default = memory_kernels._library
        print(
            f"A: {args.a or '(no extra flags)'}  B: {args.b or '(no extra flags)'}; threads {args.threads}, "
            f"medians of {args.repeats} repeats\n"
        )
        print("| preset | weights | limit ms | step A | step B | prompt-token limit ms | prefill A | prefill B |")
        print("|---|---|---|---|---|---|---|---|")
        try:
            for preset in args.preset:
                for dtype in args.dtype:
                    run(preset, dtype, args, builds, clock)
        finally:
            memory_kernels._library = default


def run(preset: str, dtype: str, args, builds: dict, clock) -> None:
    model = build_gpn(preset, dtype, "cpu", 0).eval()
    ids = torch.randint(1, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    step, prefill = step_and_prefill_fns(model, ids)  # (one cache, as in generate())
    limit, prompt_limit = ReadProbe(step_bytes(model)), ReadProbe(prefill_bytes(model))
    times = {key: [] for key in ("A", "B", "prefill A", "prefill B", "limit", "prompt limit")}
    for repeat in range(args.repeats + 1):  # (the first repeat warms up and is dropped)
        limit()
        order = "ABBA" if repeat % 2 == 0 else "BAAB"
        for position, side in enumerate(order):
            memory_kernels._library = builds[side]
            step()  # (untimed: the first step after the switch or the limit's read refills the caches)
            start = clock()
            for _ in range(args.steps):
                step()
            if repeat:
                times[side].append((clock() - start) / args.steps)
            if position % 2 == 0:  # (each side's prefill once a repeat)
                start = clock()
                prefill()
                if repeat:
                    times[f"prefill {side}"].append((clock() - start) / args.prompt)
        for key, probe in (("limit", limit), ("prompt limit", prompt_limit)):
            start = clock()
            for _ in range(args.steps):
                probe()
            if repeat:
                times[key].append((clock() - start) / args.steps)
    ms = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    ratio = lambda key, of: f"{ms[key]:.3f} ({ms[key] / ms[of]:.2f}x)"  # noqa: E731
    print(
        f"| {preset} | {dtype} | {ms['limit']:.3f} | {ratio('A', 'limit')} | {ratio('B', 'limit')} | "
        f"{ms['prompt limit']:.3f} | {ratio('prefill A', 'prompt limit')} | {ratio('prefill B', 'prompt limit')} |",
        flush=True,
    )


if __name__ == "__main__":
    main()
