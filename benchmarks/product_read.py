"""One product of the C kernels alone against a read of its bytes: a random (rows, cols) weight matrix (float32,
bfloat16 or int8 with a scale per row) times one input row (`gpn_linear`, cut into tasks as a plan cuts it,
flagged as a plan flags it: `STREAM_ROWS` / `FAR_ROWS` beyond the L3), alternated in one process with the C
read kernel over the same bytes (`ReadProbe`) and, for float32, over the weights themselves (the same
physical memory). What a step's products cost without the rest of the step.

    python benchmarks/product_read.py --dtype int8 --rows 7168 --cols 768 --threads 2
    python benchmarks/product_read.py --dtype float32 --rows 32768 --cols 4096 --processes 6

Prints, per process, the medians of `--repeats` rounds (each round one product and one read of each kind) in
GB/s and the product's ratio to each read. Weights that fit the L3 are read from it (every timing after the
first finds them there); beyond it, from DRAM. `--processes` repeats it in fresh processes: each allocates its
own memory, and a DRAM read's bandwidth on this machine changes from one process to the next.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time

import torch

from modeling_gpn import memory_kernels as mk
from modeling_gpn.bench import ReadProbe

KINDS = {"float32": mk.KIND_F32, "bfloat16": mk.KIND_BF16, "int8": mk.KIND_I8}


def product(dtype: str, rows: int, cols: int):
    """A call runs the product once; returns it and its weight bytes."""
    generator = torch.Generator().manual_seed(0)
    if dtype == "int8":
        weight = torch.randint(-127, 128, (rows, cols), dtype=torch.int8, generator=generator)
        scale = torch.rand(rows, generator=generator)
    else:
        weight, scale = torch.randn(rows, cols, generator=generator).to(getattr(torch, dtype)), None
    op = mk.Operand(KINDS[dtype], weight, scale, None, dtype == "bfloat16")
    slot = mk._input_slot(1, cols)
    slot["x"].normal_(generator=generator)
    slot["xr"].copy_(slot["x"].bfloat16().float())
    slot["xb"].copy_(slot["x"].bfloat16().view(torch.int16))  # (the bits bf16 products read)
    out = torch.empty(1, rows)
    segment = mk._segment(op, slot, out, 0)
    mk._mark_streamed([segment], [weight])
    tasks = torch.tensor(mk._tasks([segment], 0, 1), dtype=torch.int64)
    threads = torch.get_num_threads()

    def run() -> None:
        mk._library.gpn_linear(ctypes.addressof(segment), tasks.data_ptr(), len(tasks), 1, threads)

    run.keep = (weight, scale, slot, out, segment, tasks)
    return run, weight


def one_process(args) -> None:
    torch.set_num_threads(args.threads)
    mk._require()
    run, weight = product(args.dtype, args.rows, args.cols)
    nbytes = weight.numel() * weight.element_size()
    probe = ReadProbe(nbytes)
    reads = {"product": run, "read": probe}
    if weight.dtype == torch.float32:
        reads["read of the weights"] = lambda: mk.read_probe(weight)
    times = {name: [] for name in reads}
    for _ in range(args.repeats + 1):  # (the first round warms up and is dropped)
        for name, call in reads.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values[1:]) for name, values in times.items()}
    figures = ", ".join(f"{name} {nbytes / seconds / 1e9:.1f} GB/s" for name, seconds in medians.items())
    ratios = ", ".join(
        f"{medians['product'] / seconds:.2f}x the {name}" for name, seconds in medians.items() if name != "product"
    )
    print(f"{args.dtype} {args.rows}x{args.cols} ({nbytes / 1e6:.1f} MB), {args.threads} threads: {figures}; {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="int8", choices=list(KINDS))
    parser.add_argument("--rows", type=int, default=7168)
    parser.add_argument("--cols", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--processes", type=int, default=1, help="fresh processes to repeat it in")
    args = parser.parse_args()
    if args.processes == 1:
        one_process(args)
        return
    command = [sys.executable, __file__, "--dtype", args.dtype, "--rows", str(args.rows), "--cols", str(args.cols)]
    command += ["--threads", str(args.threads), "--repeats", str(args.repeats)]
    for _ in range(args.processes):
        subprocess.run(command, check=True)


if __name__ == "__main__":
    main()
