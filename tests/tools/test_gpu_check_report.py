"""What gpu_check.sh and gpu_check.py report about how a device run went, checked without a GPU: the
stage runner's timestamps and stages.tsv (its shell functions, run on `sleep`), and the summary's notes on a
stage that timed out, one skipped, the bench's graphs setting, a failed self-check and a timing that ran on
the torch ops."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess

from ..environment import REPO_ROOT


def gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO_ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_stage_past_its_limit_is_stopped_timed_and_noted_in_the_summary(tmp_path):
    functions = subprocess.run(
        ["sed", "-n", "/^stage_limit() {/,/^skip() {/p", str(REPO_ROOT / "benchmarks" / "gpu_check.sh")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "stage()" in functions and "skip()" in functions
    script = functions + (
        "BUDGET=100; deadline=$((SECONDS + 100)); status=0\n"
        'stage "quick" 5 quick.txt echo hello\n'
        'stage "slow" 1 slow.txt sleep 5\n'
        'skip "last"\n'
    )
    result = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={"RUN": str(tmp_path), "PATH": "/usr/bin:/bin"}
    )
    out = result.stdout
    assert "[stage] quick: start " in out and re.search(r"\[stage\] quick: exit 0 after \d+ s \(limit 5 s\)\n", out)
    assert re.search(r"\[stage\] slow: exit 124 after [12] s \(limit 1 s\): TIMED OUT", out) and "[SKIP] last" in out
    assert (tmp_path / "quick.txt").read_text() == "hello\n"
    rows = [line.split("\t") for line in (tmp_path / "stages.tsv").read_text().splitlines()]
    assert [(r[0], r[4]) for r in rows] == [("quick", "0"), ("slow", "124"), ("last", "-1")]

    (tmp_path / "graphs_in_bench.json").write_text(json.dumps({"setting": "inference", "why": "stage 1b timed out"}))
    (tmp_path / "training_self_checks.json").write_text(
        json.dumps({"cuda bfloat16 (batch 16, ...)": "d p: relative error 0.1"})
    )
    (tmp_path / "bench_16x2048.json").write_text(
        json.dumps(
            {
                "cuda_graphs_setting": "inference",
                "triton_self_checks": {},
                "rows": [
                    {
                        "impl": "fast",
                        "train_tok_s": 1.0,
                        "forward_tok_s": 1.0,
                        "prefill_tok_s": {},
                        "decode_ms": {},
                        "backend": {"train": "torch ops", "forward": "triton kernels, no graphs (9 launches)"},
                    },
                    {"impl": "llama", "train_tok_s": 2.0, "forward_tok_s": 2.0},
                ],
            }
        )
    )
    summary = gpu_check_module().summary(tmp_path)
    notes = "\n".join(summary["notes"])
    assert "stage 'slow' hit its 1 s limit" in notes and "stage 'last' was skipped" in notes
    assert "GPN_CUDA_GRAPHS=inference: stage 1b timed out" in notes
    assert "self-check failures in training_self_checks.json" in notes
    assert "bench_16x2048: the fast path's train ran on torch ops" in notes and "forward ran on" not in notes
    assert summary["backends"]["bench_16x2048"]["fast forward"].startswith("triton kernels")
    assert [stage["stage"] for stage in summary["stages"]] == ["quick", "slow", "last"]


def test_a_stage_that_crashed_after_some_checks_passed_is_not_reported_ok(tmp_path):
    """A stage that dies of an exception (outside the checks' own try, or a CUDA error) exits 1 after printing
    some [ok] lines and no [FAIL]: the summary must say it did not finish, and note the stage's exit code."""
    (tmp_path / "stages.tsv").write_text("correctness + decode timing\t10:00:00\t12\t60\t1\n")
    (tmp_path / "correctness.txt").write_text(
        "[ok] triton importable and the kernels build: yes (10:00:01 +1.0s)\n"
        "[ok] cuda fp32 fast (torch ops) == plain (gpn+m): loss diff 0.00e+00 (10:00:02 +2.0s)\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    summary = gpu_check_module().summary(tmp_path)
    assert summary["correctness"] == "did not finish"
    assert "stage 'correctness + decode timing' exited 1" in "\n".join(summary["notes"])
    # a run that finished with every check passed is "ok"
    (tmp_path / "stages.tsv").write_text("correctness + decode timing\t10:00:00\t12\t60\t0\n")
    (tmp_path / "correctness.txt").write_text("[ok] one (10:00:01 +1.0s)\nall checks passed (10:00:02 +2.0s)\n")
    summary = gpu_check_module().summary(tmp_path)
    assert summary["correctness"] == "ok" and not summary["notes"]


def test_the_dry_run_times_the_decode_step_on_the_route_a_gpu_takes(monkeypatch):
    """`--dry-run-cpu` checks gpu_check's code on CPU: its decode timing must go through the Triton steps and the
    decode graph's code as on a GPU, not through the C one-call decode that only CPU ids take."""
    from modeling_gpn import triton_kernels as tk

    from ..environment import TRITON_INTERPRETER_AT_START, require_environment

    require_environment(TRITON_INTERPRETER_AT_START and tk.available(), "triton's interpreter", "GPN_REQUIRE_TRITON")
    for name in ("GPN_MEMORY_KERNELS", "GPN_TRITON", "GPN_CUDA_GRAPHS"):  # (restored after the test)
        monkeypatch.setenv(name, "auto")
        monkeypatch.delenv(name)
    module = gpu_check_module()
    monkeypatch.setattr(module, "DRY_RUN", True)
    module.cuda_route_on_cpu()
    backends = module.decode_timing("cpu", preset="tiny")["backends"]
    assert backends["model_forward_one_token_ms_graphs_off"].startswith("triton kernels, no graphs"), backends
    # (on CPU the graph path runs its static steps without a capture: Triton launches, no replays)
    assert backends["model_forward_one_token_ms_graphs_on"].startswith("triton kernels"), backends
