"""Kernel launches per step of the fast path: the torch-ops path (what CUDA ran before the Triton kernels)
against the Triton path, forward and backward, counted on CPU.

A GPU runs one kernel per aten op that computes something (a matmul, an elementwise op, a copy, a
reduction); view and allocation ops (`view`, `slice`, `empty`, ...) launch nothing. So the launches of a
step are counted as the non-view, non-allocating aten ops it dispatches (a `TorchDispatchMode`), plus, on
the Triton path, its Triton kernel launches (counted by `triton_kernels`; the interpreter's own host copies
are not counted). Runs on CPU through Triton's interpreter, no GPU needed:

    TRITON_INTERPRET=1 python benchmarks/launch_counts.py [--layers 1 2] [--json out.json]

Prints one table row per (model, path, direction: forward, backward, and backward of a masked step, one
whose batch holds a padded row) and the ops behind each count; then, per token position
of a whole training window (forward and backward of `GPNRecurrenceFunction`, BPTT segments recomputed),
the launches Python dispatches without the training graphs and with them (`cuda_graphs.TrainingSweep`: each
chunk of steps is one graph replay on CUDA, counted as one launch; what runs outside the chunks, such as the
per-segment copies into the static buffers, is counted op by op).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before torch (which imports triton.language)

import argparse  # noqa: E402
import json  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from modeling_gpn import GPNForCausalLM  # noqa: E402
from modeling_gpn import fast_recurrence as fr  # noqa: E402
from modeling_gpn import triton_kernels as tk  # noqa: E402
from modeling_gpn.bench.models import tiny_config  # noqa: E402

NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach"}


class LaunchCounter(TorchDispatchMode):
    """Counts the aten ops that launch a kernel on a GPU (not views, not allocations), by op name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.paused = 0  # a depth: pauses nest

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and not func.is_view and name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def count(fn, counter_mode: LaunchCounter):
    """aten launches and Triton launches of fn()."""
    real_launch = tk._launch

    def launch(*args, **kwargs):  # the interpreter copies tensors to and from numpy: not launches
        counter_mode.paused += 1
        try:
            return real_launch(*args, **kwargs)
        finally:
            counter_mode.paused -= 1

    tk._launch = launch
    before = tk.launches.copy()
    try:
        with counter_mode:
            fn()
    finally:
        tk._launch = real_launch
    return counter_mode.ops, tk.launches - before


def model_of(layers: int, dtype: torch.dtype) -> GPNForCausalLM:
    torch.manual_seed(0)
    # the tests' tiny shapes, initialised as built (not perturbed: launches do not depend on the weights' values)
    return GPNForCausalLM(tiny_config(num_predict_layers=layers)).to(dtype).eval()


def one_step(model, triton: bool, backward: bool, masked: bool = False):
    """(aten launches, Triton launches) of one forward step, or of one backward step (`backward`); `masked`:
    a step whose first row is padding (as at a padded position of a training batch)."""
    os.environ["GPN_TRITON"] = "1" if triton else "0"
    os.environ["GPN_MEMORY_KERNELS"] = "0"  # the CPU C kernels are not what a GPU runs
    core = model.model
    B = 4
    s = fr.shapes_of(core, B)
    c = fr.columns_of(s)
    eps = core.config.rms_norm_eps
    with torch.no_grad():
        w = fr.fold_weights(core)  # (not prepacked: CUDA never packs)
        p, g, M = (torch.randn(x.shape) for x in core.zero_state(B, torch.device("cpu")))
        state = fr.StepState(p, g, fr.key_from_grounded(g, w, s, eps), M)
        U = torch.randn(B, 3, s.hidden)
        u = U[:, 1]
        # the backends the fast path's dispatcher chooses for a training window of these inputs
        backends = fr.choose_backends(core, U, p, g, M, None, s, needs_grad=True, matmul_dtype=None)
        expected = fr.TRITON if triton else fr.TORCH_OPS
        assert backends.step == backends.step_backward == backends.memory == expected, (
            f"not the path asked for: {backends}"
        )
        step, step_backward = fr.step_functions(backends)
        memory_out = torch.empty_like(M)
        real = torch.arange(B) > 0 if masked else None
        if not backward:
            return count(lambda: step(state, u, real, w, s, c, eps, None, memory_out), LaunchCounter())
        saved = {}
        new_state, _ = step(state, u, real, w, s, c, eps, saved, memory_out)
        wt = fr.transpose_weights(w)
        weight_grads = fr._WeightGrads(w, B)
        grads = fr.StepState(*(torch.randn(x.shape) for x in new_state))
        grad_out = torch.empty_like(M)
        return count(lambda: step_backward(saved, grads, wt, s, c, eps, weight_grads, grad_out), LaunchCounter())


