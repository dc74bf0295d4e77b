"""The training loop: `fit` runs the optimizer steps, `training_step` is one of them, `validate` scores the
held-out windows.

A step whose loss or gradient norm is NaN/inf is never applied (the norm is computed at every clipping
setting); with `--skip-nonfinite` it is skipped and counted, at most `--max-skipped-steps` times
(`skip_or_stop_on_nonfinite`), and an update that makes the weights non-finite stops the run
(`refuse_nonfinite_weights`). Between steps: the log window, validation, checkpoints, and a stop asked by
SIGTERM / SIGINT, agreed by every process at the step boundary.
"""

from __future__ import annotations

import contextlib
import gc
import math
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

from .checkpoints import save_checkpoint
from .context import TrainingRun
from .distributed import all_finite, stop_requested
from .errors import NonFiniteLossError, TrainingStopped
from .run_folder import intact
from .stop_signals import StopSignals


@dataclass
class LogWindow:
    """The steps since the last log record: when they started, how many tokens they read, and the seconds spent
    meanwhile between steps (validation, checkpoints), which are no training and are left out of its tokens/s."""

    started: float
    tokens: int = 0
    paused: float = 0.0


def fit(run: TrainingRun, stop: StopSignals) -> None:
    """Train from `run.start_step` to the last step. After an error the process group is ended (watched) first."""
    from tqdm.auto import tqdm

    run.model.train()
    bar = tqdm(
        total=run.steps,
        initial=run.start_step,
        desc="training",
        disable=not (run.main and run.show_progress),
        dynamic_ncols=True,
    )
    already_skipped = set(run.skipped_steps)
    run.last_applied = next((s for s in range(run.start_step, 0, -1) if s not in already_skipped), 0)
    window = LogWindow(started=time.perf_counter())
    try:
        for step in range(run.start_step, run.steps):
            done = step + 1
            run.stage.enter(f"training step {done}")
            loss, grad_norm, lr, finite = training_step(run, step)
            bar.update(1)
            window.tokens += run.tokens_per_step
            if finite:
                run.running.append(loss)
            if done % max(1, run.config["log_interval"]) == 0 or done == run.steps:
                log_window(run, done, lr, grad_norm, window, bar)
                window = LogWindow(started=time.perf_counter())
            paused = time.perf_counter()
            between_steps(run, done, stop, bar)
            window.paused += time.perf_counter() - paused
    except BaseException:
        bar.close()
        end_process_group(run, after_error=True)
        raise
    bar.close()


def training_step(run: TrainingRun, step: int) -> tuple[float, float, float, bool]:
    """Optimizer step `step` (0-based): forward and backward over this process's micro-batches, the global
    gradient norm (clipped), the update unless the loss or the norm is non-finite, then the schedule.
    Returns (loss, gradient norm, learning rate, whether the step was finite)."""
    import torch

    # (No local name for the model: a traceback through this frame would keep the DDP wrapper alive past
    # `end_process_group`, which must free it while the process group is alive.)
    accelerator, done = run.accelerator, step + 1
    local_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    first_row = accelerator.process_index * run.micro * run.accumulation
    for k in range(run.accumulation):
        lo = first_row + k * run.micro
        batch = torch.from_numpy(run.windows.batch(step, run.config["batch_size"], lo, lo + run.micro)).to(
            accelerator.device
        )
        sync = contextlib.nullcontext() if k == run.accumulation - 1 else accelerator.no_sync(run.model)
        with sync:
            loss = run.model(input_ids=batch, labels=batch, **run.forward_kwargs(batch)).loss
            accelerator.backward(loss / run.accumulation)
        local_loss += loss.detach().double() / run.accumulation
    loss = float(accelerator.reduce(local_loss, reduction="mean"))
    # The norm is computed at every clipping setting (clip_norm 0 = an infinite threshold, which scales the
    # gradient by exactly 1), so a NaN/inf gradient is caught even when nothing is clipped.
    grad_norm = accelerator.clip_grad_norm_(run.model.parameters(), run.config["clip_norm"] or math.inf)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2
    lr = run.optimizer.param_groups[0]["lr"]
    finite = math.isfinite(loss) and math.isfinite(grad_norm)
    if finite:
        run.optimizer.step()
        refuse_nonfinite_weights(run, done, loss, grad_norm, lr)
        run.last_applied = done
    elif accelerator.scaler is not None and math.isfinite(loss):
        # fp16: an overflowing gradient is the GradScaler's normal business: its step skips the update and
        # lowers the scale (the weights are not touched).
        run.optimizer.step()
        run.log({"step": done, "event": "fp16_overflow", "grad_norm": str(grad_norm)})
    else:
        skip_or_stop_on_nonfinite(run, done, loss, grad_norm)
    run.optimizer.zero_grad(set_to_none=True)
    run.scheduler.step()
    return loss, grad_norm, lr, finite


