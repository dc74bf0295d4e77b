"""Checkpoints: the full training state, in one layout for one process, DDP and FSDP, saved, rotated and resumed.

A checkpoint folder (`checkpoints/step-NNNNNNN/`) holds the full (unsharded) training state in the layout a
single process or DDP run of Accelerate writes with `save_state`, whatever wrote it: so a checkpoint of an
FSDP run resumes in one process or under DDP and back. Accelerate's own FSDP checkpoints are sharded per
process count instead. `trainer_state.json` (the step, the settings, the skipped steps and the unfinished
log window) is written last: a folder without it is not a checkpoint.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    import torch
    from accelerate import Accelerator
    from torch import nn

    from modeling_gpn.data import TokenStream

from .context import TrainingRun
from .distributed import all_finite, collective_error, is_fsdp
from .errors import NonFiniteLossError, ResumeMismatchError
from .run_folder import (
    REPLACED_PREFIX,
    fsync_tree,
    install_folder,
    intact,
    latest_checkpoint,
    storage_error,
    write_errors,
    write_file_atomically,
)
from .settings import changed_settings, read_json

MODEL_FILE = "model.safetensors"  # the full weights (a tied copy stored once)
OPTIMIZER_FILE = "optimizer.bin"  # torch.optim's state_dict: parameters numbered in the param groups' order
SCHEDULER_FILE = "custom_checkpoint_0.pkl"  # the LR schedule (Accelerate's name for a registered object)
SCALER_FILE = "scaler.pt"  # fp16's GradScaler
RNG_FILE = "random_states_{}.pkl"  # per process: python, numpy, torch (and CUDA) generators


def save_checkpoint(run: TrainingRun, step: int) -> Path:
    """The full training state at `step`, written to a temporary folder, fsynced, then renamed; older
    checkpoints are rotated away only after that. Never written with non-finite weights or optimizer state.
    Every process calls this (FSDP gathers the shards)."""
    accelerator, checkpoints_dir = run.accelerator, run.checkpoints_dir
    final, tmp = checkpoints_dir / f"step-{step:07d}", checkpoints_dir / f".tmp-step-{step:07d}"
    run.stage.enter(f"saving checkpoint {final.name}")
    if not all_finite(accelerator, run.model.parameters()) or not all_finite(accelerator, _optimizer_tensors(run)):
        raise NonFiniteLossError(
            f"Refusing to write checkpoint {final}: the weights or the optimizer state hold non-finite values. "
            + intact(run.run_dir)
        )
    try:
        if run.main:
            shutil.rmtree(tmp, ignore_errors=True)
            checkpoints_dir.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        save_training_state(accelerator, run.model, run.optimizer, run.scheduler, tmp)
        accelerator.wait_for_everyone()
        if run.main:
            trainer_state = {
                "step": step,
                "config": run.config,
                "data": data_fingerprint(run.stream),
                "skipped_steps": run.skipped_steps,
                "running_losses": run.running,
            }
            write_file_atomically(tmp / "trainer_state.json", json.dumps(trainer_state, default=str))
            fsync_tree(tmp)
            install_folder(tmp, final)
            for old in sorted(checkpoints_dir.glob("step-*"))[: -max(1, run.config["keep_checkpoints"])]:
                if old != final:
                    shutil.rmtree(old, ignore_errors=True)
    except write_errors() as error:
        if run.main:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial checkpoint took
        # gloo / NCCL report a process that died (or stopped) inside the checkpoint's collectives as a
        # RuntimeError too: that is no failed write, and "Cannot write ... (N MiB free there)" would send the
        # user to the disk.
        failure = collective_error(error, run.stage.name, run.config["ddp_timeout"]) if run.world > 1 else None
        if failure is not None:
            raise failure from error
        raise storage_error(run.run_dir, final, error) from error
    accelerator.wait_for_everyone()
    return final


# The data a checkpoint was trained on, compared on --resume: the settings name the corpus, not what it holds,
# and a file edited (or a Hub dataset updated) under the same name would resume on other windows.
FINGERPRINT_SLICES, FINGERPRINT_SLICE_TOKENS = 64, 256


def data_fingerprint(stream: TokenStream) -> dict:
    """The token count and a SHA-256 of `FINGERPRINT_SLICES` slices spread evenly over the token stream (as int64,
    `data.stream.sample_digest`): a few memory-mapped reads whatever the corpus's size."""
    from modeling_gpn.data.stream import sample_digest

    total = len(stream)
    digest = sample_digest(total, stream.tokens, FINGERPRINT_SLICES, FINGERPRINT_SLICE_TOKENS)
    return {"tokens": total, "sample_sha256": digest}


def _optimizer_tensors(run: TrainingRun):
    import torch

    for state in run.optimizer.state.values():
        yield from (value for value in state.values() if torch.is_tensor(value))


