"""Real `gpn train` runs for the tests: the arguments of a few-second run of the tiny preset, its log and
losses, a run launched as a separate process (its output in a log file, its whole process group stopped
with every Python stack printed should it hang), and the waits on it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from modeling_gpn import train as train_module

from ..environment import REPO_ROOT


def parse(argv: list[str]) -> argparse.Namespace:
    """`gpn train`'s arguments parsed from `argv`."""
    parser = argparse.ArgumentParser()
    train_module.add_arguments(parser)
    return parser.parse_args(argv)


def small_args(data: Path, out: Path, cache: Path, *extra: str) -> list[str]:
    """A few-second run of the tiny preset: 512-token BPE, 32-token windows, one thread."""
    return [
        "--recipe",
        "tiny-cpu",
        "--dataset",
        str(data),
        "--bpe-vocab-size",
        "512",
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--eval-windows",
        "8",
        "--log-interval",
        "1",
        "--eval-interval",
        "0",
        "--checkpoint-interval",
        "0",
        "--sample-tokens",
        "0",
        "--num-threads",
        "1",
        "--output-dir",
        str(out),
        "--cache-dir",
        str(cache),
        "--no-progress",
        "--no-loss-figure",  # (drawing costs ~0.3 s a run, ~0.8 s with matplotlib's import: one test draws it)
        *extra,
    ]


def read_log(run_dir: Path) -> list[dict]:
    """The records of a run's log.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines() if line]


def losses(run_dir: Path) -> list[float]:
    """The training losses a run logged, one per logged step (events left out)."""
    return [r["loss"] for r in read_log(run_dir) if "loss" in r and "event" not in r]


def launch(argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """`argv` started in its own process group from the repository root, its output to `log` (`.log_path`), in
    `env` (default: this process's environment)."""
    # PYTHONFAULTHANDLER: a run that hangs dumps every thread's Python stack on the SIGABRT `finish` sends
    env = dict(
        os.environ if env is None else env,
        PYTHONPATH=str(REPO_ROOT),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONFAULTHANDLER="1",
    )
    handle = open(log, "w", encoding="utf-8")
    process = subprocess.Popen(
        argv, env=env, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    process.log_path = log
    return process


def finish(process: subprocess.Popen, timeout: float = 300) -> str:
    """The output of a launched run that must end within `timeout` s and succeed (a hang fails the test with
    every process's stack)."""
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGABRT)  # every process of the run prints where it hangs
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # (the whole group may be gone already)
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        pytest.fail(f"{process.args} ran over {timeout} s:\n{process.log_path.read_text()[-12000:]}")
    output = process.log_path.read_text()
    assert process.returncode == 0, output[-4000:]
    return output


def launch_two_processes(
    distribution: list[str],
    args: list[str],
    log: Path,
    program: tuple[str, ...] = ("-m", "modeling_gpn.train"),
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """`accelerate launch` of 2 CPU processes with `distribution`'s flags (`--multi_gpu` for DDP, FSDP's),
    running `gpn train` (or `program`, a script that wraps it) with `args` (ACCELERATE_USE_CPU=1 comes from the
    accelerate_on_cpu fixture, or from `env`, which replaces this process's environment as `launch`'s does)."""
    return launch(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *distribution,
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            *program,
            *args,
        ],
        log,
        env,
    )


def failed_launch_output(launcher: subprocess.Popen, timeout: float = 120) -> str:
    """Wait for a launch that must fail by itself (its process group killed whatever happens, so no rank
    outlives the test), and give its output after checking it ended with an error."""
    try:
        launcher.wait(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    output = launcher.log_path.read_text()
    assert launcher.returncode != 0, output[-3000:]
    return output


def free_port() -> int:
    """A free TCP port on the loopback, for a launch's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def saved_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved model or checkpoint folder's model.safetensors."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def wait_for_step(process: subprocess.Popen, run_dir: Path, step: int, timeout: float = 180) -> None:
    """Wait until the launched run has logged `step` (it must still be running, and get there in `timeout` s)."""
    deadline = time.time() + timeout
    while True:
        log = run_dir / "log.jsonl"
        if log.exists() and any(r.get("step", 0) >= step for r in train_module.read_log(log)):
            return
        assert process.poll() is None, f"the run ended early:\n{process.log_path.read_text()[-3000:]}"
        assert time.time() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.01)


def stopped(process: subprocess.Popen, expected_code: int) -> str:
    """The output of a launched run that was stopped: it ends with `expected_code`, without a traceback."""
    process.wait(timeout=120)
    output = process.log_path.read_text()
    assert process.returncode == expected_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return output
