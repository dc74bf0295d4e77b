"""Compile every Triton kernel of the fast path for a GPU, without a GPU: Triton's ahead-of-time compiler
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the ptxas it ships) for a named target, by default sm_90
(H100/H200), with the block sizes the wrappers pick for the 130M GPN+M (d 2496, d_ffn 6656, 15 heads of
128 x 256). The CPU tests run the kernels through Triton's interpreter, which is more lenient than the
compiler (types of loop-carried values, scalar branches, constexpr use): this catches what it lets pass.
These compile unspecialised, as if no pointer or size were a multiple of 16 (the worst case: the tests'
odd sizes), which overstates registers next to the launches below (memory_step: 234 registers against
96 on triton 3.6).

Then, as a GPU would compile them, the launches of one training step (forward and backward) of each 130M
preset (gpn-m-1l-130m, gpn-m-2l-130m, gpn-130m) with float32 and with bf16 weights, at batch 1 and 16
(decoding; the bench): the step runs through `triton_kernels`' own wrappers on CPU tensors, and each
launch goes to the JIT's `run(..., warmup=True)` (compile, do not launch) behind a driver that only names
the target. So the kernels see the wrappers' actual arguments as the JIT's binder specialises them on a
GPU (argument types, 16-byte alignment of pointers and of ints, ints equal to 1), and a keyword argument
a kernel lacks fails here as it would there (the interpreter drops it in silence).

    python benchmarks/triton_compile_check.py [--arch 90] [--json out.json] [--no-steps | --only-steps]
        [--presets NAME,...] [--no-registers]

Prints one line per kernel variant (registers and spills per thread from ptxas -v, shared memory), then
one per distinct compiled launch of the steps, and exits 1 if any fails to compile; spills are reported,
not failed (they cost speed, not correctness). `--no-registers` leaves out the registers and spills (each
report runs ptxas on the kernel again: seconds of a run whose kernels Triton's cache holds; the test asserts
what compiles, not the registers). About 35 s on 2 busy CPU cores with Triton's cache cold, 20 s of it the
steps (`--no-steps` skips them, `--only-steps` compiles nothing else, `--presets` names the presets whose
steps are compiled: the test runs the kernels with one preset's steps beside the two others' steps, two
processes of about equal time on two cores).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: set before torch (which imports triton.language)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from modeling_gpn import triton_jit  # noqa: E402
from modeling_gpn.triton_kernels import VALUE_BLOCK  # noqa: E402

V = VALUE_BLOCK
# the block sizes of the 130M preset (see triton_kernels' wrappers), and flag variants
CASES = {
    "memory_step": [dict(BLOCK_K=128, BLOCK_V=V)],
    "memory_read": [dict(BLOCK_K=128, BLOCK_V=V)],
    "memory_write_backward": [dict(LAYERS=1, BLOCK_K=128, BLOCK_V=V), dict(LAYERS=2, BLOCK_K=128, BLOCK_V=V)],
    "unit_rms": [dict(BLOCK=4096)],
    "ground": [dict(BLOCK=4096)],
    "predict_input": [dict(BLOCK_F=1024, BLOCK_R=1024)],
    "gated_residual": [dict(BLOCK=1024)],
    "predict_layer_backward": [dict(BLOCK=1024, BLOCK_F=1024, BLOCK_R=1024)],
    "memory_read_backward": [dict(BLOCK_K=128, BLOCK_V=V)],
    "memory_gates_backward": [dict(BLOCK_K=128, BLOCK_V=V)],
    "rms_backward": [
        dict(HAS_ACC2=a, HAS_MUL=m, WRITE_Y=y, BLOCK=4096)
        for a, m, y in [(False, False, True), (True, False, True), (False, True, True), (False, False, False)]
    ],
    "ground_gate_backward": [dict(BLOCK=1024)],
}


# with bf16 weights these inputs are a matmul's bf16 output (the kernel upcasts them as it loads)
BF16_INPUTS = {"ground": "Z_FG", "gated_residual": "Y", "predict_layer_backward": "DX", "rms_backward": "DY"}


def signature(kernel, constexprs: dict, bf16: str = "") -> dict:
    """Argument types: upper-case names are float32 pointers (`bf16` a bf16 one), `eps` a float, constexprs
    as given, the rest int32."""
    types = {}
    for name in kernel.arg_names:
        if name == bf16:
            types[name] = "*bf16"
        elif name in constexprs:
            types[name] = "constexpr"
        elif name == "eps":
            types[name] = "fp32"
        elif name.isupper() or name[0].isupper():
            types[name] = "*fp32"
        else:
            types[name] = "i32"
    return types


def ptxas_report(ptx: str, arch: int) -> str:
    """ptxas -v's registers and spills for this PTX, from the ptxas Triton itself runs for `arch` (triton
    3.6 ships two and picks `ptxas`, CUDA 12.8, below sm_100; 3.9 always `ptxas-blackwell`), else the
    newest one shipped that reads it."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    candidates = [folder / "ptxas-blackwell", folder / "ptxas"]
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        candidates.insert(0, Path(get_ptxas(arch).path))
    except Exception:  # noqa: BLE001 (another layout: the shipped ones, newest first)
        pass
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "kernel.ptx"
        source.write_text(ptx)
        for ptxas in candidates:
            if not ptxas.is_file():
                continue
            out = subprocess.run(
                [str(ptxas), f"-arch=sm_{arch}a", "-v", str(source), "-o", str(Path(scratch) / "k.cubin")],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0:
                lines = [line.split("info    : ")[-1].strip() for line in (out.stdout + out.stderr).splitlines()]
                return "; ".join(line for line in lines if "registers" in line or "spill" in line)
    return "ptxas -v unavailable"


def compiled_result(label: str, compiled, seconds: float, arch: int, registers: bool, **identity) -> dict:
    """Print the `[ok]` line of a compiled kernel (warps, shared memory, ptxas -v's registers and spills per
    thread where `registers`, `[SPILLS]` when it reports any) and return its result: `identity` (which kernel,
    which case), then ok, seconds, shared and the ptxas report."""
    usage = ptxas_report(compiled.asm["ptx"], arch) if registers else "registers not reported (--no-registers)"
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", usage)]
    note = "  [SPILLS]" if any(spills) else ""
    shared = compiled.metadata.shared
    print(
        f"[ok] {label}: {seconds:.1f} s, {compiled.metadata.num_warps} warps, shared {shared} B; {usage}{note}",
        flush=True,
    )
    return dict(**identity, ok=True, seconds=seconds, shared=shared, ptxas=usage)


STEP_PRESETS = ("gpn-m-1l-130m", "gpn-m-2l-130m", "gpn-130m")
# decoding, and the bench's batch: an int argument the JIT sees change with the batch (rows x heads) is
# specialised when it is a multiple of 16, a distinct kernel
STEP_BATCHES = (1, 16)


class CompileOnlyDriver:
    """What `JITFunction.run(..., warmup=True)` asks of the active driver, for a GPU that is not here:
    device 0, a null stream and the target. Warm-up compiles and returns the kernel without launching it."""

    def __init__(self, target: GPUTarget):
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def one_step_on_the_wrappers(preset: str, dtype, batches: tuple[int, ...]) -> None:
    """One step forward and backward of `preset` at each of `batches` (weights in `dtype`, the vocabulary cut to
    16: no kernel sees it) through `triton_kernels.step` and `step_backward` on CPU tensors. The weights are
    zeros (no kernel runs, so the values never matter; only shapes, strides, dtypes and alignment do), folded
    once for every batch (folding the 130M weights is most of this check's time on CPU)."""
    import torch

    from modeling_gpn import GPNForCausalLM
    from modeling_gpn import fast_recurrence as fr
    from modeling_gpn.configuration import load_preset

    config = load_preset(preset)
    config.vocab_size = 16
    with torch.device("meta"):
        model = GPNForCausalLM(config)
    model = model.to_empty(device="cpu").to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        core = model.model
        eps = core.config.rms_norm_eps
        w = fr.fold_weights(core)
        transposed = fr.transpose_weights(w)
    for batch in batches:
        one_step(core, w, transposed, eps, batch)


def one_step(core, w, transposed, eps: float, batch: int) -> None:
    """One step forward and backward of `core`, its weights folded (`w`) and transposed, at `batch` rows."""
    import torch

    from modeling_gpn import fast_recurrence as fr
    from modeling_gpn import triton_kernels as tk

    with torch.no_grad():
        s = fr.shapes_of(core, batch)
        c = fr.columns_of(s)
        p, grounded, memory = core.zero_state(batch, torch.device("cpu"))
        state = fr.StepState(p, grounded, fr.key_from_grounded(grounded, w, s, eps), memory)
        u = torch.zeros(batch, 3, s.hidden)[:, 1]  # (a column of a window's inputs, as the fast path passes it)
        saved: dict = {}
        new_state, _ = tk.step(state, u, None, w, s, c, eps, saved, torch.empty_like(memory) if s.memory else None)
        grads = fr.StepState(*(torch.zeros_like(x) for x in new_state))
        if not tk.usable_step_backward(saved, grads, s):
            raise RuntimeError(f"batch {batch}: step_backward would not take this step (it would run the torch ops)")
        weight_grads = fr._WeightGrads(w, s.batch)
        tk.step_backward(
            saved,
            grads,
            transposed,
            s,
            c,
            eps,
            weight_grads,
            torch.empty_like(memory) if s.memory else None,
        )


def compile_step_launches(target: GPUTarget, arch: int, registers: bool, presets: tuple[str, ...]) -> list[dict]:
    """Compile (through the JIT, as on a GPU) every distinct launch of one step forward and backward of each
    of `presets` (of `STEP_PRESETS`), fp32 and bf16 weights; one result per distinct compiled kernel, or per failure (with
    ptxas -v's registers and spills where `registers`)."""
    import torch
    from triton.runtime.driver import driver

    from modeling_gpn import triton_kernels as tk

    kernels = tk._build()
    results, seen = [], set()
    case = ""

    def compile_launch(name: str, grid: int, *args, **meta) -> None:
        """In place of `triton_kernels._launch`: the JIT's own path up to the launch."""
        bf16 = [p for p, a in zip(kernels[name].arg_names, args) if getattr(a, "dtype", None) == torch.bfloat16]
        label = f"{name} {meta}" + (f" {'/'.join(bf16)} bf16" if bf16 else "")
        start = time.perf_counter()
        try:
            compiled = kernels[name].run(*args, grid=(grid,), warmup=True, **meta)
            compiled = compiled.result() if hasattr(compiled, "result") else compiled
        except Exception as error:  # noqa: BLE001 (report every launch, then fail)
            print(f"[FAIL] {case}: {label}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
            results.append(dict(kernel=name, case=case, meta=str(meta), ok=False, error=str(error)[:2000]))
            return
        if compiled.hash in seen:
            return
        seen.add(compiled.hash)
        seconds = time.perf_counter() - start
        results.append(
            compiled_result(
                f"{case}: {label}",
                compiled,
                seconds,
                arch,
                registers,
                kernel=name,
                case=case,
                meta=str(meta),
                bf16=bf16,
            )
        )

    def product_left_undone(x, w, ws=None, name=""):
        """`triton_kernels._product`'s result with its arithmetic left out: no kernel runs here, so of a product
        only its shape, dtype and a fresh allocation (its alignment) reach a launch; the bf16 products of the 130M
        weights were most of this check's time on a CPU without bf16 kernels."""
        if not isinstance(w, torch.Tensor):
            return product(x, w, ws, name)
        if ws is None:
            return torch.zeros(*x.shape[:-1], w.shape[1], dtype=w.dtype)
        return tk._empty(ws, name, x.shape[0], w.shape[1], device=x.device, dtype=w.dtype)

    # (the driver's `_active` None: Triton makes the default when asked)
    launch, product, active = tk._launch, tk._product, getattr(driver, "_active", None)
    driver.set_active(CompileOnlyDriver(target))
    tk._launch, tk._product = compile_launch, product_left_undone
    try:
        for preset in presets:
            for dtype in (torch.float32, torch.bfloat16):
                case = f"{preset} {str(dtype).replace('torch.', '')}"
                try:
                    one_step_on_the_wrappers(preset, dtype, STEP_BATCHES)
                except Exception as error:  # noqa: BLE001 (a wrapper's own failure: report it, go on)
                    print(f"[FAIL] {case}: the step itself: {type(error).__name__}: {str(error)[:2000]}", flush=True)
                    results.append(dict(kernel="(step)", case=case, ok=False, error=str(error)[:2000]))
    finally:
        tk._launch, tk._product = launch, product
        driver.set_active(active)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    parser.add_argument("--json", default=None)
    halves = parser.add_mutually_exclusive_group()
    halves.add_argument("--no-steps", action="store_true", help="skip the launches of the presets' steps")
    halves.add_argument("--only-steps", action="store_true", help="compile only the launches of the presets' steps")
    parser.add_argument("--no-registers", action="store_true", help="leave out ptxas -v's registers and spills")
    parser.add_argument(
        "--presets",
        default=",".join(STEP_PRESETS),
        help=f"the presets whose steps' launches are compiled, comma-separated (default: {','.join(STEP_PRESETS)})",
    )
    args = parser.parse_args()
    presets = tuple(args.presets.split(","))
    if not set(presets) <= set(STEP_PRESETS):
        parser.error(f"--presets takes some of {', '.join(STEP_PRESETS)}, got {args.presets}")
    target = GPUTarget("cuda", args.arch, 32)
    results, failures = [], 0
    for name, variants in ({} if args.only_steps else CASES).items():
        kernel = triton_jit.KERNELS[name]
        cases = [(c, "") for c in variants] + ([(variants[0], BF16_INPUTS[name])] if name in BF16_INPUTS else [])
        for constexprs, bf16 in cases:
            label = f"{name} {constexprs}" + (f" {bf16} bf16" if bf16 else "")
            start = time.perf_counter()
            try:
                source = ASTSource(fn=kernel, signature=signature(kernel, constexprs, bf16), constexprs=constexprs)
                compiled = triton.compile(source, target=target)
            except Exception as error:  # noqa: BLE001 (report every kernel, then fail)
                failures += 1
                print(f"[FAIL] {label}: {type(error).__name__}: {str(error)[:2000]}", flush=True)
                results.append(dict(kernel=name, constexprs=constexprs, ok=False, error=str(error)[:2000]))
                continue
            seconds = time.perf_counter() - start
            results.append(
                compiled_result(
                    label,
                    compiled,
                    seconds,
                    args.arch,
                    not args.no_registers,
                    kernel=name,
                    constexprs=constexprs,
                    bf16=[bf16] if bf16 else [],
                )
            )
    if not args.only_steps:
        print(f"sm_{args.arch}: {len(results) - failures} of {len(results)} kernel variants compiled", flush=True)
    if not args.no_steps:
        step_results = compile_step_launches(target, args.arch, not args.no_registers, presets)
        step_failures = sum(not r["ok"] for r in step_results)
        failures += step_failures
        results += step_results
        print(
            f"sm_{args.arch}: {len(step_results) - step_failures} of {len(step_results)} distinct launches of the "
            f"130M presets' steps compiled ({', '.join(presets)})",
            flush=True,
        )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
