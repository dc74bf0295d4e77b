"""`train(config)`: one training run from start to end.

    train                start Accelerate, hold the run folder, name a failed collective's stage
      run_training       the phases, in order:
        prepare_data     tokenizer, token cache, windows (the main process tokenizes first)
        prepare_model    model, optimizer, schedule, wrapped by Accelerate
        open_run_folder  recover from a crash, resume or refuse a used folder, write the settings
        loop.fit         the optimizer steps (validation, checkpoints, stops between them)
        finish           final validation, the weights checked and saved, the sample

Each phase is a function taking the run's context (`context.TrainingRun`).
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from modeling_gpn.data import TokenStream, WindowDataset

from .checkpoints import check_resume_path, complete_tied_weights, resume_from_checkpoint
from .context import TrainingRun
from .distributed import (
    RunStage,
    all_finite,
    collective_error,
    distribution_name,
    fit_fsdp_plugin,
    is_fsdp,
    start_accelerator,
    started_by_a_launcher,
)
from .errors import CollectiveError, LaunchError, NonFiniteLossError, RunFolderInUseError, StorageError
from .loop import end_process_group, fit, validate
from .loss_figure import FILE_NAME as LOSS_FIGURE
from .loss_figure import draw_loss_figure
from .models import build_model, build_optimizer, check_model_overrides, generate_sample, weights_sha256
from .run_folder import (
    check_run_folder,
    fsync_tree,
    hold_run_folder,
    install_folder,
    intact,
    latest_checkpoint,
    read_log,
    recover_folders,
    storage_error,
    truncate_log,
    write_errors,
    write_file_atomically,
)
from .stop_signals import StopSignals, stop_when_the_launcher_dies


def train(
    config: dict,
    resume: str | bool | None = None,
    skip_nonfinite: bool = False,
    prepare_only: bool = False,
    show_progress: bool = True,
) -> dict:
    """Run training as configured (see `resolve_config`). Returns a summary dict (paths, perplexity, skipped
    steps, processes). Raises NonFiniteLossError, StorageError, TrainingStopped (SIGTERM/SIGINT, after a
    checkpoint), RunFolderInUseError (another run holds the output folder), LaunchError (a launch Accelerate
    would not make one training) or CollectiveError (another process stopped responding; names the stage)."""
    import torch

    if config["num_threads"]:
        torch.set_num_threads(config["num_threads"])
    run_dir = Path(config["output_dir"])
    if not prepare_only:  # (before the folder is locked or the trackers write in it, and the data are tokenized)
        check_run_folder(run_dir, config["dataset"])
    trackers = []
    try:
        import tensorboard  # noqa: F401

        trackers.append("tensorboard")
    except ImportError:
        pass
    stop_when_the_launcher_dies(started_by_a_launcher())
    accelerator = start_accelerator(config, trackers, run_dir)
    # Past the last collective a multi-process run has nothing left to wait for: its process-group end is
    # bounded by a watchdog (one process has no one to wait for).
    stage = RunStage(watchdog_s=config["ddp_timeout"] + 60 if accelerator.num_processes > 1 else None)
    try:
        if prepare_only:
            return run_training(accelerator, config, stage, prepare_only=True, show_progress=show_progress)
        with hold_run_folder(accelerator, run_dir, warn=lambda message: print(message, file=sys.stderr)):
            return run_training(accelerator, config, stage, resume, skip_nonfinite, show_progress=show_progress)
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


def run_training(
    accelerator: Accelerator,
    config: dict,
    stage: RunStage,
    resume: str | bool | None = None,
    skip_nonfinite: bool = False,
    prepare_only: bool = False,
    show_progress: bool = True,
) -> dict:
    """The run itself, in the started `accelerator` (the main process holding the run folder's lock)."""
    import modeling_gpn  # noqa: F401 - registers GPN with the Auto classes

    micro, accumulation = split_batch(config, accelerator.num_processes)
    if not prepare_only:
        check_resume_path(resume)  # a wrong --resume PATH costs no tokenizing
        check_model_overrides(config)  # nor a misspelt model setting
    tokenizer, stream, windows = prepare_data(accelerator, config, show_progress)
    if prepare_only:
        return {"token_cache": str(stream.folder), "tokens": len(stream), "reused_cache": stream.reused}
    run = TrainingRun(
        accelerator,
        config,
        stage,
        tokenizer,
        stream,
        windows,
        micro,
        accumulation,
        skip_nonfinite=skip_nonfinite,
        show_progress=show_progress,
    )
    described = prepare_model(run)
    open_run_folder(run, resume)
    run.say(
        f"model: {described}; {run.world} process(es) x {accumulation} accumulation x {micro} windows; "
        f"{distribution_name(accelerator)}; mixed precision {config['mixed_precision']}"
    )
    # The handlers stay through the final phase: a SIGTERM there lets the run finish and save its model,
    # the quickest way to keep its work. The signal is still the caller's to act on (`stop_signal`): it was
    # forgotten, and `gpn study` went on to its next models after a Ctrl-C, `gpn train` exited 0.
    with StopSignals() as stop:
        fit(run, stop)
        summary = finish(run)
    if stop.received is not None:
        summary["stop_signal"] = stop.received
    return summary


def split_batch(config: dict, world: int) -> tuple[int, int]:
    """(windows per forward pass, forward passes per step) of each process for the global batch."""
    rows_per_process, remainder = divmod(config["batch_size"], world)
    micro = min(config["micro_batch_size"], rows_per_process or 1)
    if remainder or rows_per_process % micro:
        raise ValueError(
            f"batch_size {config['batch_size']} must split evenly into {world} process(es) x micro_batch_size "
            f"{config['micro_batch_size']}"
        )
    return micro, rows_per_process // micro


def prepare_data(
    accelerator: Accelerator, config: dict, show_progress: bool
) -> tuple[PreTrainedTokenizerBase, TokenStream, WindowDataset]:
    """The tokenizer, the token stream and its windows. The main process tokenizes first; the others then
    read its cache."""
    from modeling_gpn.data import CorpusSpec, WindowDataset, build_token_stream, load_tokenizer

    corpus = CorpusSpec(
        source=config["dataset"],
        config_name=config["dataset_config"],
        split=config["split"],
        text_field=config["text_field"],
        revision=config["dataset_revision"],
    )
    max_tokens = config["max_tokens"]
    if max_tokens is None and corpus.kind == "hub":
        need = config["steps"] * config["batch_size"] * config["seq_len"]
        max_tokens = int(math.ceil(need / (1 - config["val_fraction"]))) + 2 * config["seq_len"]
    if corpus.kind == "local":
        corpus.local_files()  # bad paths fail here, on every rank, before anything else
    if corpus.kind == "hub":  # every rank resolves the commit now, before the main process tokenizes (which can
        corpus.hub_commit()  # take long): a commit landing meanwhile would give the others another cache key

    def tell(message: str) -> None:  # (another run writing the same BPE tokenizer or token cache: this one waits)
        print(f"gpn train: {message}", file=sys.stderr, flush=True)

    with accelerator.main_process_first():
        tokenizer = load_tokenizer(
            config["tokenizer"],
            corpus,
            config["bpe_vocab_size"],
            config["bpe_max_documents"],
            config["cache_dir"],
            tell=tell,
        )
        if config["tokenizer"] == "bpe" and len(tokenizer) < config["bpe_vocab_size"]:
            # (BPE stops merging when the corpus has no pair left: the model's vocabulary is then the smaller size)
            accelerator.print(
                f"tokenizer: a byte-level BPE of {len(tokenizer):,} tokens, fewer than --bpe-vocab-size "
                f"{config['bpe_vocab_size']:,}: the corpus gives no more (the model's vocabulary is {len(tokenizer):,})"
            )
        stream = build_token_stream(
            corpus,
            tokenizer,
            config["cache_dir"],
            max_tokens,
            show_progress=show_progress and accelerator.is_main_process,
            tell=tell,
        )
    windows = WindowDataset(stream, config["seq_len"], config["val_fraction"], config["seed"])
    accelerator.print(
        f"data: {corpus.describe()}: {len(stream):,} tokens ({'cached' if stream.reused else 'tokenized'} at "
        f"{stream.folder}); {windows.num_train:,} training / {windows.num_val:,} held-out windows of "
        f"{config['seq_len']} tokens; {config['steps']} steps x {config['batch_size']} windows = "
        f"{windows.epochs(config['steps'], config['batch_size']):.2f} epochs"
    )
    return tokenizer, stream, windows


def prepare_model(run: TrainingRun) -> str:
    """A freshly initialised model, its optimizer and schedule, the model and optimizer wrapped by Accelerate
    (DDP / FSDP). Returns the model's class and size, for the run's summary line."""
    from accelerate.utils import set_seed

    config = run.config
    set_seed(config["seed"])
    model = build_model(config, run.tokenizer)
    if config["reset_at_document_start"] and model.config.model_type != "gpn":
        raise ValueError(
            f"--reset-at-document-start resets a GPN's state at every document; a {model.config.model_type} model "
            "would not keep the documents of a window apart (its attention does not read restarting position ids)"
        )
    # (The class is read before preparing: FSDP2 renames the class of the module it shards.)
    described = f"{type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters"
    optimizer, run.scheduler = build_optimizer(model, config)
    # GPN's forward can skip materialising the (batch, seq, vocab) logits when only the loss is needed.
    run.loss_kwargs = {"use_cache": False}
    if "return_logits" in inspect.signature(model.forward).parameters:
        run.loss_kwargs["return_logits"] = False
    if is_fsdp(run.accelerator):
        note = fit_fsdp_plugin(run.accelerator.state.fsdp_plugin, model, run.accelerator.device.type == "cpu")
        if note:
            run.say(note)
    run.model, run.optimizer = run.accelerator.prepare(model, optimizer)  # the scheduler is stepped by hand
    return described


def open_run_folder(run: TrainingRun, resume: str | bool | None) -> None:
    """Recover the folder from a crash (a half-written checkpoint or model), then resume from a checkpoint or
    refuse a folder that holds some; write the settings, cut the log back to the start step, start the
    trackers."""
    run_dir, config = run.run_dir, run.config
    if run.main:
        run_dir.mkdir(parents=True, exist_ok=True)
        recover_folders(run.checkpoints_dir)
        recover_folders(run_dir)
    run.accelerator.wait_for_everyone()
    if resume:
        resume_from_checkpoint(run, resume)
    elif latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints: pass --resume to continue, or choose another --output-dir"
        )
    elif (run_dir / "model").exists():
        # A finished run (one without checkpoints: --checkpoint-interval 0, or fewer steps than the interval):
        # a new run here would delete its log at once and replace its model at the end.
        raise FileExistsError(
            f"{run_dir} already holds the model of a finished run ({run_dir / 'model'}): choose another "
            "--output-dir, or move that folder away to train here again"
        )
    if run.main:
        try:
            write_file_atomically(run_dir / "train_config.json", json.dumps(config, indent=1, default=str))
            truncate_log(run.log_path, run.start_step, run.warn)
        except OSError as error:
            raise storage_error(run_dir, run_dir / "train_config.json", error) from error
        run.accelerator.init_trackers(
            "tensorboard",
            config={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()},
        )