def check_resume_path(resume: str | bool | None) -> None:
    """Refuse, naming it, a `--resume PATH` that is no complete checkpoint (a folder holding trainer_state.json).
    Checked again once the run folder is recovered; checked first before the data are tokenized, unless the
    folder is missing only because a crash left it renamed aside (the recovery puts it back)."""
    if resume is None or isinstance(resume, bool):
        return
    path = Path(resume)
    if (path / "trainer_state.json").exists() or (
        not path.exists() and path.with_name(REPLACED_PREFIX + path.name).exists()
    ):
        return
    found = "does not exist" if not path.exists() else "holds no trainer_state.json"
    raise FileNotFoundError(
        f"--resume {resume}: no complete checkpoint there (it {found}); give a checkpoints/step-N folder of a run, "
        "or --resume alone for the newest of --output-dir"
    )


def resume_from_checkpoint(run: TrainingRun, resume: str | bool) -> None:
    """`--resume` (True: the newest checkpoint of the run folder; a path: that one): load the training state
    into the prepared model and optimizer and continue where it stopped. Refused, naming why: no complete
    checkpoint, a changed setting that would change the data, the model or the optimisation, or non-finite
    weights (which older versions could write)."""
    if resume is True:
        checkpoint = latest_checkpoint(run.run_dir)
        if checkpoint is None:
            raise FileNotFoundError(f"--resume: no complete checkpoint in {run.checkpoints_dir}")
    else:
        check_resume_path(resume)
        checkpoint = Path(resume)
    state = read_json(checkpoint / "trainer_state.json", "checkpoint state")
    changes = changed_settings(state.get("config", {}), run.config)
    saved_data, data = state.get("data"), data_fingerprint(run.stream)
    if saved_data is not None and saved_data != data:  # (checkpoints of older versions hold none)
        same_count = saved_data.get("tokens") == data["tokens"]
        changes.append(
            f"the training data ({run.config['dataset']}): {saved_data.get('tokens')} -> {data['tokens']} tokens"
            + (", other tokens" if same_count else "")
            + " (the corpus changed since the checkpoint: other training windows and another held-out split)"
        )
    if changes:
        raise ResumeMismatchError(checkpoint, changes)
    load_training_state(run.accelerator, run.model, run.optimizer, run.scheduler, checkpoint)
    if not all_finite(run.accelerator, run.model.parameters()):
        raise NonFiniteLossError(
            f"--resume: {checkpoint} holds non-finite weights (written by an older version without this check); "
            "resume from an earlier checkpoint with --resume PATH"
        )
    run.start_step = state["step"]
    run.skipped_steps = list(state.get("skipped_steps", []))
    run.running = list(state.get("running_losses", []))  # the unfinished log window, so the log continues exactly
    run.say(f"resumed from {checkpoint} at step {run.start_step}")


# --------------------------------------------------------------------------------------------------
# The training state's files, under any distribution
# --------------------------------------------------------------------------------------------------