def refuse_nonfinite_weights(run: TrainingRun, done: int, loss: float, grad_norm: float, lr: float) -> None:
    """After an update from a finite loss and gradient: stop if it made the weights non-finite (a too high
    learning rate, AdamW's eps 0 on a zero gradient), before anything is written with them."""
    if all_finite(run.accelerator, run.model.parameters()):
        return
    run.log({"step": done, "event": "nonfinite_weights", "loss": loss, "grad_norm": grad_norm})
    raise NonFiniteLossError(
        f"Step {done}'s update made the weights non-finite (loss {loss:.4g}, gradient norm {grad_norm:.4g}, "
        f"learning rate {lr:.3g}): lower --lr (or raise --eps). Nothing was written with these weights. "
        f"{intact(run.run_dir)}"
    )


def skip_or_stop_on_nonfinite(run: TrainingRun, done: int, loss: float, grad_norm: float) -> None:
    """A step whose loss or gradient norm is NaN/inf, not applied: logged, then the run stops
    (NonFiniteLossError) unless --skip-nonfinite allows one more skip under --max-skipped-steps."""
    what = f"loss {loss}" if not math.isfinite(loss) else f"gradient norm {grad_norm}"
    held = f"the update of step {run.last_applied}" if run.last_applied else "their initial values"
    message = (
        f"Non-finite {what} at step {done} (of {run.steps}); the weights were not updated with it (they hold {held})."
    )
    run.log(
        {
            "step": done,
            "event": "nonfinite" if not run.skip_nonfinite else "skipped_nonfinite",
            "loss": str(loss),
            "grad_norm": str(grad_norm),
        }
    )
    if not run.skip_nonfinite:
        raise NonFiniteLossError(
            f"{message} Lower --lr, check the data, resume from the last checkpoint with --resume, or pass "
            f"--skip-nonfinite to skip such steps. {intact(run.run_dir)}"
        )
    run.skipped_steps.append(done)
    cap = run.config["max_skipped_steps"]
    if len(run.skipped_steps) > cap:
        raise NonFiniteLossError(
            f"{message} That is {len(run.skipped_steps)} skipped steps, more than --max-skipped-steps {cap}: the "
            f"run is diverging (lower --lr). {intact(run.run_dir)}"
        )
    run.say(f"{message} Skipping this step (--skip-nonfinite; {len(run.skipped_steps)} skipped so far).")


def log_window(run: TrainingRun, done: int, lr: float, grad_norm: float, window: LogWindow, bar: tqdm) -> None:
    """The log record of the steps since the last one: mean loss, learning rate, gradient norm, speed (the
    window's tokens over its training time: a validation or checkpoint inside it once made a step look slow)."""
    elapsed = time.perf_counter() - window.started - window.paused
    # A window whose steps were all skipped has no loss (null), not a loss of 0.
    window_loss = sum(run.running) / len(run.running) if run.running else None
    record = {
        "step": done,
        "loss": window_loss,
        "lr": lr,
        "grad_norm": grad_norm if math.isfinite(grad_norm) else str(grad_norm),
        "tokens": done * run.tokens_per_step,
        "tokens_per_s": window.tokens / elapsed,
        "skipped_steps": len(run.skipped_steps),
    }
    run.log(record)
    bar.set_postfix(
        loss=f"{window_loss:.3f}" if run.running else "-", lr=f"{lr:.2e}", tok_s=f"{record['tokens_per_s']:.0f}"
    )
    run.running = []