def finish(run: TrainingRun) -> dict:
    """The end of a run: the final validation, the weights gathered and checked alike on every process, the
    model saved (never with non-finite weights) and the sample. Returns the run's summary."""
    run.stage.enter("the final validation")
    val_loss = validate(run)
    val_ppl = math.exp(min(val_loss, 50))
    run.stage.enter("gathering the final weights")
    unwrapped = run.accelerator.unwrap_model(run.model)
    record = {"step": run.steps, "val_loss": val_loss, "val_ppl": val_ppl, "event": "final"}
    final_model = gather_final_weights(run, unwrapped, record)
    record.update(skipped_steps=len(run.skipped_steps), skipped_at=run.skipped_steps)
    run.log(record)
    if run.skipped_steps:
        run.say(f"skipped {len(run.skipped_steps)} non-finite step(s) of {run.steps}: {run.skipped_steps}")
    evaluated = min(run.config["eval_windows"], run.windows.num_val) > 0
    if not all_finite(run.accelerator, unwrapped.parameters()) or (evaluated and not math.isfinite(val_loss)):
        end_process_group(run, after_error=True)
        raise NonFiniteLossError(
            f"The run ended with a non-finite model (validation loss {val_loss}, {len(run.skipped_steps)} skipped "
            f"step(s)); it was not saved as {run.run_dir / 'model'}. {intact(run.run_dir)}"
        )
    model_dir = run.run_dir / "model"
    sample = None
    if run.main:
        save_model(run, final_model, model_dir)
        if run.config["sample_tokens"]:
            run.stage.enter("generating the sample")
            config = run.config
            sample = generate_sample(
                final_model, run.tokenizer, config["sample_prompt"], config["sample_tokens"], config["seed"]
            )
        print_summary(run, val_loss, val_ppl, sample, model_dir)
        if run.config["loss_figure"]:
            write_loss_figure(run)
    run.stage.enter(
        "waiting for every process after the model was saved"
        if run.main
        else "waiting for the main process to save the model and write the sample"
    )
    run.accelerator.wait_for_everyone()
    end_process_group(run, after_error=False)
    return {
        "model_dir": str(model_dir),
        "val_loss": val_loss,
        "val_ppl": val_ppl,
        "sample": sample,
        "run_dir": str(run.run_dir),
        "reused_cache": run.stream.reused,
        # (the stream it read: gpn eval --fineweb-token-cache scores its windows)
        "token_cache": str(run.stream.folder),
        "skipped_steps": run.skipped_steps,
        "processes": run.world,
        "distribution": distribution_name(run.accelerator),
    }