def training_window(model, graphs: bool, batch: int = 2, length: int = 64, segment: int = 32) -> dict:
    """Launches per token position of one training window (the recurrence's forward and backward; BPTT
    segments of `segment` steps, so all but the last are recomputed), on the Triton path without and with the
    training graphs. With graphs, a chunk replay counts as one launch and its contents as none."""
    from modeling_gpn import cuda_graphs

    os.environ.update(GPN_TRITON="1", GPN_MEMORY_KERNELS="0", GPN_CUDA_GRAPHS="1" if graphs else "0")
    core = model.model
    core.config.bptt_segment_length = segment
    core.use_fast_path = True
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randn(batch, length, core.config.hidden_size, generator=generator).requires_grad_(True)
    state = tuple(torch.randn(x.shape, generator=generator) for x in core.zero_state(batch, torch.device("cpu")))

    def call():
        outputs, final, _ = core.recurrence(tokens, state, None)
        results = [outputs, *(x for x in final if x.requires_grad)]
        torch.autograd.backward(results, [torch.ones_like(x) for x in results])

    call()  # the first call makes the static buffers (and on CUDA captures the graphs)
    counter, replays, inside = LaunchCounter(), Counter(), Counter()
    real_run = cuda_graphs.TrainingSweep._run

    def run(self, direction, first, steps):  # one graph replay on CUDA
        replays[direction] += 1
        before = tk.launches.copy()
        counter.paused += 1
        try:
            return real_run(self, direction, first, steps)
        finally:
            counter.paused -= 1
            inside.update(tk.launches - before)

    cuda_graphs.TrainingSweep._run = run
    try:
        aten, triton = count(call, counter)
    finally:
        cuda_graphs.TrainingSweep._run = real_run
    assert bool(replays) == graphs, "the training graphs did not run as asked"
    triton = triton - inside
    total = sum(aten.values()) + sum(triton.values()) + sum(replays.values())
    return dict(
        aten=sum(aten.values()),
        triton=sum(triton.values()),
        replays=sum(replays.values()),
        per_position=total / length,
        ops=dict(aten.most_common()),
    )


def main() -> int:
    # count what a GPU launches: on a CPU whose oneDNN has bf16 kernels the fast path prepacks bf16 step
    # matrices (`PackedMatrix`), which adds reorders and casts a GPU never runs (CUDA never packs)
    fr.PackedMatrix.worthwhile = staticmethod(lambda w, rows=None: False)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="weight dtypes")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--training-window",
        type=int,
        nargs=2,
        default=[64, 32],
        metavar=("LENGTH", "SEGMENT"),
        help="the training window's length and BPTT segment (0 0: skip the training-window counts)",
    )
    args = parser.parse_args()
    if not tk.available():
        raise SystemExit(f"triton unavailable: {tk.unavailable_reason()}")
    if not tk.interpreter_on():
        raise SystemExit("set TRITON_INTERPRET=1 (CPU tensors run through Triton's interpreter)")
    rows, details = [], {}
    for dtype in args.dtypes:
        for layers in args.layers:
            model = model_of(layers, getattr(torch, dtype))
            for direction in ("forward", "backward", "backward, masked"):
                for path in ("torch ops", "triton"):
                    backward, masked = direction != "forward", direction.endswith("masked")
                    aten, triton = one_step(model, path == "triton", backward, masked)
                    total = sum(aten.values()) + sum(triton.values())
                    rows.append(
                        dict(
                            model=f"GPN+M {layers}L",
                            dtype=dtype,
                            direction=direction,
                            path=path,
                            aten=sum(aten.values()),
                            triton=sum(triton.values()),
                            launches=total,
                        )
                    )
                    details[f"{layers}L {dtype} {direction} {path}"] = dict(
                        aten=dict(aten.most_common()), triton=dict(triton)
                    )
    print("| model | weights | step | path | aten launches | Triton launches | launches per step |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['dtype']} | {r['direction']} | {r['path']} | {r['aten']} | {r['triton']} | {r['launches']} |"
        )
    print()
    for key, value in details.items():
        print(f"{key}: aten {value['aten']}  triton {value['triton']}")
    length, segment = args.training_window
    if length:
        training_rows(args, rows, length, segment)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(rows=rows, details=details), f, indent=1)
    return 0


def training_rows(args, rows: list, length: int, segment: int) -> None:
    """The training-window table (appended to `rows`)."""
    print()
    print(
        f"Training window (batch 2 x {length} positions, BPTT segments of {segment}, chunks of 32): launches per position"
    )
    print("| model | weights | training graphs | aten | Triton | graph replays | launches per position |")
    print("|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        for layers in args.layers:
            for graphs in (False, True):
                model = model_of(layers, getattr(torch, dtype))
                r = training_window(model, graphs, length=length, segment=segment)
                rows.append(dict(model=f"GPN+M {layers}L", dtype=dtype, training_graphs=graphs, **r))
                print(
                    f"| GPN+M {layers}L | {dtype} | {'on' if graphs else 'off'} | {r['aten']} | {r['triton']} | "
                    f"{r['replays']} | {r['per_position']:.2f} |",
                    flush=True,
                )
                if graphs:
                    print(f"    outside the chunks: {r['ops']}")


if __name__ == "__main__":
    raise SystemExit(main())
