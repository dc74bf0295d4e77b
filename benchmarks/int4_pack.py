"""What the fast path's int4 weights cost to derive per call, and hold while a cache lives: each int4 matrix packed for
the int4 products (`memory_kernels.int4_pack`) against dequantized to bf16 (`weight.dequantize()`, what the fast path
did before them, and what `GPN_INT4_KERNEL=0` still does), over every int4 weight of a preset's model.

    python benchmarks/int4_pack.py --preset small --threads 1

Medians over `--repeats` passes over all the weights, the two alternated; the bytes each holds. Run nothing else
meanwhile.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from modeling_gpn import memory_kernels
from modeling_gpn.bench import build_gpn
from modeling_gpn.recurrence_step import int4_weight_parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_gpn(args.preset, "int4", "cpu", 64).eval()
    weights = [m.weight for m in model.modules() if int4_weight_parts(getattr(m, "weight", None)) is not None]
    parts = [int4_weight_parts(w) for w in weights]
    packed_times, dequantized_times = [], []
    with torch.no_grad():
        for _ in range(args.repeats):
            start = time.perf_counter()
            packed = [memory_kernels.int4_pack(p) for p in parts]
            packed_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            dense = [w.dequantize() for w in weights]
            dequantized_times.append(time.perf_counter() - start)
    packed_bytes = sum(t.numel() * t.element_size() for p in packed for t in p if t is not None)
    dense_bytes = sum(t.numel() * t.element_size() for t in dense)
    held = sum(
        sum(t.numel() * t.element_size() for t in (p.qdata, p.scale, p.zero_point) if t is not None) for p in parts
    )
    values = sum(w.shape[0] * w.shape[1] for w in weights)
    print(f"{args.preset}: {len(weights)} int4 matrices, {values / 1e6:.2f} M weights, {args.threads} thread(s)")
    print(f"| derived per call | ms (median of {args.repeats}) | MB held | bytes a weight |\n|---|---|---|---|")
    print(
        f"| packed (int4_pack) | {statistics.median(packed_times) * 1e3:.2f} | {packed_bytes / 1e6:.2f} | {packed_bytes / values:.3f} |"
    )
    print(
        f"| dequantized to bf16 | {statistics.median(dequantized_times) * 1e3:.2f} | {dense_bytes / 1e6:.2f} | {dense_bytes / values:.3f} |"
    )
    print(f"| (torchao's own int4 tensors) | | {held / 1e6:.2f} | {held / values:.3f} |")


if __name__ == "__main__":
    main()