def gather_final_weights(run: TrainingRun, unwrapped: PreTrainedModel, record: dict) -> PreTrainedModel:
    """The model to save and sample from, its fingerprint added to `record`. Sharded (FSDP) weights are
    gathered into a plain copy on the main process, which saves it and samples from it alone (a sharded
    forward would wait for the other processes); unsharded ones must be the same on every process."""
    if is_fsdp(run.accelerator):
        weights = run.accelerator.get_state_dict(run.model)
        final_model = None
        if run.main:
            final_model = build_model(run.config, run.tokenizer)
            complete_tied_weights(weights, final_model)
            final_model.load_state_dict(weights)
            record["weights_sha256"] = weights_sha256(final_model)
        del weights
        return final_model
    from accelerate.utils import gather_object

    record["weights_sha256_per_rank"] = fingerprints = gather_object([weights_sha256(unwrapped)])
    if len(set(fingerprints)) != 1:
        raise RuntimeError(f"The processes ended with different weights: {fingerprints}")
    return unwrapped


def save_model(run: TrainingRun, final_model: PreTrainedModel, model_dir: Path) -> None:
    """`save_pretrained` of the model and its tokenizer (with the generation settings of the tokenizer's special
    tokens) into a temporary folder, fsynced, then renamed to `model_dir` (main process)."""
    from transformers.utils import logging as transformers_logging

    run.stage.enter("saving the model")
    tokenizer = run.tokenizer
    generation = final_model.generation_config
    generation.eos_token_id = tokenizer.eos_token_id
    generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generation.bos_token_id = tokenizer.bos_token_id
    tmp_model = run.run_dir / ".tmp-model"
    # --no-progress: no bar of transformers' own either ("Writing model shards").
    bars = transformers_logging.is_progress_bar_enabled()
    if not run.show_progress:
        transformers_logging.disable_progress_bar()
    try:
        shutil.rmtree(tmp_model, ignore_errors=True)
        final_model.save_pretrained(str(tmp_model))
        tokenizer.save_pretrained(str(tmp_model))
        fsync_tree(tmp_model)
        install_folder(tmp_model, model_dir)
    except write_errors() as error:
        shutil.rmtree(tmp_model, ignore_errors=True)
        end_process_group(run, after_error=True)
        raise storage_error(run.run_dir, model_dir, error) from error
    finally:
        if bars:
            transformers_logging.enable_progress_bar()


