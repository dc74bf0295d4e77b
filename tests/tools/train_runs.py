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
from collections.abc import Callable, Mapping
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


# A training program (`python -m MODULE ARGS`) that sends itself signals at named points, the one fault-injection
# wrapper of the tests: `POINT:WHERE:SIGNAL[:RANK]` items, comma-separated. POINT "enter" fires on entering a stage,
# WHERE a step number (the stage "training step N", matched exactly) or the beginning of a stage's name ("waiting for
# the main process"); POINT "log" once step WHERE's loss record is logged. RANK (LOCAL_RANK of a launch, 0 alone)
# limits an item to one process. Each item fires once. With a RECORD folder (not "-"), each process first writes its
# pid to RECORD/LOCAL_RANK, and the time of each signal sent to RECORD/signalled_at, just before it is sent.
# Why from inside: a signal sent from the test once a step was seen in the log raced the run: a test thread held up
# for a second or two on a busy machine let a short run reach its end first (or a step finish, or rank 0 wait in a
# collective already) and the test failed on a correct program. Sent from inside, it is the same signal to the same
# handler (SIGSTOP: the same stopped rank), at a point that no machine's speed moves.
SIGNALS_AT_STAGES = """
import os, runpy, signal, sys, time
from pathlib import Path
from modeling_gpn.train import RunStage
from modeling_gpn.train.context import TrainingRun

spec, record, module = sys.argv[1:4]
sys.argv = [sys.argv[0], *sys.argv[4:]]
rank = os.environ.get("LOCAL_RANK", "0")
pending = []
for item in spec.split(","):
    point, where, name, *only = item.split(":")
    if point not in ("enter", "log") or len(only) > 1:
        sys.exit(f"signals_at_stages: bad item {item!r}: POINT:WHERE:SIGNAL[:RANK], POINT enter or log")
    if not only or only[0] == rank:
        pending.append([point, where, getattr(signal, name)])
if record != "-":
    Path(record, rank).write_text(str(os.getpid()), encoding="utf-8")
enter, log = RunStage.enter, TrainingRun.log


def send(point, matches):
    for item in [item for item in pending if item[0] == point and matches(item[1])]:
        pending.remove(item)
        if record != "-":
            Path(record, "signalled_at").write_text(repr(time.time()), encoding="utf-8")
        os.kill(os.getpid(), item[2])  # (the handler runs before the next line; SIGSTOP stops here)


def stage_matches(name):
    return lambda where: name == f"training step {where}" if where.isdigit() else name.startswith(where)


def enter_then_signal(self, name, watch=False):
    enter(self, name, watch)
    send("enter", stage_matches(name))


def log_then_signal(run, record_):
    log(run, record_)
    if "loss" in record_ and "event" not in record_:
        send("log", lambda where: where == str(record_["step"]))


RunStage.enter, TrainingRun.log = enter_then_signal, log_then_signal
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def signalled(folder: Path, module: str, *signals: str, record: Path | None = None) -> list[str]:
    """The command that runs `python -m module` sending itself `signals` (SIGNALS_AT_STAGES's
    `POINT:WHERE:SIGNAL[:RANK]`), its script written in `folder`, each process's pid and the signal's time written
    in `record` (a folder) when given; the module's arguments follow. (A launch's program: the command without its
    first item, the interpreter.)"""
    script = folder / "signals_at_stages.py"
    script.write_text(SIGNALS_AT_STAGES, encoding="utf-8")
    return [sys.executable, str(script), ",".join(signals), "-" if record is None else str(record), module]


def run_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a launched run gets: `env` (default: this process's environment) with the repository on the
    path and one thread."""
    # PYTHONFAULTHANDLER: a run that hangs dumps every thread's Python stack on the SIGABRT `finish` sends
    return dict(
        os.environ if env is None else env,
        PYTHONPATH=str(REPO_ROOT),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONFAULTHANDLER="1",
    )


