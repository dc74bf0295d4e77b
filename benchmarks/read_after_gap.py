"""What a pause between two tokens costs the byte limit: a read of a step's bytes right after another read of
them and after a busy pause of a few milliseconds, as when generate()'s own Python runs between two tokens.

    python benchmarks/read_after_gap.py --preset small --dtype int8 --gaps 0 0.5 1 2 5 --threads 2

Weights that fit the L3 are read from it only while nothing else evicts them. On a machine whose L3 other
tenants share, a pause of a millisecond lets them evict a good part of it, so that a step after such a pause
reads more of its weights from DRAM than `gpn bench`'s limit (reads back to back) assumes. The pause is a
busy loop of this thread, not a sleep (a sleeping thread's core may change its clock, or the OpenMP threads
go to sleep). Each pause's reads run one after another (a read, the pause, a read, ...): where pauses of
different lengths alternate, a long one slows the reads after the next short one too. The pauses are taken
in order and then against it, half of `--repeats` each time. Prints, per pause, the median in ms and GB/s,
and its ratio to the shortest pause's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from modeling_gpn.bench import ReadProbe, build_gpn, step_bytes


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="whose one-token step's bytes are read")
    parser.add_argument("--dtype", default="int8", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--gaps", type=float, nargs="+", default=[0, 0.5, 1, 2, 5], help="pauses in ms")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nbytes = step_bytes(build_gpn(args.preset, args.dtype, "cpu", 0))
    read = ReadProbe(nbytes)
    times = {gap: [] for gap in args.gaps}
    for order in (args.gaps, args.gaps[::-1]):  # (each pause's reads in a run of their own, in and against order)
        for gap in order:
            for _ in range(args.repeats // 2):
                busy(gap / 1e3)
                start = time.perf_counter()
                read()
                times[gap].append(time.perf_counter() - start)
    medians = {gap: statistics.median(values) for gap, values in times.items()}
    base = medians[min(args.gaps)]
    print(f"{args.preset} {args.dtype}: {nbytes / 1e6:.1f} MB, {args.threads} threads, medians of {args.repeats}")
    print("\n| pause ms | read ms | GB/s | x the shortest pause's |\n|---|---|---|---|")
    for gap, seconds in medians.items():
        print(f"| {gap:g} | {1e3 * seconds:.3f} | {nbytes / seconds / 1e9:.1f} | {seconds / base:.2f} |")


if __name__ == "__main__":
    main()