def between_steps(run: TrainingRun, done: int, stop: StopSignals, bar: tqdm) -> None:
    """At the boundary after step `done` (not the last): validate and checkpoint when due, and stop (with a
    checkpoint of this step) when a signal asked, on any process."""
    config, steps = run.config, run.steps
    if config["eval_interval"] and done % config["eval_interval"] == 0 and done != steps:
        val_loss = validate(run)
        run.log({"step": done, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
        if run.main:
            bar.write(f"step {done}: validation loss {val_loss:.4f}, perplexity {math.exp(min(val_loss, 50)):.2f}")
    saved = False
    if config["checkpoint_interval"] and done % config["checkpoint_interval"] == 0 and done != steps:
        save_checkpoint(run, done)
        saved = True
    signum = stop_requested(run.accelerator, stop.received) if done != steps else None
    if signum:
        checkpoint = run.checkpoints_dir / f"step-{done:07d}" if saved else save_checkpoint(run, done)
        run.log({"step": done, "event": "stopped", "signal": signal.Signals(signum).name})
        raise TrainingStopped(signum, done, steps, checkpoint)


def validate(run: TrainingRun) -> float:
    """Mean next-token loss over the first `eval_windows` held-out windows, shared out over the processes
    (NaN when there are none)."""
    import numpy as np
    import torch

    accelerator, world, micro = run.accelerator, run.world, run.micro
    run.model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    evaluated = min(run.config["eval_windows"], run.windows.num_val)
    indices = list(range(evaluated))[accelerator.process_index :: world]
    # Every process makes the same number of forward calls: under FSDP each call gathers the weights from all
    # of them, so a process with a window fewer would leave the others waiting at the end. A process out of
    # windows evaluates window 0 and weighs it 0.
    calls = math.ceil(math.ceil(evaluated / world) / micro)
    with torch.no_grad():
        for call in range(calls):
            chosen = indices[call * micro : (call + 1) * micro]
            rows = np.stack([run.windows.val_window(i) for i in chosen or [0]])
            batch = torch.from_numpy(rows).to(accelerator.device)
            loss = run.model(input_ids=batch, labels=batch, **run.forward_kwargs(batch)).loss
            count = len(chosen) * (batch.shape[1] - 1)
            total += torch.tensor([loss.item() * count, count], dtype=torch.float64, device=accelerator.device)
    total = accelerator.reduce(total, reduction="sum")
    run.model.train()
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")


def end_process_group(run: TrainingRun, after_error: bool) -> None:
    """Close the trackers and destroy the process group, watched: after an error the other processes may
    still be inside a collective, and destroying a group under them can wait for ever (torchtitan#1342)."""
    failed_in = run.stage.name
    run.stage.enter("ending the process group" + (" after an error" if after_error else ""), watch=True)
    # The DDP wrapper's Reducer holds the process group: freed only after the group was destroyed, its gloo
    # threads were joined in ~ProcessGroupGloo with the GIL held, where a run was seen to hang (1 in 110 loop
    # runs: rank 1 there, rank 0 gone). So the wrapper and the optimizer go first, while the group is alive
    # (`run` holds the only references), then the group ends.
    run.model = run.optimizer = None
    run.accelerator.free_memory()
    gc.collect()
    run.accelerator.end_training()
    # Still watched until train() returns: anything left that joins threads at the end is bounded.
    if after_error:
        run.stage.name = failed_in  # the error names where the run failed, not its clean-up