def write_loss_figure(run: TrainingRun) -> None:
    """Draw `loss.png` in the run folder from the whole log (main process, after the model is saved). A figure that
    cannot be drawn (no matplotlib, a full disk, a log without a finite loss) is a warning naming why, never a
    failure of the finished run."""
    path = run.run_dir / LOSS_FIGURE
    config = run.config
    model = config["model"] if isinstance(config["model"], str) else "inline config"
    title = f"{run.run_dir.name}: recipe {config['recipe'] or 'none'}, model {model}"
    try:
        draw_loss_figure(read_log(run.log_path, run.warn), path, title, run.tokens_per_step)
    except Exception as error:  # (whatever matplotlib raises: the model is saved, the figure is a convenience)
        run.warn(
            f"gpn train: warning: {path} was not drawn ({type(error).__name__}: {error}); the run is complete and "
            f"{run.log_path} holds the same losses"
        )
        return
    run.say(f"loss curves: {path.resolve()}")


def print_summary(run: TrainingRun, val_loss: float, val_ppl: float, sample: str | None, model_dir: Path) -> None:
    """Print the run's closing lines: validation loss and perplexity, the sample, and where the model is."""
    config = run.config
    evaluated = min(config["eval_windows"], run.windows.num_val)
    if evaluated:
        run.say(
            f"\nvalidation loss {val_loss:.4f}, perplexity {val_ppl:.2f} ({evaluated} held-out windows of "
            f"{config['seq_len']} tokens, each scored on its {config['seq_len'] - 1} next-token predictions: its "
            "first token is not scored)"
        )
    else:
        run.say(
            f"\nno validation: no held-out windows (--val-fraction {config['val_fraction']}, --eval-windows "
            f"{config['eval_windows']})"
        )
    if sample is not None:
        run.say(f"sample (prompt {config['sample_prompt']!r}):\n{sample}\n")
    run.say(
        f"model saved to {model_dir.resolve()}\nload it with:\n  import modeling_gpn  # registers GPN (or pass "
        f"trust_remote_code=True)\n  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"  model = AutoModelForCausalLM.from_pretrained({str(model_dir.resolve())!r})\n"
        f"  tokenizer = AutoTokenizer.from_pretrained({str(model_dir.resolve())!r})"
    )