def launch(argv: list[str], log: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """`argv` started in its own process group from the repository root, its output to `log` (`.log_path`), in
    `env` (default: this process's environment)."""
    env = run_environment(env)
    handle = open(log, "w", encoding="utf-8")
    process = subprocess.Popen(
        argv, env=env, cwd=REPO_ROOT, stdout=handle, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    process.log_path = log
    return process


def finish(process: subprocess.Popen | RendezvousLaunch, timeout: float = 300) -> str:
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
    port: int | None = None,
) -> RendezvousLaunch:
    """`accelerate launch` of 2 CPU processes with `distribution`'s flags (`--multi_gpu` for DDP, FSDP's),
    running `gpn train` (or `program`, a script that wraps it) with `args` (ACCELERATE_USE_CPU=1 comes from the
    accelerate_on_cpu fixture, or from `env`, which replaces this process's environment as `launch`'s does). Its
    rendezvous is on a free port (`RendezvousLaunch`), `port` the first one tried (default: one found free)."""
    return RendezvousLaunch(
        lambda port: [
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
            str(port),
            *program,
            *args,
        ],
        log,
        env,
        port,
    )


def failed_launch_output(launcher: subprocess.Popen | RendezvousLaunch, timeout: float = 120) -> str:
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
    """A free TCP port on the loopback, for a launch's rendezvous (free now: `RendezvousLaunch` for a launch)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# How many times a launch is started in all, each on a new port, while its rendezvous finds its port taken.
LAUNCH_ATTEMPTS = 3


def port_taken_line(port: int) -> str:
    """The line torch's rendezvous (its TCPStore, in the launcher) ends with when it cannot listen on `port` because
    something else holds it: that exact failure, on that port, and no other."""
    return (
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. "
        f"port: {port}, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
    )


class RendezvousLaunch:
    """`command(port)` (an `accelerate launch` whose rendezvous listens on `port`) launched as `launch` does, on a
    port found free, and started again on a new one when its rendezvous says the port was taken
    (`port_taken_line`), at most `LAUNCH_ATTEMPTS` times in all: the port is free when `free_port` closes its
    probe, and the launcher binds it seconds later, after its imports; anything on the machine may take it meanwhile
    (another test's launch or server, an outgoing connection's ephemeral port). The launcher then fails before any
    rank starts, so nothing of the run exists yet. Any other failure is the run's own: never started again.

    It is waited on as the `subprocess.Popen` of its current attempt (`pid`, `returncode`, `args`, `log_path`, ...
    are that process's); `wait` and `poll`, which see an attempt end, start the next one. An attempt that failed
    on its port leaves its output in `log` with `.port-N-taken` before the suffix; `ports` lists the ports tried."""

    def __init__(
        self, command: Callable[[int], list[str]], log: Path, env: Mapping[str, str] | None, port: int | None = None
    ) -> None:
        self.command, self.log, self.env = command, log, run_environment(env)  # (the same for every attempt)
        self.ports: list[int] = []
        self.process = self._started(port or free_port())

    def _started(self, port: int) -> subprocess.Popen:
        self.ports.append(port)
        return launch(self.command(port), self.log, self.env)

    def _started_again(self) -> bool:
        """Whether the attempt, ended, failed on its port and the next one was started."""
        port = self.ports[-1]
        if self.process.returncode == 0 or len(self.ports) >= LAUNCH_ATTEMPTS:
            return False
        if port_taken_line(port) not in self.log.read_text(encoding="utf-8").splitlines():
            return False
        self.log.replace(self.log.with_name(f"{self.log.stem}.port-{port}-taken{self.log.suffix}"))
        self.process = self._started(free_port())
        return True

    def poll(self) -> int | None:
        """The current attempt's exit status (None: running), the next attempt started if it failed on its port."""
        while self.process.poll() is not None and self._started_again():
            pass
        return self.process.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status of the last attempt, within `timeout` s of now for them all (`subprocess.TimeoutExpired`
        past it, as `Popen.wait` raises it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.process.wait(timeout=None if deadline is None else max(deadline - time.monotonic(), 0))
            if not self._started_again():
                return self.process.returncode

    def __getattr__(self, name: str) -> object:
        return getattr(self.process, name)


def saved_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The tensors of a saved model or checkpoint folder's model.safetensors."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def wait_for_step(process: subprocess.Popen | RendezvousLaunch, run_dir: Path, step: int, timeout: float = 180) -> None:
    """Wait until the launched run has logged `step` (it must still be running, and get there in `timeout` s)."""
    deadline = time.time() + timeout
    while True:
        log = run_dir / "log.jsonl"
        if log.exists() and any(r.get("step", 0) >= step for r in train_module.read_log(log)):
            return
        assert process.poll() is None, f"the run ended early:\n{process.log_path.read_text()[-3000:]}"
        assert time.time() < deadline, f"no step {step} within {timeout} s"
        time.sleep(0.01)


def stopped(process: subprocess.Popen | RendezvousLaunch, expected_code: int, timeout: float = 120) -> str:
    """The output of a launched run that was stopped: it ends with `expected_code` (within `timeout` s), without a
    traceback."""
    process.wait(timeout=timeout)
    output = process.log_path.read_text()
    assert process.returncode == expected_code, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return output
