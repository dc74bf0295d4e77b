"""`gpn train`: train a GPN (or a LlamaForCausalLM baseline) on a text corpus with Accelerate.

One entry point, two ways to start it (same arguments):

    gpn train --recipe tiny-cpu                                   # one process
    accelerate launch -m modeling_gpn.train --recipe paper-130m   # DDP / FSDP over GPUs or machines

Configuration, later sources overriding earlier ones: the built-in defaults, a recipe
(`configuration/recipes/NAME.json`: model preset + data + optimisation; `extends` another recipe),
a config file (`--config FILE.json`, same keys), then command-line options (`--lr 1e-3`). The resolved
configuration is written to `OUTPUT/train_config.json`.

A run directory holds `model/` (the final `save_pretrained` folder: weights, config, tokenizer,
generation config), `checkpoints/step-NNNNNNN/` (full training state, in one layout for one process, DDP and
FSDP), `log.jsonl` (one JSON object per log/eval event), `loss.png` (the loss curves of the whole log, drawn at
the end; `--no-loss-figure`: none), `tensorboard/` and `.gpn-train.lock` (the lock that keeps a second run out of
the folder while one runs; it names the holder).

Nothing lost, nothing wrong in silence:
- every folder and JSON file is written under a temporary name in its final folder, fsynced, then renamed
  (and the folder fsynced), so a crash at any instant leaves the old complete version or the new one;
  `log.jsonl` is appended one fsynced record at a time (a failed append is cut back), and a torn last
  line is dropped with a warning on `--resume`, whose log truncation is itself a write-and-rename;
- a step whose loss or gradient norm is NaN/inf is never applied (the norm is computed at every clipping
  setting), no checkpoint or model is written with non-finite weights, `--skip-nonfinite` skips are
  capped (`--max-skipped-steps`) and reported, and a run that cannot end with a finite model exits non-zero;
- SIGTERM / SIGINT save a checkpoint at the next step boundary and exit with 128 + the signal number;
- `--resume` refuses any changed setting that would change the data, the model or the optimisation;
- a launch of several processes that Accelerate starts as one each is refused before training, and a
  multi-process run that stops responding fails after --ddp-timeout, naming the stage it was in.

Where its parts live (each module is read top to bottom; this face re-exports their public names):

    settings.py     the options table, recipes and config files, `resolve_config`, what --resume may change
    run_folder.py   the run folder: durable writes, log.jsonl, the .gpn-train.lock, what a failed write leaves
    checkpoints.py  the full training state: save (rotate), resume, one layout for every distribution
    distributed.py  Accelerate / DDP / FSDP2 setup, launch checks, collective timeouts, the end-of-run watchdog
    models.py       the model, AdamW groups and schedule, document position ids, the sample
    context.py      `TrainingRun`, what the phases of a run share
    loss_figure.py  loss.png: the whole log's training and held-out loss against step and tokens
    loop.py         `fit`, `training_step` and its non-finite handling, `validate`
    training.py     `train`: setup -> prepare data / model -> open the run folder -> fit -> finish
    stop_signals.py SIGTERM / SIGINT: checkpoint at the step boundary, then stop
    errors.py       what `gpn train` raises
    cli.py          the command line (`add_arguments`, `run`, `main`; `python -m modeling_gpn.train`)
"""

from __future__ import annotations

from ..packing import document_position_ids
from .checkpoints import (
    MODEL_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    load_training_state,
    save_training_state,
)
from .cli import add_arguments, main, run
from .distributed import (
    LAUNCHER_RANK_VARIABLES,
    LAUNCHER_SIZE_VARIABLES,
    RunStage,
    collective_error,
    distribution_name,
    fit_fsdp_plugin,
    fsdp_requested,
    is_fsdp,
    launched_as_several_processes,
    start_accelerator,
)
from .errors import (
    RUN_ERRORS,
    CollectiveError,
    LaunchError,
    NonFiniteLossError,
    ResumeMismatchError,
    RunFolderInUseError,
    StorageError,
    TrainingStopped,
)
from .models import (
    NO_DECAY_NAMES,
    build_model,
    build_optimizer,
    generate_sample,
    lr_factor,
    model_config_dict,
    parameter_groups,
)
from .run_folder import (
    REPLACED_PREFIX,
    RunFolderLock,
    append_log_record,
    hold_run_folder,
    install_folder,
    latest_checkpoint,
    read_log,
    recover_folders,
    truncate_log,
    write_file_atomically,
)
from .settings import (
    NON_RECIPE_KEYS,
    OPTION_BY_KEY,
    OPTIONS,
    RECIPE_DIR,
    RESUME_MAY_CHANGE,
    Option,
    changed_settings,
    list_recipes,
    load_recipe,
    resolve_config,
    validate_config,
)
from .stop_signals import StopSignals
from .training import train

__all__ = [
    "CollectiveError",
    "RUN_ERRORS",
    "LAUNCHER_RANK_VARIABLES",
    "LAUNCHER_SIZE_VARIABLES",
    "LaunchError",
    "MODEL_FILE",
    "NON_RECIPE_KEYS",
    "NO_DECAY_NAMES",
    "NonFiniteLossError",
    "OPTIMIZER_FILE",
    "OPTIONS",
    "OPTION_BY_KEY",
    "Option",
    "RECIPE_DIR",
    "REPLACED_PREFIX",
    "RESUME_MAY_CHANGE",
    "RNG_FILE",
    "ResumeMismatchError",
    "RunFolderInUseError",
    "RunFolderLock",
    "RunStage",
    "SCALER_FILE",
    "SCHEDULER_FILE",
    "StopSignals",
    "StorageError",
    "TrainingStopped",
    "add_arguments",
    "append_log_record",
    "build_model",
    "build_optimizer",
    "changed_settings",
    "collective_error",
    "distribution_name",
    "document_position_ids",
    "fit_fsdp_plugin",
    "fsdp_requested",
    "generate_sample",
    "hold_run_folder",
    "install_folder",
    "is_fsdp",
    "latest_checkpoint",
    "launched_as_several_processes",
    "list_recipes",
    "load_recipe",
    "load_training_state",
    "lr_factor",
    "main",
    "model_config_dict",
    "parameter_groups",
    "read_log",
    "recover_folders",
    "resolve_config",
    "run",
    "save_training_state",
    "start_accelerator",
    "train",
    "truncate_log",
    "validate_config",
    "write_file_atomically",
]
