"""The Triton kernels compile for a GPU (sm_90, H100/H200) without one: Triton's ahead-of-time compiler is
stricter than the interpreter the other Triton tests run on (loop-carried types, scalar branches,
constexprs, keyword arguments a kernel lacks), so this catches what they let pass: every kernel with the
130M preset's block sizes, then every launch of a training step of the 130M presets as the JIT specialises
it on a GPU. Runs benchmarks/triton_compile_check.py in a fresh process (it needs TRITON_INTERPRET=0
before torch imports triton; the test session has it on)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ..environment import REPO_ROOT

KERNEL_NAMES = (
    "memory_step",
    "memory_read",
    "memory_write_backward",
    "unit_rms",
    "ground",
    "predict_input",
    "gated_residual",
    "predict_layer_backward",
    "memory_read_backward",
    "memory_gates_backward",
    "rms_backward",
    "ground_gate_backward",
)


@pytest.mark.slow
def test_every_triton_kernel_compiles_for_sm90():
    try:
        import triton  # noqa: F401
    except ImportError as error:
        if os.environ.get("GPN_REQUIRE_TRITON") == "1":
            pytest.fail(f"triton unavailable: {error}")
        pytest.skip(f"triton unavailable: {error}")
    env = dict(os.environ, TRITON_INTERPRET="0")
    script = [sys.executable, str(REPO_ROOT / "benchmarks" / "triton_compile_check.py"), "--arch", "90"]
    # Two processes of about equal time side by side (the suite's other tests wait meanwhile: one process a
    # core): the kernels with the steps of one preset, and the steps of the two others. Without ptxas -v's
    # registers, which this test does not read (each report runs ptxas again).
    halves = [
        subprocess.Popen(
            [*script, *half, "--no-registers"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=REPO_ROOT,
        )
        for half in (["--presets", "gpn-130m"], ["--only-steps", "--presets", "gpn-m-1l-130m,gpn-m-2l-130m"])
    ]
    (kernels, kernels_err), (steps_out, steps_err) = (half.communicate(timeout=600) for half in halves)
    for half, out, err in zip(halves, (kernels, steps_out), (kernels_err, steps_err)):
        assert half.returncode == 0, out[-4000:] + err[-4000:]
    assert "[FAIL]" not in kernels and "20 of 20 kernel variants compiled" in kernels, kernels
    # the launches of the 130M presets' steps, through the JIT's binder as on a GPU: every kernel among them
    compiled = set()
    for out in (kernels, steps_out):
        steps = re.search(r"(\d+) of (\d+) distinct launches of the 130M presets' steps compiled", out)
        assert steps and steps.group(1) == steps.group(2) and "[FAIL]" not in out, out[-4000:]
        compiled |= {line.split(": ")[1].split(" ")[0] for line in out.splitlines() if line.startswith("[ok] gpn")}
    assert compiled == set(KERNEL_NAMES), compiled