def save_training_state(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    folder: Path,
) -> None:
    """Write the full training state to `folder` (every process calls this: FSDP gathers the shards)."""
    import random

    import numpy as np
    import torch
    from accelerate.utils import save

    folder.mkdir(parents=True, exist_ok=True)
    weights = accelerator.get_state_dict(model)  # FSDP: gathered to the main process only
    if is_fsdp(accelerator):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        by_name = get_optimizer_state_dict(
            model, optimizer.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        optimizer_state = _optimizer_state_by_position(by_name) if accelerator.is_main_process else None
    else:
        optimizer_state = optimizer.state_dict()
    # A tied parameter under one name (e.g. not lm_head.weight beside the embedding), as safetensors stores it.
    # FSDP's gathered weights hold a separate copy under every tied name; other state dicts share the storage,
    # which Accelerate's `save` would drop itself, warning at every checkpoint that it did.
    drop_tied_copies(weights, accelerator.unwrap_model(model))
    if accelerator.is_main_process:
        save(weights, folder / MODEL_FILE, safe_serialization=True)
        torch.save(optimizer_state, folder / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)
        if accelerator.scaler is not None:
            torch.save(accelerator.scaler.state_dict(), folder / SCALER_FILE)
    generators = {
        "random_state": random.getstate(),
        "numpy_random_seed": np.random.get_state(),
        "torch_manual_seed": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        generators["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    torch.save(generators, folder / RNG_FILE.format(accelerator.process_index))


def load_training_state(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    folder: Path,
) -> None:
    """Load a checkpoint written by `save_training_state` (or Accelerate's non-FSDP `save_state`) under any
    distribution. Random generators come back when the checkpoint has this process's file (same process count)."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import load_file

    weights = read_checkpoint_file(folder / MODEL_FILE, lambda path: load_file(str(path)))
    if weights and all(name.startswith("module.") for name in weights):  # DDP checkpoints of older versions
        weights = {name[len("module.") :]: tensor for name, tensor in weights.items()}
    weights = in_the_current_layout(weights, accelerator.unwrap_model(model))
    optimizer_state = read_checkpoint_file(
        folder / OPTIMIZER_FILE, lambda path: torch.load(path, map_location="cpu", weights_only=True)
    )
    if is_fsdp(accelerator):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        complete_tied_weights(weights, model)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(
            model, optimizer.optimizer, _optimizer_state_by_name(optimizer_state, model, optimizer), options=options
        )
    else:
        unwrapped = accelerator.unwrap_model(model)
        complete_tied_weights(weights, unwrapped)
        unwrapped.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(
        read_checkpoint_file(
            folder / SCHEDULER_FILE, lambda path: torch.load(path, map_location="cpu", weights_only=False)
        )
    )
    if accelerator.scaler is not None and (folder / SCALER_FILE).exists():
        accelerator.scaler.load_state_dict(
            read_checkpoint_file(folder / SCALER_FILE, lambda path: torch.load(path, weights_only=False))
        )
    rng_file = folder / RNG_FILE.format(accelerator.process_index)
    if rng_file.exists():
        generators = read_checkpoint_file(rng_file, lambda path: torch.load(path, weights_only=False))
        random.setstate(generators["random_state"])
        np.random.set_state(generators["numpy_random_seed"])
        torch.set_rng_state(generators["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in generators:
            torch.cuda.set_rng_state_all(generators["torch_cuda_manual_seed"])


def in_the_current_layout(weights: dict, model: nn.Module) -> dict:
    """`weights` under the names `model` has now. Checkpoints written before the decoder moved into the base model
    (2026-12-01) hold it at the top level (`decode_norm.*`, `decode_proj.*`, where `model.decode_norm.*` is now):
    such a name, unknown to the model, is read under the base model's prefix, as `from_pretrained` reads it in a
    model folder. The parameters kept their order, so the optimizer state (numbered by position) still matches."""
    names = set(model.state_dict())
    prefix = getattr(model, "base_model_prefix", "") + "."
    if prefix == "." or all(name in names for name in weights):
        return weights
    return {prefix + name if name not in names and prefix + name in names else name: t for name, t in weights.items()}


def read_checkpoint_file(path: Path, read: Callable[[Path], Any]) -> Any:
    """`read(path)`, where a missing or damaged file (truncated, overwritten, bit rot: checkpoints are written
    whole, so only something outside a run leaves one so) is a ValueError naming it and the checkpoints that
    can be resumed instead, not a reader's traceback."""
    try:
        return read(path)
    except Exception as error:  # every reader fails its own way: SafetensorError, torch's zip RuntimeError, pickle's
        folder = path.parent
        others = [
            str(other)
            for other in sorted(folder.parent.glob("step-*"))
            if other != folder and (other / "trainer_state.json").exists()
        ]
        instead = (
            f"resume from another checkpoint with --resume PATH ({', '.join(others)})"
            if others
            else "no other checkpoint is there: start a new run in another --output-dir"
        )
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"--resume: cannot read {path} ({type(error).__name__}: {first_line}): the checkpoint {folder} is "
            f"damaged; {instead}"
        ) from error


def drop_tied_copies(weights: dict, model: nn.Module) -> None:
    """Keep one name of each tied parameter (e.g. not `lm_head.weight` beside the embedding it is), as a
    non-FSDP state dict is stored; `complete_tied_weights` puts the others back on load."""
    names_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        for name in [name for name in names if name in weights][1:]:
            del weights[name]


def complete_tied_weights(weights: dict, model: nn.Module) -> None:
    """Put back the tied copies that safetensors stores once (e.g. a tied lm_head), under every name the model uses."""
    names_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        present = next((name for name in names if name in weights), None)
        for name in names:
            if present is not None and name not in weights:
                weights[name] = weights[present]


def _optimizer_state_by_position(by_name: dict) -> dict:
    """torch's FQN-keyed full optimizer state -> the layout of `optimizer.state_dict()` (positions)."""
    order = [name for group in by_name["param_groups"] for name in group["params"]]
    position = {name: index for index, name in enumerate(order)}
    return {
        "state": {position[name]: state for name, state in by_name["state"].items()},
        "param_groups": [
            {**group, "params": [position[name] for name in group["params"]]} for group in by_name["param_groups"]
        ],
    }


def _optimizer_state_by_name(by_position: dict, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()`'s layout -> torch's FQN-keyed full optimizer state, for `set_optimizer_state_dict`."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    order = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = [index for group in by_position["param_groups"] for index in group["params"]]
    if len(saved) != len(order):
        raise ValueError(f"The checkpoint's optimizer holds {len(saved)} parameters, the model {len(order)}")
    name = dict(zip(saved, order))
    return {
        "state": {name[index]: state for index, state in by_position["state"].items()},
        "param_groups": [
            {**group, "params": [name[index] for index in group["params"]]} for group in by_position["param_groups"]
        ],
    }
