"""Bytes a training sweep (`cuda_graphs.TrainingSweep`: the static buffers the CUDA graphs of a training
window replay into) holds, for a preset, batch size and BPTT segment length, without a GPU.

    python benchmarks/sweep_memory.py [--preset gpn-m-1l-130m] [--batch 16] [--segment 256 2048] [--dtype bfloat16]

How: the sweep is built on PyTorch's `meta` device (shapes, no memory) and runs one forward and one backward
sweep of a segment-long window there, which makes every workspace buffer its steps use; the Triton launches
are skipped (a meta tensor holds no values: only the buffers' shapes are measured, and they do not depend on
what the kernels compute). The total is `TrainingSweep.nbytes()`: every buffer, once. Not counted: the CUDA
graphs' own pools (the captured steps allocate nothing), the model, its gradients and optimizer state, and
the window's inputs and outputs (the caller's).
"""

from __future__ import annotations

import argparse

import torch

from modeling_gpn import GPNForCausalLM, cuda_graphs
from modeling_gpn import triton_kernels as tk
from modeling_gpn.configuration import load_preset
from modeling_gpn.fast_recurrence import GRAPH_KERNELS, fold_weights, in_matmul_dtype


def sweep_nbytes(preset: str, batch: int, segment: int, dtype: torch.dtype) -> dict:
    """{"total": bytes the sweep holds, "memory_slots": of which M' of every segment position}."""
    meta = torch.device("meta")
    config = load_preset(preset)
    config.bptt_segment_length = segment
    with torch.device(meta):
        core = GPNForCausalLM(config).to(dtype).model
    with torch.no_grad():
        w = in_matmul_dtype(fold_weights(core), None)
    sweep = cuda_graphs.TrainingSweep(core, batch, segment, w, meta, kernels=GRAPH_KERNELS)
    s = sweep.s
    launch, tk._launch = tk._launch, lambda *args, **meta_args: None  # (meta tensors: shapes only)
    try:
        with torch.no_grad():
            U = torch.zeros(batch, segment, s.hidden, device=meta)
            p0, g0 = torch.zeros(batch, s.hidden, device=meta), torch.zeros(batch, s.hidden, device=meta)
            M0 = torch.zeros(batch, s.heads, s.key_dim, s.value_dim, device=meta)
            sweep.load_weights(w)
            outputs, state, _, boundaries = sweep.forward(U, p0, g0, M0)
            sweep.backward(U, g0, w, boundaries, True, torch.zeros_like(outputs), None, None, None)
    finally:
        tk._launch = launch
    memory = sweep.memory.numel() * sweep.memory.element_size() if sweep.memory is not None else 0
    return {"total": sweep.nbytes(), "memory_slots": memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpn-m-1l-130m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--segment", type=int, nargs="+", default=[cuda_graphs.SWEEP_SEGMENT_LENGTH, 2048])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    totals = {}
    for segment in args.segment:
        figures = sweep_nbytes(args.preset, args.batch, segment, dtype)
        totals[segment] = figures["total"]
        print(
            f"{args.preset} {args.dtype} batch {args.batch}, segment {segment}: a training sweep holds "
            f"{figures['total'] / 2**30:.2f} GiB, {figures['memory_slots'] / 2**30:.2f} GiB of them M' of each "
            f"position",
            flush=True,
        )
    long = sorted(n for n in totals if n >= cuda_graphs.TRAINING_CHUNK)  # (same chunk: same fixed buffers)
    if len(long) >= 2:
        per_position = (totals[long[-1]] - totals[long[0]]) / (long[-1] - long[0])
        print(
            f"per segment position {per_position / 2**20:.1f} MiB (M' included), fixed "
            f"{(totals[long[0]] - long[0] * per_position) / 2**30:.2f} GiB"
        )


if __name__ == "__main__":
    main()
