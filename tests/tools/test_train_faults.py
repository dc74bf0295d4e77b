"""`gpn train` under real faults: diverging steps at every clipping setting, SIGTERM / SIGINT sent to a real
`gpn train` process then `--resume` bit-exact, a torn log line, a full disk (a real small tmpfs), a
failed log rewrite, a stuck DDP rank (in training and at the end), changed settings on `--resume`, and two runs
into one folder."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from modeling_gpn import train as train_module

from ..environment import small_disk
from ..subprocesses import process_state, two_at_a_time
from .train_runs import (
    failed_launch_output,
    finish,
    launch,
    launch_two_processes,
    losses,
    parse,
    port_taken_line,
    read_log,
    saved_weights,
    signalled,
    small_args,
    stopped,
    wait_for_step,
)

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")

TRAIN_CLI = [sys.executable, "-m", "gpn_cli", "train"]  # the `gpn` console script's own entry point


def run_train(shakespeare, out, cache, *extra, skip_nonfinite=False, resume=None) -> dict:
    config = train_module.resolve_config(parse(small_args(shakespeare, out, cache, *extra)))
    return train_module.train(config, resume=resume, skip_nonfinite=skip_nonfinite, show_progress=False)


def checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(p.name.split("-")[1]) for p in sorted((run_dir / "checkpoints").glob("step-*"))]


# --------------------------------------------------------------------------------------------------
# Non-finite steps
# --------------------------------------------------------------------------------------------------

# At lr 1e10 step 1 is applied with a finite gradient; step 2's loss is finite (the huge weights saturate)
# but its gradient is NaN: the case `--clip-norm 0` used to apply and checkpoint.
DIVERGING = ("--steps", "6", "--lr", "1e10", "--warmup-steps", "0", "--checkpoint-interval", "1")


@pytest.mark.parametrize("clip", ["0", "1.0", "1e30"])
def test_nonfinite_gradient_is_never_applied_at_any_clipping_setting(tmp_path, cache, shakespeare, clip):
    out = tmp_path / "run"
    with pytest.raises(train_module.NonFiniteLossError) as caught:
        run_train(shakespeare, out, cache, *DIVERGING, "--clip-norm", clip)
    message = str(caught.value)
    assert (
        "Non-finite gradient norm nan at step 2 (of 6); the weights were not updated with it (they hold the "
        "update of step 1)" in message
    ), message
    assert f"the last checkpoint, {out / 'checkpoints' / 'step-0000001'}, is intact" in message
    # The last good checkpoint is kept, holds finite weights, and nothing after it was written.
    assert checkpoint_steps(out) == [1] and not (out / "model").exists()
    weights = saved_weights(out / "checkpoints" / "step-0000001")
    assert all(torch.isfinite(t).all() for t in weights.values())
    events = [r for r in read_log(out) if r.get("event")]
    assert events == [{"step": 2, "event": "nonfinite", "loss": events[0]["loss"], "grad_norm": "nan"}]
    assert float(events[0]["loss"]) < 10  # the loss itself was finite: only the gradient norm catches it

    # --resume from that checkpoint meets the same step again and stops the same way (not a NaN checkpoint).
    with pytest.raises(train_module.NonFiniteLossError, match="at step 2 "):
        run_train(shakespeare, out, cache, *DIVERGING, "--clip-norm", clip, resume=True)


def test_skipped_steps_are_capped_reported_and_a_nonfinite_model_is_never_saved(
    tmp_path, cache, shakespeare, capsys, monkeypatch
):
    # Skips within the cap: reported in the log and the summary; the model (finite, loss finite) is saved.
    out = tmp_path / "skip"
    summary = run_train(
        shakespeare,
        out,
        cache,
        *DIVERGING[:6],
        "--clip-norm",
        "0",
        "--steps",
        "4",
        "--max-skipped-steps",
        "3",
        skip_nonfinite=True,
    )
    assert summary["skipped_steps"] == [2, 3, 4]
    assert "skipped 3 non-finite step(s) of 4: [2, 3, 4]" in capsys.readouterr().out
    log = read_log(out)
    assert [r["step"] for r in log if r.get("event") == "skipped_nonfinite"] == [2, 3, 4]
    # Windows whose every step was skipped log no loss (not a fake 0) and the running count of skips.
    assert [(r["loss"], r["skipped_steps"]) for r in log if "lr" in r][1:] == [(None, 1), (None, 2), (None, 3)]
    assert [r for r in log if r.get("event") == "final"][0]["skipped_at"] == [2, 3, 4]
    weights = saved_weights(out / "model")
    assert all(torch.isfinite(t).all() for t in weights.values())

    # One skip over the cap stops the run (exit 1 from the CLI), naming the count and the cap.
    out = tmp_path / "cap"
    args = small_args(
        shakespeare,
        out,
        cache,
        *DIVERGING[:6],
        "--clip-norm",
        "0",
        "--steps",
        "8",
        "--max-skipped-steps",
        "2",
        "--skip-nonfinite",
    )
    assert train_module.run(parse(args)) == 1
    error = capsys.readouterr().err
    assert "at step 4 (of 8)" in error and "3 skipped steps, more than --max-skipped-steps 2" in error, error
    assert not (out / "model").exists()

    # A run whose skips leave a model with a NaN validation loss exits non-zero and saves nothing. (lr 1e30: the
    # torch-ops steps' folded matrices overflow to a NaN loss, which validation meets on the same steps; the C step
    # kernels, like the plain loop, saturate to a finite one: see test_train.py's test of the NaN loss.)
    monkeypatch.setenv("GPN_STEP_KERNELS", "0")
    out = tmp_path / "nan"
    args = small_args(
        shakespeare, out, cache, "--steps", "4", "--lr", "1e30", "--warmup-steps", "0", "--skip-nonfinite"
    )
    assert train_module.run(parse(args)) == 1
    error = capsys.readouterr().err
    assert "The run ended with a non-finite model (validation loss nan, 3 skipped step(s)); it was not saved" in error
    assert not (out / "model").exists()


def test_an_update_that_makes_the_weights_nonfinite_is_never_checkpointed(tmp_path, cache, shakespeare):
    # eps 0: AdamW divides 0 by 0 for parameters whose gradient is exactly 0 (embeddings of unseen tokens),
    # so step 1's update makes the weights NaN although its loss and gradient are finite.
    out = tmp_path / "eps0"
    with pytest.raises(train_module.NonFiniteLossError) as caught:
        run_train(
            shakespeare, out, cache, "--steps", "3", "--eps", "0", "--checkpoint-interval", "1", skip_nonfinite=True
        )
    assert str(caught.value).startswith("Step 1's update made the weights non-finite (loss ")
    assert "No checkpoint had been written yet" in str(caught.value)
    assert checkpoint_steps(out) == [] and not (out / "model").exists()


# --------------------------------------------------------------------------------------------------
# SIGTERM / SIGINT, torn log, resume bit-exact
# --------------------------------------------------------------------------------------------------


# No periodic checkpoints, and a log window of 3 steps, so the signal's checkpoint alone carries the run (including
# the half-filled log window) across each stop.
STOPPED_RUN = ("--steps", "60", "--checkpoint-interval", "0", "--log-interval", "3")


def _stopped_twice(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> dict:
    """`gpn train` stopped by SIGTERM in step 5, its log's last line then torn, resumed by `gpn train --resume`
    and stopped by SIGINT in step 8 (each signal sent by the process itself on entering the step, `signalled`:
    sent from here once a step was logged, it raced the 60-step run's end); beside them, the uninterrupted run as
    a `gpn train` process: `{"run_dir", "reference", "first", "second"}`, each leg's output, the checkpoints it
    left and whether a model was saved."""
    reference = launch(
        TRAIN_CLI + small_args(shakespeare, folder / "reference", cache, *STOPPED_RUN), folder / "r.log", env
    )
    run_dir = folder / "stopped"
    legs = {}
    # (steps 4 and 5 of a log window of 3, then 7 and 8: each stop carries a half-filled window)
    train = [*signalled(folder, "gpn_cli", "enter:5:SIGTERM"), "train"]
    first = launch(train + small_args(shakespeare, run_dir, cache, *STOPPED_RUN), folder / "1.log", env)
    legs["first"] = (stopped(first, 128 + signal.SIGTERM, 300), checkpoint_steps(run_dir), (run_dir / "model").exists())
    # A torn last line, as a full disk during an append leaves it: --resume skips it with a warning naming the file.
    with open(run_dir / "log.jsonl", "ab") as handle:
        handle.write(b'{"step": 999, "loss": 4.2')
    train = [*signalled(folder, "gpn_cli", "enter:8:SIGINT"), "train"]
    second = launch(train + small_args(shakespeare, run_dir, cache, *STOPPED_RUN, "--resume"), folder / "2.log", env)
    legs["second"] = (
        stopped(second, 128 + signal.SIGINT, 300),
        checkpoint_steps(run_dir),
        (run_dir / "model").exists(),
    )
    finish(reference)
    return {"run_dir": run_dir, "reference": folder / "reference", **legs}


def test_sigterm_and_sigint_checkpoint_at_the_step_boundary_and_resume_bit_exact(launched, cache, shakespeare):
    # The two `gpn train` legs and the uninterrupted run ran in the background (_stopped_twice, FAULT_LAUNCHES).
    run_dir = launched["run_dir"]
    output, [stop_term], saved = launched["first"]
    assert stop_term == 5 and not saved, output[-3000:]
    assert f"stopped by SIGTERM after step {stop_term} of 60; the training state is saved in " in output
    assert "plus --resume" in output

    output, checkpoints, saved = launched["second"]
    assert f"warning: {run_dir / 'log.jsonl'}: line " in output and " is torn " in output, output[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{stop_term:07d}'} at step {stop_term}" in output
    stop_int = checkpoints[-1]
    assert stop_int == 8 and "stopped by SIGINT" in output and not saved, output[-3000:]

    # The rest of the run in this process (the stops above are the CLI's; one import of torch and transformers
    # less on 2 cores).
    run_train(shakespeare, run_dir, cache, *STOPPED_RUN, resume=True)
    reference = launched["reference"]
    expected, actual = saved_weights(reference / "model"), saved_weights(run_dir / "model")
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert losses(run_dir) == losses(reference)  # windows cut by the stops average the same steps
    stops = [r["signal"] for r in read_log(run_dir) if r.get("event") == "stopped"]
    assert stops == ["SIGTERM", "SIGINT"]


def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path, cache, shakespeare):
    run_dir = tmp_path / "run"
    # The first Ctrl-C on entering step 2, the second once that step's loss is logged: inside the step the first
    # one let finish, before its checkpoint. (Sent by the process itself, `signalled`: sent from here once the
    # first was seen received, the second raced the rest of the step, which a busy machine's test thread can miss.)
    train = [*signalled(tmp_path, "gpn_cli", "enter:2:SIGINT", "log:2:SIGINT"), "train"]
    process = launch(train + small_args(shakespeare, run_dir, cache, "--steps", "4"), tmp_path / "run.log")
    output = stopped(process, 128 + signal.SIGINT, 300)
    assert "gpn train: SIGINT received: finishing this step" in output, output[-3000:]
    assert "gpn train: interrupted (Ctrl-C) before a checkpoint could be written" in output, output[-3000:]
    assert [r["step"] for r in read_log(run_dir)] == [1, 2]  # (step 2 finished, then the second Ctrl-C)
    assert not list((run_dir / "checkpoints").glob("step-*"))


def test_ctrl_c_in_the_last_step_finishes_the_run_and_exits_130(tmp_path, cache, shakespeare, monkeypatch, capsys):
    """A SIGINT in the last step (or the final phase: validation, the model's save, the sample) lets the run finish
    and save its model, the quickest way to keep its work; but the signal was then forgotten: `gpn train` exited 0
    after its "SIGINT received: ... stopping" line, so `gpn train ... && gpn push ...` went on, and `gpn study` went
    on to train its next models. The run still finishes; the exit status is the signal's, with one line saying so."""
    from gpn_cli import main
    from modeling_gpn.train.context import TrainingRun

    log = TrainingRun.log

    def ctrl_c_in_the_last_step(run, record):
        log(run, record)
        if record.get("step") == 4 and "loss" in record:
            os.kill(os.getpid(), signal.SIGINT)  # (gpn train's handler: noted, the step finishes)

    monkeypatch.setattr(TrainingRun, "log", ctrl_c_in_the_last_step)
    run_dir = tmp_path / "run"
    assert main(["train", *small_args(shakespeare, run_dir, cache, "--steps", "4")]) == 128 + signal.SIGINT
    err = capsys.readouterr().err
    assert "gpn train: SIGINT received after the last step began: the run finished, its model saved" in err, err
    assert (run_dir / "model" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------------------------
# Crash-safe files and a full disk
# --------------------------------------------------------------------------------------------------


def _checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_full_disk_during_a_checkpoint_names_the_path_and_keeps_the_last_good_one(tmp_path, cache, shakespeare):
    common = ["--steps", "12", "--checkpoint-interval", "4", "--keep-checkpoints", "2", "--lr", "0.01"]
    reference = tmp_path / "reference"
    run_train(shakespeare, reference, cache, *common)
    one_checkpoint = _checkpoint_bytes(reference / "checkpoints" / "step-0000008")
    # Room for the log, the config, tensorboard and one checkpoint, but not for a second one beside it.
    size_kib = int((1.5 * one_checkpoint + 64 * 1024) / 1024)
    with small_disk(tmp_path / "disk", f"{size_kib}k") as disk:
        out = disk / "run"
        with pytest.raises(train_module.StorageError) as caught:
            run_train(shakespeare, out, cache, *common)
        message = str(caught.value)
        assert message.startswith(f"Cannot write {out / 'checkpoints' / 'step-0000008'}: "), message
        assert "No finished work was lost: the last checkpoint, " in message
        assert f"{out / 'checkpoints' / 'step-0000004'}, is intact" in message
        assert checkpoint_steps(out) == [4]
        assert not list((out / "checkpoints").glob(".tmp-*")), "the partial checkpoint was not removed"
        shutil.copytree(out, tmp_path / "rescued")
        log = out / "log.jsonl"
        assert all("step" in json.loads(line) for line in log.read_text().splitlines())  # no torn line
        # The disk filled up completely: an append that does not fit is cut back, never left half-written.
        with contextlib.suppress(OSError), open(disk / "filler", "wb", buffering=0) as filler:
            while True:
                filler.write(b"x" * 4096)
        before = log.read_bytes()
        with pytest.raises(OSError, match="No space left on device"):
            train_module.append_log_record(log, {"step": 13, "note": "y" * 20000})
        assert log.read_bytes() == before
    # The intact checkpoint continues to exactly the uninterrupted run.
    run_train(shakespeare, tmp_path / "rescued", cache, *common, resume=True)
    expected, actual = saved_weights(reference / "model"), saved_weights(tmp_path / "rescued" / "model")
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name


# Python run under a file-size limit (RLIMIT_FSIZE, set before anything is imported): `python -c FILE_SIZE_LIMITED
# BYTES MODULE ARG...` runs MODULE as `python -m MODULE ARG...` would, `... BYTES -c CODE` runs CODE. A write past the
# limit returns a real EFBIG (SIGXFSZ ignored, as CPython does anyway). (Set here rather than in a preexec_fn: these
# processes start in the background pool's threads, where a preexec_fn is unsafe.)
FILE_SIZE_LIMITED = (
    "import resource, runpy, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_FSIZE)[1]))\n"
    "if sys.argv[2] == '-c':\n"
    "    exec(sys.argv[3], {'__name__': '__main__'})\n"
    "else:\n"
    "    sys.argv = sys.argv[2:]\n"
    "    runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)


def _checkpoint_over_a_file_size_limit(
    folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """`gpn train` under a 64 KiB file-size limit, its first checkpoint at step 4: (its run folder, the process)."""
    run_dir = folder / "run"
    argv = [sys.executable, "-c", FILE_SIZE_LIMITED, str(64 * 1024), "gpn_cli", "train"]
    argv += small_args(shakespeare, run_dir, cache, "--steps", "6", "--checkpoint-interval", "4")
    env = dict(env, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return run_dir, subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def test_a_failed_checkpoint_write_is_one_clear_cli_error(launched):
    # Needs no root: a 64 KiB file-size limit on the `gpn train` process makes the first checkpoint's weight
    # file fail with a real EFBIG (_checkpoint_over_a_file_size_limit, in the background).
    run_dir, done = launched
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"gpn train: error: Cannot write {run_dir / 'checkpoints' / 'step-0000004'}: " in done.stderr
    assert "File too large" in done.stderr and "No checkpoint had been written yet" in done.stderr
    assert list((run_dir / "checkpoints").iterdir()) == []  # the partial checkpoint was removed
    assert [r["step"] for r in read_log(run_dir)] == [1, 2, 3, 4]


LOG_RECORDS = [{"step": step, "loss": 5.0 - step / 10} for step in range(1, 41)]
TORN_LOG = "".join(json.dumps(r) + "\n" for r in LOG_RECORDS) + '{"step": 41, "lo'  # torn last line


def _log_rewrite_over_a_file_size_limit(
    folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]
) -> tuple[Path, subprocess.CompletedProcess]:
    """`truncate_log` of TORN_LOG to 20 records in a process under a 200-byte file-size limit, so write() fails with
    EFBIG while the kept records are written: (the log, alone in its folder, and the process)."""
    log = folder / "log.jsonl"
    log.write_text(TORN_LOG)
    code = (
        f"from modeling_gpn.train import truncate_log; from pathlib import Path; truncate_log(Path({str(log)!r}), 20)"
    )
    argv = [sys.executable, "-c", FILE_SIZE_LIMITED, "200", "-c", code]
    return log, subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)


def test_log_rewrite_on_resume_is_write_then_rename(launched):
    # A real write failure while the kept records are written (_log_rewrite_over_a_file_size_limit, in the
    # background): the log is left exactly as it was, no temporary file behind.
    log, failed = launched
    assert failed.returncode == 1 and "OSError: [Errno 27] File too large" in failed.stderr, failed.stderr[-2000:]
    assert log.read_text() == TORN_LOG
    assert [p.name for p in log.parent.iterdir()] == ["log.jsonl"]

    warnings = []
    train_module.truncate_log(log, 20, warn=warnings.append)
    assert train_module.read_log(log) == LOG_RECORDS[:20]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"warning: {log}: line 41 is torn (a write cut short by a crash or a full disk); skipped it (Unterminated"
    )


def test_a_crash_between_the_renames_of_a_replaced_folder_restores_the_old_one(tmp_path):
    root = tmp_path / "checkpoints"
    old, new = root / "step-0000004", root / ".tmp-step-0000004"
    for folder, content in ((old, "old"), (new, "new")):
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(content)
    # The state a crash leaves between install_folder's two renames: the old folder aside, the new one unmoved.
    os.replace(old, root / ".replaced-step-0000004")
    train_module.recover_folders(root)
    assert (old / "trainer_state.json").read_text() == "old" and sorted(p.name for p in root.iterdir()) == [old.name]
    new.mkdir()
    (new / "trainer_state.json").write_text("new")
    train_module.install_folder(new, old)
    assert (old / "trainer_state.json").read_text() == "new" and sorted(p.name for p in root.iterdir()) == [old.name]


# --------------------------------------------------------------------------------------------------
# --resume settings, --ddp-timeout
# --------------------------------------------------------------------------------------------------


def test_resume_refuses_settings_that_change_data_or_optimisation_and_allows_the_rest(tmp_path, cache, shakespeare):
    out = tmp_path / "run"
    common = ["--steps", "6", "--checkpoint-interval", "3"]
    run_train(shakespeare, out, cache, *common)
    assert checkpoint_steps(out) == [3]
    with pytest.raises(ValueError) as caught:
        run_train(
            shakespeare,
            out,
            cache,
            *common,
            "--val-fraction",
            "0.05",
            "--warmup-steps",
            "7",
            "--clip-norm",
            "0.5",
            "--weight-decay",
            "0",
            resume=True,
        )
    message = str(caught.value)
    for change in (
        "val_fraction: 0.02 -> 0.05",
        "warmup_steps: 20 -> 7",
        "clip_norm: 1.0 -> 0.5",
        "weight_decay: 0.1 -> 0",
    ):
        assert change in message, message
    assert "would change the data, the model or the optimisation" in message
    assert changed_settings_of(
        out,
        "--steps",
        "7",
        "--dataset",
        str(out / "train_config.json"),
        "--seq-len",
        "16",
        "--batch-size",
        "4",
        "--lr",
        "0.1",
        "--beta2",
        "0.9",
        "--tokenizer",
        "gpt2",
    ) == ["batch_size", "beta2", "dataset", "lr", "seq_len", "steps", "tokenizer"]
    # A checkpoint holding a NaN (as older versions could write) is refused on resume, naming it.
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    from safetensors.torch import load_file, save_file

    weights_file = damaged / "checkpoints" / "step-0000003" / "model.safetensors"
    weights = load_file(str(weights_file))
    next(iter(weights.values()))[0] = float("nan")
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    with pytest.raises(train_module.NonFiniteLossError, match=r"step-0000003 holds non-finite weights"):
        run_train(shakespeare, damaged, cache, *common, resume=True)
    # Logging, validation, checkpointing, the sample, the micro-batch and the timeout may change.
    first = saved_weights(out / "model")
    run_train(
        shakespeare,
        out,
        cache,
        *common,
        "--log-interval",
        "2",
        "--eval-interval",
        "2",
        "--checkpoint-interval",
        "0",
        "--ddp-timeout",
        "60",
        "--micro-batch-size",
        "8",
        resume=True,
    )
    for name, tensor in saved_weights(out / "model").items():
        assert torch.allclose(tensor, first[name], atol=1e-5), name  # same run, regrouped into one forward pass


def test_a_damaged_checkpoint_file_is_named_with_the_checkpoint_to_resume_from_instead(
    tmp_path, cache, shakespeare, capsys
):
    """A truncated or overwritten file of the newest checkpoint (checkpoints are written whole: only something
    outside the run leaves one so) was a reader's traceback (SafetensorError, torch's zip error) on --resume. It
    is one line naming the file and the older checkpoint, which then resumes."""
    out = tmp_path / "run"
    common = ["--steps", "5", "--checkpoint-interval", "2"]
    run_train(shakespeare, out, cache, *common)
    shutil.rmtree(out / "model")  # (as if the run had been killed after its last checkpoint)
    capsys.readouterr()
    newest, older = out / "checkpoints" / "step-0000004", out / "checkpoints" / "step-0000002"
    for name, error in (("model.safetensors", "SafetensorError"), ("optimizer.bin", "RuntimeError")):
        kept = (newest / name).read_bytes()
        os.truncate(newest / name, 100)  # (a copy cut short)
        assert train_module.run(parse(small_args(shakespeare, out, cache, *common, "--resume"))) == 1
        err = capsys.readouterr().err
        assert f"gpn train: error: --resume: cannot read {newest / name} ({error}: " in err, err
        assert f"the checkpoint {newest} is damaged; resume from another checkpoint with --resume PATH ({older})" in err
        assert "Traceback" not in err and err.count("\n") == 1, err
        (newest / name).write_bytes(kept)
    os.truncate(newest / "optimizer.bin", 100)
    assert train_module.run(parse(small_args(shakespeare, out, cache, *common, "--resume", str(older)))) == 0
    assert (out / "model").exists() and [r["step"] for r in read_log(out) if "lr" in r] == [1, 2, 3, 4, 5]


def test_resume_refuses_a_corpus_that_changed_under_the_same_name(tmp_path, cache, shakespeare):
    """The settings name the corpus, not what it holds: a file cut short (or edited, or a Hub dataset updated)
    under the same name resumed in silence on other training windows and another held-out split. The checkpoint
    keeps the data's fingerprint (token count, a hash of slices spread over the tokens); the same text, tokenized
    anew, still resumes."""
    corpus, text = tmp_path / "corpus.txt", shakespeare.read_text()
    corpus.write_text(text[:120_000])
    out = tmp_path / "run"
    common = ["--steps", "3", "--checkpoint-interval", "2"]
    run_train(corpus, out, cache, *common)
    tokens = json.loads((out / "checkpoints" / "step-0000002" / "trainer_state.json").read_text())["data"]["tokens"]
    shutil.rmtree(out / "model")
    corpus.write_text(text[:100_000])
    with pytest.raises(ValueError) as caught:
        run_train(corpus, out, cache, *common, resume=True)
    message = str(caught.value)
    assert f"the training data ({corpus}): {tokens} -> " in message and "the corpus changed" in message, message
    corpus.write_text(text[:120_000])  # a new file (another cache key): tokenized again, the same tokens
    run_train(corpus, out, cache, *common, resume=True)
    assert (out / "model").exists()


def changed_settings_of(run_dir: Path, *argv: str) -> list[str]:
    saved = json.loads((train_module.latest_checkpoint(run_dir) / "trainer_state.json").read_text())["config"]
    config = train_module.resolve_config(parse(small_args(Path("data.txt"), run_dir, Path("cache"), *argv)))
    return [change.split(":")[0] for change in train_module.changed_settings(saved, config)]


@pytest.fixture(scope="module", autouse=True)
def fault_launches(request, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """The fresh processes of the tests named in FAULT_LAUNCHES (the `gpn train` legs stopped by SIGTERM and SIGINT with
    their uninterrupted reference, the processes under a file-size limit, 2-process DDP runs driven to their fault, the
    watched-stage processes, two runs into one folder), run two at a time in the background from the module's first test
    on: test name -> the future of what that test asserts on. Why: the suite's time on 2 cores. This process's tests
    keep one core busy, and each launch leaves a core idle for seconds (its launcher importing, a stopped rank's
    --ddp-timeout, a watchdog's wait); one after another they took about 50 s of the suite, and so did the stopped legs
    waited on in their own test. Only the launches of the tests selected in this run start. (The second-Ctrl-C run stays
    in its test: run in this pool, it failed once in a run of the whole module, for a reason not seen.)"""
    selected = {item.name for item in request.session.items if item.module is request.module}
    jobs = {test: scenario for test, scenario in FAULT_LAUNCHES.items() if test in selected}
    if not jobs:  # (nor the corpus, which the tests that need it ask for)
        yield {}
        return
    # (the corpus only for the training runs: the watched stages, the log's rewrite and the taken port need none)
    cache, shakespeare = None, None
    if jobs.keys() - {
        test_a_watched_stage_that_hangs_ends_the_process_naming_it_with_every_stack.__name__,
        test_log_rewrite_on_resume_is_write_then_rename.__name__,
        test_a_launch_whose_rendezvous_port_was_taken_starts_again_on_another_and_fails_on_its_own_failure.__name__,
    }:
        cache, shakespeare = request.getfixturevalue("cache"), request.getfixturevalue("shakespeare")
    root = tmp_path_factory.mktemp("fault-launches")
    # The launches' environment, taken here: the tests meanwhile change os.environ (monkeypatch).
    env = dict(os.environ, ACCELERATE_USE_CPU="1")
    with two_at_a_time() as pool:
        futures = {}
        for test, scenario in jobs.items():
            folder = root / test
            folder.mkdir()
            futures[test] = pool.submit(scenario, folder, cache, shakespeare, env)
        yield futures


@pytest.fixture
def launched(request, fault_launches):
    """What this test's launch (FAULT_LAUNCHES) left to assert on, once it has ended."""
    return fault_launches[request.node.name].result()


def _rank_1_stopped_on_entering(
    stage: str, folder: Path, args: list[str], env: dict[str, str], bound: float
) -> tuple[float, str]:
    """A 2-process DDP run of `args` whose rank 1 stops itself (SIGSTOP) on entering `stage` (`signalled`'s WHERE:
    a step number, or the beginning of a stage's name), waited for until rank 0 ends (at most `bound` s after the stop): (the seconds from
    the stop to the end of rank 0 seen here, the launch's output). (Stopped from outside at a moment the test chose
    by polling, the stop raced the run: see the callers.)"""
    pids = folder / "pids"
    pids.mkdir()
    program = signalled(folder, "modeling_gpn.train", f"enter:{stage}:SIGSTOP:1", record=pids)[1:]
    launcher = launch_two_processes(["--multi_gpu"], args, folder / "ddp.log", program=tuple(program), env=env)
    try:
        deadline = time.time() + 180
        rank_1 = pids / "1"
        while not rank_1.exists() or process_state(int(rank_1.read_text() or 0)) != "T":
            assert launcher.poll() is None, launcher.log_path.read_text()[-3000:]
            assert time.time() < deadline, "rank 1 did not stop within 180 s"
            time.sleep(0.1)
        # (the stop's own time: this thread may see it late, which would shorten the wait measured from here)
        stopped_at, rank_0 = float((pids / "signalled_at").read_text()), int((pids / "0").read_text())
        while process_state(rank_0) not in ("X", "Z"):
            assert time.time() - stopped_at < bound, f"rank 0 still waits {bound} s after rank 1 stopped"
            time.sleep(0.1)
        waited = time.time() - stopped_at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        for pid_file in pids.glob("[0-9]*"):  # (each rank has its own process group: the launcher's is not theirs)
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        launcher.wait()
    return waited, launcher.log_path.read_text()


def _stuck_rank_in_training(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> tuple[float, str]:
    """A 2-process DDP run whose rank 1 stops on entering step 3 (`signalled`): (the seconds rank 0 waited
    before it ended, the launch's output). Rank 0 then reaches step 3's first collective after its forward and
    backward, so the stop comes first and rank 0's --ddp-timeout runs from after it. (Stopped from outside once
    step 2 was logged, rank 0 could already wait in a collective for a rank 1 held up on a busy machine, and time
    out less than --ddp-timeout after the stop.)"""
    args = small_args(shakespeare, folder / "ddp", cache, "--steps", "100000", "--ddp-timeout", "5")
    # Rank 0 must give up on its collective after --ddp-timeout and fail; the launcher then tears the job down
    # (after its own grace period for the stopped rank, which this test does not wait for).
    return _rank_1_stopped_on_entering("3", folder, args, env, 60)


def test_a_stuck_ddp_rank_fails_the_job_after_ddp_timeout(launched):
    waited, output = launched
    assert 4 < waited < 40, waited
    assert (
        "gpn train: error: a collective operation timed out after --ddp-timeout 5 s while training step 3:" in output
    ), output[-3000:]


def _ranks(launcher: subprocess.Popen) -> dict[int, int]:
    """LOCAL_RANK -> pid of the launcher's worker processes, looked for until both are seen (at most 60 s): a child
    that `pgrep` lists may have ended before its environment is read (one did in a fresh-clone run), and one that
    is no worker has no LOCAL_RANK."""
    deadline = time.time() + 60
    while True:
        found = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        ranks = {}
        for pid in found:
            with contextlib.suppress(OSError):  # (ended since pgrep listed it)
                environ = Path(f"/proc/{pid}/environ").read_bytes()
                if b"LOCAL_RANK=" in environ:
                    ranks[int(environ.split(b"LOCAL_RANK=")[1].split(b"\0")[0])] = int(pid)
        if sorted(ranks) == [0, 1]:
            return ranks
        assert launcher.poll() is None and time.time() < deadline, (found, ranks)
        time.sleep(0.1)


def _sigterm_to_rank_1(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> tuple[Path, str]:
    """A 2-process DDP run whose rank 1 alone gets SIGTERM after step 2: (its run folder, the launch's output)."""
    run_dir = folder / "ddp"
    launcher = launch_two_processes(
        ["--multi_gpu"], small_args(shakespeare, run_dir, cache, "--steps", "100000"), folder / "ddp.log", env=env
    )
    wait_for_step(launcher, run_dir, 2)
    os.kill(_ranks(launcher)[1], signal.SIGTERM)  # rank 1 only: rank 0 must learn it at the step boundary
    return run_dir, failed_launch_output(launcher)


def test_sigterm_to_one_ddp_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(launched):
    run_dir, output = launched
    [checkpoint] = sorted((run_dir / "checkpoints").glob("step-*"))
    step = int(checkpoint.name.split("-")[1])
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == step
    assert {p.name for p in checkpoint.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}
    assert [r for r in read_log(run_dir) if r.get("event")] == [{"step": step, "event": "stopped", "signal": "SIGTERM"}]
    assert f"stopped by SIGTERM after step {step} of 100000" in output, output[-3000:]


def _launcher_killed(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> Path:
    """A 2-process DDP run whose launcher alone is killed (SIGKILL) after step 2, waited for until its ranks
    end (at most 60 s): its run folder."""
    run_dir = folder / "ddp"
    launcher = launch_two_processes(
        ["--multi_gpu"], small_args(shakespeare, run_dir, cache, "--steps", "100000"), folder / "ddp.log", env=env
    )
    wait_for_step(launcher, run_dir, 2)
    ranks = _ranks(launcher)
    os.kill(launcher.pid, signal.SIGKILL)  # the launcher alone: its ranks are left to themselves
    killed_at = time.time()
    try:
        while any(process_state(pid) not in ("X", "Z") for pid in ranks.values()):
            assert time.time() - killed_at < 60, "the ranks still train 60 s after their launcher was killed"
            time.sleep(0.1)
    finally:
        for pid in ranks.values():  # (each rank has its own process group: the launcher's is not theirs)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    return run_dir


def test_ranks_whose_launcher_is_killed_stop_with_a_checkpoint(launched):
    """A launcher killed outright (kill -9, the OOM killer) cannot stop its ranks: they trained on, orphaned, to
    the end of the run. Each rank now gets SIGTERM when its launcher dies, and stops as SIGTERM stops it."""
    run_dir = launched
    [checkpoint] = sorted((run_dir / "checkpoints").glob("step-*"))
    step = int(checkpoint.name.split("-")[1])
    assert [r for r in read_log(run_dir) if r.get("event")] == [{"step": step, "event": "stopped", "signal": "SIGTERM"}]


# `gpn train` whose rank 1 dies (SIGKILL) inside the checkpoint of step 2, once its own files are written: the main
# process is then in the checkpoint's next barrier.
DIES_IN_A_CHECKPOINT = """
import os, signal, sys
from modeling_gpn.train import checkpoints
from modeling_gpn.train.cli import main

save_training_state = checkpoints.save_training_state

def save_then_die_on_rank_1(accelerator, model, optimizer, scheduler, folder):
    save_training_state(accelerator, model, optimizer, scheduler, folder)
    if accelerator.process_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)

checkpoints.save_training_state = save_then_die_on_rank_1
sys.exit(main())
"""


def _rank_dies_in_a_checkpoint(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> tuple[Path, str]:
    """A 2-process DDP run (DIES_IN_A_CHECKPOINT) whose rank 1 dies inside the checkpoint of step 2: (its run
    folder, the failed launch's output)."""
    script = folder / "dies_in_a_checkpoint.py"
    script.write_text(DIES_IN_A_CHECKPOINT)
    run_dir = folder / "ddp"
    launcher = launch_two_processes(
        ["--multi_gpu"],
        small_args(shakespeare, run_dir, cache, "--steps", "4", "--checkpoint-interval", "2", "--ddp-timeout", "30"),
        folder / "ddp.log",
        program=(str(script),),
        env=env,
    )
    return run_dir, failed_launch_output(launcher)


def test_a_rank_that_dies_inside_a_checkpoint_is_named_not_blamed_on_the_disk(launched):
    # The peer's death reached the main process as gloo's RuntimeError inside the checkpoint, which was
    # reported as a failed write: "Cannot write .../step-0000002: ... Connection reset by peer ... (58392.2 MiB
    # free there)".
    run_dir, output = launched
    errors = [line for line in output.splitlines() if line.startswith("gpn train: error:")]
    assert errors and errors[0].startswith(
        "gpn train: error: another process ended while saving checkpoint step-0000002, so this one stops too"
    ), output[-3000:]
    assert "Cannot write" not in output, output[-3000:]
    assert checkpoint_steps(run_dir) == [] and not list((run_dir / "checkpoints").glob(".tmp-*"))


def _stuck_rank_at_the_end(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> str:
    """A 2-process DDP run whose rank 1 stops on entering its last stage, before the barrier that follows the model's
    save (`signalled`), waited for until rank 0 ends (at most 90 s): the launch's output. (Stopped from outside
    once the final record was logged, the stop raced rank 0's save and sample: a test thread held up for those
    seconds on a busy machine stopped rank 1 after the barrier, and the run ended cleanly: a fresh-clone CI.)"""
    args = small_args(shakespeare, folder / "ddp", cache, "--steps", "3", "--ddp-timeout", "5")
    return _rank_1_stopped_on_entering("waiting for the main process", folder, args, env, 90)[1]


def test_the_end_of_a_ddp_run_is_bounded_by_ddp_timeout_and_names_the_stage(launched):
    # Rank 1 stops once training is over: the barrier rank 0 reaches after saving the model must give up after
    # --ddp-timeout, naming it.
    output = launched
    assert "timed out after --ddp-timeout 5 s while waiting for every process after the model was saved" in output, (
        output[-3000:]
    )


# What bounds the end of the process group and the exit, which no --ddp-timeout covers: a real process that hangs
# inside a watched stage; and beside it (both started at once: each import takes seconds), a process whose stages
# end in time (the next enter, or finish), which the watchdog must leave alone.
HANGS_IN_A_WATCHED_STAGE = (
    "import time\nfrom modeling_gpn.train import RunStage\nstage = RunStage(watchdog_s=2)\n"
    "stage.enter('ending the process group', watch=True)\ntime.sleep(120)\n"
)
WATCHED_STAGES_END_IN_TIME = (
    "import time\nfrom modeling_gpn.train import RunStage\nstage = RunStage(watchdog_s=1)\n"
    "stage.enter('a', watch=True)\nstage.enter('b')\ntime.sleep(2)\nstage.enter('c', watch=True)\n"
    "stage.finish()\ntime.sleep(2)\nprint('done')\n"
)


def _watched_stages(
    folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]
) -> tuple[float, list[subprocess.Popen], list]:
    """HANGS_IN_A_WATCHED_STAGE and WATCHED_STAGES_END_IN_TIME run at once: (the seconds until both ended, the
    two processes, their (stdout, stderr))."""
    started = time.time()
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for code in (HANGS_IN_A_WATCHED_STAGE, WATCHED_STAGES_END_IN_TIME)
    ]
    outputs = [process.communicate(timeout=100) for process in processes]
    return time.time() - started, processes, outputs


def test_a_watched_stage_that_hangs_ends_the_process_naming_it_with_every_stack(launched):
    took, processes, [(hung_out, hung_err), (in_time_out, in_time_err)] = launched
    assert processes[0].returncode == 1 and took < 60, hung_err[-3000:]
    assert "gpn train: error: the run hung while ending the process group: still there after 2 s" in hung_err
    assert 'File "<string>", line 5 in <module>' in hung_err  # the stack of the hanging thread
    assert processes[1].returncode == 0 and in_time_out.strip() == "done", in_time_err


# Each rank of a launch of it touches FOLDER/RANK (FOLDER its argument), waits for every rank's file, then fails on
# its own: exit 3. (Without the wait, the launcher stopped the other ranks at the first exit, and on a loaded machine
# the first exited before the second had started: a test's outcome must not rest on speed.)
TOUCHES_AND_FAILS = """
import os, pathlib, sys, time
folder = pathlib.Path(sys.argv[1])
(folder / os.environ["RANK"]).touch()
deadline = time.monotonic() + 60  # (within the launch's own bound below)
while len(list(folder.iterdir())) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(3)
"""


def _launch_on_a_taken_port(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> dict:
    """A 2-process DDP launch of TOUCHES_AND_FAILS whose first port is taken on purpose (bound here, not listened
    on, as an outgoing connection holds its port: Accelerate's own check, a connect, finds it free), held until the
    launch has ended: `{"taken", "ports", "returncode", "output", "taken_output", "ranks"}`."""
    script, ranks = folder / "touches_and_fails.py", folder / "ranks"
    script.write_text(TOUCHES_AND_FAILS, encoding="utf-8")
    ranks.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        launcher = launch_two_processes(
            ["--multi_gpu"], [str(ranks)], folder / "ddp.log", program=(str(script),), env=env, port=port
        )
        returncode = launcher.wait(timeout=120)
    taken_log = folder / f"ddp.port-{port}-taken.log"
    return {
        "taken": port,
        "ports": launcher.ports,
        "returncode": returncode,
        "output": launcher.log_path.read_text(encoding="utf-8"),
        "taken_output": taken_log.read_text(encoding="utf-8") if taken_log.exists() else None,
        "ranks": sorted(path.name for path in ranks.iterdir()),
    }


def test_a_launch_whose_rendezvous_port_was_taken_starts_again_on_another_and_fails_on_its_own_failure(launched):
    """The tests find a port free and the launcher binds it seconds later: anything on the machine may take it
    meanwhile, and the launch failed before any rank ran. Such a launch (that exact failure, on that port) is
    started again on a new port; a launch that fails otherwise, the ranks' own exit 3 here, is not (`ports` would
    have a third entry: it is started at most 3 times)."""
    result = launched
    port = result["taken"]
    assert result["ports"][0] == port and len(result["ports"]) == 2, result
    assert port_taken_line(port) in result["taken_output"].splitlines(), result["taken_output"]
    assert result["ranks"] == ["0", "1"], result["output"][-3000:]  # (the second attempt ran them)
    assert result["returncode"] != 0 and "address already in use" not in result["output"], result["output"][-3000:]


# The launches of the tests above (test name -> what runs it, given its own folder, the token cache, the corpus and
# the environment), two at a time in the order of the tests (fault_launches); one test below adds its own.
FAULT_LAUNCHES: dict[str, Callable[[Path, Path, Path, dict[str, str]], object]] = {
    test_sigterm_and_sigint_checkpoint_at_the_step_boundary_and_resume_bit_exact.__name__: _stopped_twice,
    test_a_failed_checkpoint_write_is_one_clear_cli_error.__name__: _checkpoint_over_a_file_size_limit,
    test_log_rewrite_on_resume_is_write_then_rename.__name__: _log_rewrite_over_a_file_size_limit,
    test_a_stuck_ddp_rank_fails_the_job_after_ddp_timeout.__name__: _stuck_rank_in_training,
    test_sigterm_to_one_ddp_rank_stops_every_rank_at_the_same_step_with_a_checkpoint.__name__: _sigterm_to_rank_1,
    test_ranks_whose_launcher_is_killed_stop_with_a_checkpoint.__name__: _launcher_killed,
    test_a_rank_that_dies_inside_a_checkpoint_is_named_not_blamed_on_the_disk.__name__: _rank_dies_in_a_checkpoint,
    test_the_end_of_a_ddp_run_is_bounded_by_ddp_timeout_and_names_the_stage.__name__: _stuck_rank_at_the_end,
    test_a_watched_stage_that_hangs_ends_the_process_naming_it_with_every_stack.__name__: _watched_stages,
    test_a_launch_whose_rendezvous_port_was_taken_starts_again_on_another_and_fails_on_its_own_failure.__name__: (
        _launch_on_a_taken_port
    ),
}


# --------------------------------------------------------------------------------------------------
# One writer per run folder
# --------------------------------------------------------------------------------------------------


def _second_run_into_the_same_folder(folder: Path, cache: Path, shakespeare: Path, env: dict[str, str]) -> dict:
    """A `gpn train` run, and once it has logged step 2 a second one into its folder, waited for (at most 120 s);
    then the first run's next step, and the first killed (SIGKILL: the kernel drops its flock, the record of who held
    it stays): `{"run_dir", "first_pid", "second_returncode", "second_output", "first_held_the_lock", "steps",
    "model_saved"}`, the last two read once the first had logged another step."""
    run_dir = folder / "run"
    first = launch(TRAIN_CLI + small_args(shakespeare, run_dir, cache, "--steps", "100000"), folder / "1.log", env)
    try:
        wait_for_step(first, run_dir, 2)
        second = launch(TRAIN_CLI + small_args(shakespeare, run_dir, cache, "--steps", "3"), folder / "2.log", env)
        second.wait(timeout=120)
        first_held_the_lock = first.poll() is None  # (the first runs until killed: a second that waited never ends)
        # (what the second run left: the first run's log goes on from where it was)
        wait_for_step(first, run_dir, max(r["step"] for r in read_log(run_dir)) + 1)
        steps = [r["step"] for r in read_log(run_dir)]
        model_saved = (run_dir / "model").exists()
    finally:
        first.kill()
        first.wait()
    return {
        "run_dir": run_dir,
        "first_pid": first.pid,
        "second_returncode": second.returncode,
        "second_output": second.log_path.read_text(),
        "first_held_the_lock": first_held_the_lock,
        "steps": steps,
        "model_saved": model_saved,
    }


def test_a_second_run_into_the_same_folder_stops_at_once_and_a_killed_runs_lock_is_taken_over(
    launched, cache, shakespeare, capfd
):
    # The first two runs ran in the background (_second_run_into_the_same_folder, FAULT_LAUNCHES).
    run_dir, first_pid, output = launched["run_dir"], launched["first_pid"], launched["second_output"]
    assert launched["second_returncode"] == 1, output[-3000:]
    assert f"is in use by another gpn train run (pid {first_pid} on " in output, output[-3000:]
    assert "__main__.py train --recipe tiny-cpu" in output  # the holder's command (python -m gpn_cli)
    assert launched["first_held_the_lock"]  # it stopped at once, not waiting for the lock (no time bound: a busy
    # machine's imports can take a minute)
    # It wrote nothing: the first run's log goes on, one record per step, and has no model yet.
    steps = launched["steps"]
    assert steps == list(range(1, len(steps) + 1)) and not launched["model_saved"]

    # The third run in this process (the lock is the same in a `gpn train` process; one import of torch and
    # transformers less, seconds of the suite's time on 2 cores).
    capfd.readouterr()
    run_train(shakespeare, run_dir, cache, "--steps", "2")
    output = capfd.readouterr().err
    assert (
        f"taking over the lock of {run_dir} from a run that ended without releasing it (pid {first_pid} on " in output
    ), output[-3000:]
    assert (run_dir / "model").exists()
    assert (run_dir / train_module.RunFolderLock.FILE_NAME).read_text() == ""  # released at the end
    train_module.RunFolderLock(run_dir).acquire().release()  # free again


FAULT_LAUNCHES[test_a_second_run_into_the_same_folder_stops_at_once_and_a_killed_runs_lock_is_taken_over.__name__] = (
    _second_run_into_the_same_folder
)


def test_the_lock_is_held_only_while_train_runs_in_process(tmp_path, cache, shakespeare):
    # `gpn study` trains several models in one process: each run takes its folder's lock and gives it back,
    # also when it fails.
    run_dir = tmp_path / "run"
    holder = train_module.RunFolderLock(run_dir).acquire()
    with pytest.raises(
        train_module.RunFolderInUseError, match=rf"in use by another gpn train run \(pid {os.getpid()} "
    ):
        run_train(shakespeare, run_dir, cache, "--steps", "2")
    holder.release()
    run_train(shakespeare, run_dir, cache, "--steps", "2", "--checkpoint-interval", "1")
    with pytest.raises(FileExistsError):  # a failing run (here: no --resume over a checkpoint) releases it too
        run_train(shakespeare, run_dir, cache, "--steps", "2", "--checkpoint-interval", "1")
    train_module.RunFolderLock(run_dir).acquire().release()


def test_a_lock_a_forked_child_still_holds_after_its_run_released_it_is_waited_for(tmp_path):
    """A flock belongs to the open file, which a process forked while a run held it shares until it execs (the
    tests' background launches fork beside in-process runs): a resume in the same folder right after the run ended
    was refused, "in use by another gpn train run (holder unknown ...)" (a fresh-clone CI). The next run now waits
    while the lock is held with no record of a holder, and takes it once that child lets go; a lock held for longer
    with no record is refused naming both causes."""
    run_dir = tmp_path / "run"
    first = train_module.RunFolderLock(run_dir).acquire()
    # (a child given the lock's file as a forked one has it, gone 0.5 s after the run's release)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"], pass_fds=[first._fd])
    try:
        first.release()
        waited = time.monotonic()
        train_module.RunFolderLock(run_dir).acquire().release()
        assert child.poll() is not None and time.monotonic() - waited < 5
    finally:
        child.kill()
        child.wait()
    lock = train_module.RunFolderLock(run_dir).acquire()
    kept = os.dup(lock._fd)  # (the same open file: the flock stays held once the lock is released)
    lock.release()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(train_module.RunFolderLock, "UNRECORDED_WAIT_S", 0.2)
            with pytest.raises(train_module.RunFolderInUseError, match=r"held no record for 0.2 s: a run that could"):
                train_module.RunFolderLock(run_dir).acquire()
    finally:
        os.close(kept)
    train_module.RunFolderLock(run_dir).acquire().release()


def test_without_flock_the_run_folder_is_not_locked_and_says_so(tmp_path, monkeypatch):
    """Windows has no fcntl (`gpn train` stopped there with ModuleNotFoundError): the run goes on unlocked, one
    warning saying a second run into the folder would not be refused; an unwritable folder is still refused."""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # (import fails: ModuleNotFoundError)
    warned = []
    first = train_module.RunFolderLock(tmp_path / "run").acquire(warned.append)
    train_module.RunFolderLock(tmp_path / "run").acquire(warned.append).release()
    first.release()
    assert len(warned) == 2 and f"{tmp_path / 'run'} is not locked" in warned[0], warned
    (tmp_path / "file").touch()
    with pytest.raises(train_module.StorageError, match="Cannot write the run folder"):
        train_module.RunFolderLock(tmp_path / "file" / "run").acquire(warned.append)


def test_a_quiet_run_prints_no_bar_and_no_warning_at_each_checkpoint(tmp_path, cache, shakespeare, capfd, caplog):
    """--no-progress (show_progress=False) still printed transformers' "Writing model shards" bar when the model
    was saved, and every checkpoint printed Accelerate's "Removed shared tensor {'lm_head.weight'} while saving ...
    check by verifying that you don't receive any warning while reloading" (the tied embedding, stored once)."""
    out = tmp_path / "run"
    run_train(shakespeare, out, cache, "--steps", "3", "--checkpoint-interval", "1")
    printed = "".join(capfd.readouterr())
    assert "model saved to" in printed  # (the run's own output is captured)
    assert "Writing model shards" not in printed and "Removed shared tensor" not in printed, printed[-3000:]
    warned = [record.getMessage() for record in caplog.records]  # (pytest takes the log records from stderr)
    assert not [message for message in warned if "Removed shared tensor" in message], warned
    assert "lm_head.weight" not in saved_weights(out / "checkpoints" / "step-0000002")  # stored once, by gpn train


def test_an_output_folder_that_cannot_be_written_is_one_line(tmp_path, cache, shakespeare, capsys):
    """An --output-dir that cannot be made or written (a read-only file system, no permission; here: under a
    file, which needs no root) was a traceback from the run folder's lock file. It is one line naming the folder."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "run"
    assert train_module.run(parse(small_args(shakespeare, out, cache, "--steps", "2"))) == 1
    err = capsys.readouterr().err
    assert f"gpn train: error: Cannot write the run folder {out} (" in err and "Nothing was written" in err, err
    assert "Traceback" not in err and err.count("\n") == 1, err


def test_the_log_is_strict_json_when_there_is_no_held_out_window(tmp_path, cache, shakespeare, capsys):
    """`--val-fraction 0` (or `--eval-windows 0`) leaves no window to validate on: the final record held a bare
    `NaN`, which is no JSON (jq and JavaScript refuse the line), and the summary printed "validation loss nan,
    perplexity nan". Non-finite numbers are written as strings, like the non-finite events, and the summary says
    there was no validation."""
    out = tmp_path / "run"
    run_train(shakespeare, out, cache, "--steps", "2", "--val-fraction", "0")
    assert "no validation: no held-out windows (--val-fraction 0.0, --eval-windows 8)" in capsys.readouterr().out

    def refuse(constant: str):
        raise ValueError(f"{constant} is no JSON")

    records = [json.loads(line, parse_constant=refuse) for line in (out / "log.jsonl").read_text().splitlines()]
    final = records[-1]
    assert final["event"] == "final" and (final["val_loss"], final["val_ppl"]) == ("nan", "nan"), final


def test_a_finished_run_without_checkpoints_is_not_overwritten_by_a_new_run(tmp_path, cache, shakespeare, capsys):
    """A finished run that kept no checkpoint (`--checkpoint-interval 0`): a second `gpn train` into its folder
    deleted its log at once and replaced its model at the end, without a word. It is refused, naming the model,
    and the finished run is left as it was."""
    out = tmp_path / "run"
    run_train(shakespeare, out, cache, "--steps", "2")
    files = [out / "log.jsonl", out / "train_config.json", out / "model" / "model.safetensors"]
    before = [path.read_bytes() for path in files]
    assert train_module.run(parse(small_args(shakespeare, out, cache, "--steps", "2", "--lr", "0.5"))) == 1
    err = capsys.readouterr().err
    assert f"gpn train: error: {out} already holds the model of a finished run ({out / 'model'})" in err, err
    assert [path.read_bytes() for path in files] == before


def test_an_output_folder_that_is_a_model_or_inside_the_corpus_is_refused_before_anything(
    tmp_path, cache, shakespeare, capsys, monkeypatch
):
    """`--output-dir` naming the corpus folder --dataset reads (or a folder in it): the run wrote its log.jsonl,
    train_config.json and model/ among the documents, which the next run on it read (its --resume refused the
    corpus, changed). Naming a model folder (config.json at its top): the run put a second model and its log in
    it. Both are refused, before the folder is locked or the data tokenized; nothing is written in either. So is a
    glob --dataset that can match files in the output folder, and a corpus inside the output folder."""
    data, model = tmp_path / "data", tmp_path / "model"
    data.mkdir()
    (data / "input.txt").symlink_to(shakespeare)
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    # A glob that can match the run's files (now or once written: none is there yet), and a corpus inside the run's
    # folder, are refused too; `data/*.txt` never reaches into data/run (its `*` matches no folder's files).
    globbed = "data/**/*.txt"
    for dataset, out, needle in [
        (data, data, f"--output-dir {data} is inside the corpus folder --dataset {data}: the run's log.jsonl"),
        (data, Path("data/run"), f"--output-dir data{os.sep}run is inside the corpus folder --dataset {data}"),
        (
            data,
            model,
            f"--output-dir {model} is a model folder (it holds config.json): a run writes a folder of its own",
        ),
        (
            globbed,
            Path("data/run"),
            f"--dataset {globbed} can match files inside --output-dir data{os.sep}run: the run",
        ),
        ("data/*.txt", data, f"--dataset data/*.txt can match files inside --output-dir {data}: the run's log.jsonl"),
        (data / "input.txt", Path("."), f"--dataset {data / 'input.txt'} is inside --output-dir .: the run writes"),
    ]:
        assert train_module.run(parse(small_args(dataset, out, cache, "--steps", "2"))) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"gpn train: error: {needle}") and err.count("\n") == 1, err
    assert [path.name for path in data.iterdir()] == ["input.txt"]
    assert [path.name for path in model.iterdir()] == ["config.json"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "model"]
    from modeling_gpn.data.corpus import glob_reaches

    assert not glob_reaches("data/*.txt", Path("data/run")) and not glob_reaches(globbed, Path("data/.run"))
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "log.txt").write_text("a run's file", encoding="utf-8")
    (data / "link").symlink_to(tmp_path / "elsewhere")  # (`**` follows it into a folder written by a run)
    assert glob_reaches(globbed, tmp_path / "elsewhere") and not glob_reaches("data/*.txt", tmp_path / "elsewhere")


@pytest.mark.parametrize("given", ["missing", "a run folder"])
def test_resume_from_a_path_that_is_no_checkpoint_names_that_path(
    tmp_path, cache, shakespeare, given, capsys, monkeypatch
):
    """`--resume PATH` with a bad PATH said "no complete checkpoint in OUTPUT/checkpoints", a folder it was not
    given; and it said so only after tokenizing the data."""
    from modeling_gpn.train import training

    monkeypatch.setattr(training, "prepare_data", lambda *a, **k: pytest.fail("the data were prepared"))
    path = {"missing": tmp_path / "nowhere", "a run folder": tmp_path}[given]
    found = {"missing": "does not exist", "a run folder": "holds no trainer_state.json"}[given]
    args = parse(small_args(shakespeare, tmp_path / "run", cache, "--resume", str(path)))
    assert train_module.run(args) == 1
    err = capsys.readouterr().err
    assert f"gpn train: error: --resume {path}: no complete checkpoint there (it {found})" in err, err
    assert "run/checkpoints" not in err
