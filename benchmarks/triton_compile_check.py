"""Compile every Triton kernel of the fast path for a GPU, without a GPU: Triton's ahead-of-time compiler
(TTIR -> TTGIR -> LLVM IR -> PTX -> cubin with the ptxas it ships) for a named target, by default sm_90
(H100/H200), with the block sizes the wrappers pick for the 130M GPN+M (d 2496, d_ffn 6656, 15 heads of
128 x 256). The CPU tests run the kernels through Triton's interpreter, which is more lenient than the
compiler (types of loop-carried values, scalar branches, constexpr use): this catches what it lets pass.

    python benchmarks/triton_compile_check.py [--arch 90] [--json out.json]

Prints one line per kernel (registers and spills per thread from ptxas -v, shared memory) and exits 1 if
any fails to compile; spills are reported, not failed (they cost speed, not correctness).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # compiled kernels: set before torch (which imports triton.language)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import subprocess  # noqa: E402
import tempfile  # noqa: E402
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
    "rms_backward": [dict(HAS_ACC2=a, HAS_MUL=m, WRITE_Y=y, BLOCK=4096) for a, m, y in
                     [(False, False, True), (True, False, True), (False, True, True), (False, False, False)]],
    "ground_gate_backward": [dict(BLOCK=1024)],
}  # fmt: skip


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
    """ptxas -v's registers and spills for this PTX (the newest ptxas Triton ships that reads it)."""
    folder = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "kernel.ptx"
        source.write_text(ptx)
        for name in ("ptxas-blackwell", "ptxas"):
            if not (folder / name).is_file():
                continue
            out = subprocess.run([str(folder / name), f"-arch=sm_{arch}a", "-v", str(source), "-o", str(Path(scratch) / "k.cubin")],
                                 capture_output=True, text=True)  # fmt: skip
            if out.returncode == 0:
                lines = [line.split("info    : ")[-1].strip() for line in (out.stdout + out.stderr).splitlines()]
                return "; ".join(line for line in lines if "registers" in line or "spill" in line)
    return "ptxas -v unavailable"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: H100/H200)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    results, failures = [], 0
    for name, variants in CASES.items():
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
            usage = ptxas_report(compiled.asm["ptx"], args.arch)
            spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", usage)]
            shared = compiled.metadata.shared
            note = "  [SPILLS]" if any(spills) else ""
            print(f"[ok] {label}: {seconds:.1f} s, {compiled.metadata.num_warps} warps, shared {shared} B; {usage}{note}", flush=True)
            results.append(dict(kernel=name, constexprs=constexprs, ok=True, seconds=seconds, shared=shared, ptxas=usage))
    print(f"sm_{args.arch}: {len(results) - failures} of {len(results)} kernel variants compiled", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
