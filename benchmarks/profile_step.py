"""Where the time of one decode step goes: the model's one-token step (a forward of one token with its
cache, batch 1, no autograd), profiled with cProfile on the thread's CPU clock, alternated in one process on
three paths: the token in one C call (the default), the C step kernels with the few-row products around
them (`GPN_DECODE_KERNEL=0`), and the torch-ops fast path (`GPN_STEP_KERNELS=0`, the path before both).

    python benchmarks/profile_step.py --preset small --dtype float32 --steps 200 [--threads 1]

Prints, for each path: the median step time beside the byte limit (a read of the step's bytes, timed in
turn with it), then the functions that take the most of a step (own time per step, in microseconds),
grouped as the C kernels, torch ops, the fast path's Python, the model's Python (modeling_gpn.py) and
transformers'. cProfile adds its own cost to every Python call, so the Python rows are upper bounds; the
first table (no profiler) is the figure.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from modeling_gpn.bench import ReadProbe, build_gpn, one_token_step_fn, step_bytes

PATHS = {  # each path's settings
    "one-call decode": {"GPN_STEP_KERNELS": "1", "GPN_DECODE_KERNEL": "1"},
    "step kernels and products": {"GPN_STEP_KERNELS": "1", "GPN_DECODE_KERNEL": "0"},
    "torch ops": {"GPN_STEP_KERNELS": "0", "GPN_DECODE_KERNEL": "1"},
}


def group_of(filename: str, name: str) -> str:
    if "memory_kernels" in filename and name in (
        "step",
        "steps",
        "linear_rows",
        "module_rows",
        "_rows_product",
        "__call__",
    ):
        return "C kernels (and their Python entry)"
    if filename == "~" or "torch/" in filename and "nn/modules" not in filename:
        return "torch ops"
    if "/modeling_gpn/" in filename and not filename.endswith("modeling_gpn.py"):
        return "fast path Python"
    if filename.endswith("modeling_gpn.py"):
        return "model Python (modeling_gpn.py)"
    if "transformers" in filename:
        return "transformers"
    return "other Python (nn.Module calls, ...)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    model = build_gpn(args.preset, args.dtype, "cpu", 0).eval()
    step = one_token_step_fn(model, 1, model.config.vocab_size, "cpu")
    probe = ReadProbe(step_bytes(model))
    times = {name: [] for name in [*PATHS, "limit"]}
    for _ in range(args.steps):
        for name, settings in PATHS.items():
            os.environ.update(settings)
            start = clock()
            step()
            times[name].append(clock() - start)
        start = clock()
        probe()
        times["limit"].append(clock() - start)
    limit = statistics.median(times["limit"])
    print(
        f"{args.preset} {args.dtype}, {args.threads} thread(s), {'CPU' if args.threads == 1 else 'wall'} clock, "
        f"medians of {args.steps}: limit {1e3 * limit:.3f} ms ({probe.nbytes / 1e6:.1f} MB at "
        f"{probe.nbytes / limit / 1e9:.1f} GB/s, {probe.kind})"
    )
    for name in PATHS:
        median = statistics.median(times[name])
        print(f"  {name}: {1e3 * median:.3f} ms a step = {median / limit:.2f}x the limit")
    for name, settings in PATHS.items():
        os.environ.update(settings)
        profile = cProfile.Profile(timer=time.thread_time)
        profile.enable()
        for _ in range(args.steps):
            step()
        profile.disable()
        stats = pstats.Stats(profile).stats
        rows, groups = [], {}
        for (filename, line, function), (_, calls, own, _, _) in stats.items():
            per_step = 1e6 * own / args.steps
            groups[group_of(filename, function)] = groups.get(group_of(filename, function), 0.0) + per_step
            rows.append((per_step, calls / args.steps, f"{os.path.basename(filename)}:{line}({function})"))
        total = sum(groups.values())
        print(f"\n### {name}: {total:.0f} us a step under cProfile\n\n| where | us a step | share |\n|---|---|---|")
        for group, us in sorted(groups.items(), key=lambda item: -item[1]):
            print(f"| {group} | {us:.0f} | {us / total:.0%} |")
        print("\n| function | own us a step | calls a step |\n|---|---|---|")
        for per_step, calls, where in sorted(rows, reverse=True)[: args.top]:
            print(f"| {where} | {per_step:.1f} | {calls:.0f} |")


if __name__ == "__main__":
    main()
