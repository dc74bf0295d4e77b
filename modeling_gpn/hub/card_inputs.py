"""What a model card is built from, read from a model folder and tolerant of what it cannot use:
`eval_results.json` (`read_eval_results` -> `EvalInfo`) and a training log (`read_training_info` ->
`TrainingInfo`). Keys that look like credentials are never read."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CardError

#: Keys whose values are never written into a card (credentials that a training config might carry).
SECRET_KEY = re.compile(r"(^|_)(token|hf_token|hub_token|password|secret|api_key|apikey)$", re.IGNORECASE)


@dataclass
class EvalInfo:
    """What the card uses from `eval_results.json`."""

    path: Path
    model: str | None
    n_params: int | None
    tasks: dict[str, dict[str, float]]
    stderrs: dict[str, dict[str, float]]
    protocols: dict[str, str]
    lm_eval_version: str | None
    published_baselines: list[dict[str, Any]]
    measured: dict[str, float] = field(default_factory=dict)
    data: dict[str, str] = field(default_factory=dict)
    limit: int | None = None  # `gpn eval --limit N`: only the first N examples of a task were scored
    dtype: str | None = None  # `gpn eval --dtype`: the weights' dtype the figures were measured in
    quantization: str | None = None  # how the weights were quantized (eval_results.json "quantization" summary)
    quantized: str | None = None  # what they were quantized to ("int8", "int4": its "weights"), None for float ones


@dataclass
class TrainingInfo:
    """What the card uses from a training log: a recipe (flat key -> value) and the last logged values."""

    sources: list[str] = field(default_factory=list)
    recipe: dict[str, Any] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    log_rows: int = 0
    conversion: dict[str, str] | None = None  # `gpn convert`'s record of the checkpoint the weights came from


def is_number(value: Any) -> bool:
    """A real number (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _metric_name(metric: str) -> str:
    """lm-eval writes `acc,none`; the filter suffix is not part of the metric's name."""
    return metric.split(",", 1)[0].strip()


def read_eval_results(path: str | Path) -> EvalInfo:
    """Read `eval_results.json` (schema in the module docstring); raises `CardError` if unreadable."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise CardError(f"cannot read the evaluation results {path}: {error}") from error
    if not isinstance(data, dict):
        raise CardError(f"{path}: expected a JSON object with a 'tasks' mapping, got {type(data).__name__}")
    raw_tasks = data.get("tasks") or {}
    if not isinstance(raw_tasks, dict):
        raise CardError(f"{path}: 'tasks' must map task -> {{metric: value}}, got {type(raw_tasks).__name__}")
    tasks: dict[str, dict[str, float]] = {}
    stderrs: dict[str, dict[str, float]] = {}
    for task, metrics in raw_tasks.items():
        if not isinstance(metrics, dict):
            continue
        for metric, value in metrics.items():
            if not is_number(value):
                continue  # e.g. lm-eval's "alias": "lambada_openai"
            name = _metric_name(str(metric))
            if not math.isfinite(value):
                raise CardError(
                    f"{path}: metric {name!r} of task {task!r} is {value!r}; the Hub's model-index needs finite "
                    "numbers (re-run the evaluation or remove the metric)"
                )
            if name.endswith("_stderr"):
                stderrs.setdefault(str(task), {})[name[: -len("_stderr")]] = float(value)
            else:
                tasks.setdefault(str(task), {})[name] = value
    protocols = data.get("protocols") or {}
    protocols = {str(k): str(v) for k, v in protocols.items()} if isinstance(protocols, dict) else {}
    baselines = data.get("published_baselines") or []
    baselines = [row for row in baselines if isinstance(row, dict)] if isinstance(baselines, list) else []
    n_params = data.get("n_params")
    comparison = data.get("comparison") if isinstance(data.get("comparison"), dict) else {}
    measured = comparison.get("measured") if isinstance(comparison.get("measured"), dict) else {}
    measured = {str(k): v for k, v in measured.items() if is_number(v) and math.isfinite(v)}
    sources = data.get("data") if isinstance(data.get("data"), dict) else {}
    quantized = data.get("quantization") if isinstance(data.get("quantization"), dict) else {}
    return EvalInfo(
        path=path,
        model=str(data["model"]) if data.get("model") is not None else None,
        n_params=int(n_params) if is_number(n_params) else None,
        tasks=tasks,
        stderrs=stderrs,
        protocols=protocols,
        lm_eval_version=str(data["lm_eval_version"]) if data.get("lm_eval_version") else None,
        published_baselines=baselines,
        measured=measured,
        data={str(k): str(v) for k, v in sources.items()},
        limit=int(limit) if is_number(limit := data.get("limit")) and limit >= 1 else None,
        dtype=str(data["dtype"]) if data.get("dtype") else None,
        quantization=str(quantized["summary"]) if quantized.get("summary") else None,
        quantized=str(quantized["weights"]) if quantized.get("weights") else None,
    )


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> {"a.b": value} with scalar leaves; lists of scalars kept, secrets dropped."""
    flat: dict[str, Any] = {}
    if not isinstance(data, dict):
        return flat
    for key, value in data.items():
        key = str(key)
        if SECRET_KEY.search(key):
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (str, int, float, bool)) or value is None:
            flat[name] = value
        elif isinstance(value, list) and all(isinstance(v, (str, int, float, bool)) for v in value):
            flat[name] = value
    return flat


def _read_jsonl_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return rows
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a truncated last line of a crashed run
        if isinstance(row, dict):
            rows.append(row)
    return rows


DATASET_KEYS = ("dataset", "dataset_name", "dataset_id", "data", "corpus", "train_dataset")


def _hub_dataset_ids(values: Iterable[Any]) -> list[str]:
    """The values that look like Hub dataset ids (`owner/name`, not a local path)."""
    found = []
    for value in values:
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue
            if (
                re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", item)
                and not Path(item).exists()
                and not item.startswith(".")
            ):
                if item not in found:
                    found.append(item)
    return found


#: What `gpn convert` writes beside a converted model (conversion/reference.py): the reference checkpoint it read.
CONVERSION_RECORD = "conversion.json"


# What `gpn train` leaves in its run folder OUTPUT (modeling_gpn/train/run_folder.py): the model in OUTPUT/model,
# the resolved settings in OUTPUT/train_config.json, one JSON record per log or evaluation in OUTPUT/log.jsonl.
TRAIN_RUN_MODEL, TRAIN_RUN_CONFIG, TRAIN_RUN_LOG = "model", "train_config.json", "log.jsonl"


def train_run_folder(model_dir: str | Path) -> Path | None:
    """The `gpn train` run folder that holds `model_dir` as its model (OUTPUT for OUTPUT/model), or None."""
    model_dir = Path(model_dir).resolve()
    run_dir = model_dir.parent
    if model_dir.name == TRAIN_RUN_MODEL and (run_dir / TRAIN_RUN_CONFIG).is_file():
        return run_dir
    return None


def _read_json_object(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def read_training_info(model_dir: str | Path) -> TrainingInfo | None:
    """Read what a training run left in `model_dir` (or, for `gpn train`'s output, in its run folder), or None
    when there is nothing.

    Looked for, in this order (all optional): the recipe, `training_config.json` in `model_dir` or
    `train_config.json` in the `gpn train` run folder holding it (`train_run_folder`; any JSON object, nested
    sections flattened); `trainer_state.json` (transformers' Trainer: `log_history`, `global_step`,
    `max_steps`, `train_batch_size`); the log, `train_log.jsonl` in `model_dir` or `log.jsonl` in the run
    folder; then any other `*.jsonl` of `model_dir` whose rows carry a `loss` (or `train_loss`) value; and
    `gpn convert`'s `conversion.json` (the reference checkpoint the weights were converted from). From log
    rows the card takes the last value of each key (loss, validation loss/perplexity, step, tokens, learning
    rate). A run folder's files are named `../NAME` among the sources. Keys that look like credentials
    (`token`, `hub_token`, `password`, ...) are never read.
    """
    model_dir = Path(model_dir)
    run_dir = train_run_folder(model_dir)
    info = TrainingInfo()
    recipes = [(model_dir / "training_config.json", "training_config.json")]
    logs = [(model_dir / "train_log.jsonl", "train_log.jsonl")]
    if run_dir is not None:
        recipes.append((run_dir / TRAIN_RUN_CONFIG, f"../{TRAIN_RUN_CONFIG}"))
        logs.append((run_dir / TRAIN_RUN_LOG, f"../{TRAIN_RUN_LOG}"))
    for config_path, name in recipes:
        data = _read_json_object(config_path) if config_path.is_file() else None
        if data is not None:
            info.sources.append(name)
            info.recipe.update(flatten(data))
    state_path = model_dir / "trainer_state.json"
    state = _read_json_object(state_path) if state_path.is_file() else None
    if state is not None:
        info.sources.append(state_path.name)
        for key in ("global_step", "max_steps", "train_batch_size", "num_train_epochs"):
            if key in state and state[key] is not None:
                info.recipe.setdefault(key, state[key])
        history = [row for row in state.get("log_history") or [] if isinstance(row, dict)]
        info.log_rows += len(history)
        for row in history:
            info.last.update({k: v for k, v in flatten(row).items() if is_number(v)})
    logs = [(path, name) for path, name in logs if path.is_file()]
    logs += [(p, p.name) for p in sorted(model_dir.glob("*.jsonl")) if p.name != "train_log.jsonl"]
    for path, name in logs:
        rows = _read_jsonl_rows(path)
        known = name in ("train_log.jsonl", f"../{TRAIN_RUN_LOG}")  # another *.jsonl counts if it logs a loss
        if not known and not any("loss" in r or "train_loss" in r for r in rows):
            continue
        if not rows:
            continue
        info.sources.append(name)
        info.log_rows += len(rows)
        for row in rows:
            info.last.update({k: v for k, v in flatten(row).items() if is_number(v)})
            for key in DATASET_KEYS:  # a log may state its data in a header row
                if isinstance(row.get(key), str) and key not in info.recipe:
                    info.recipe[key] = row[key]
    conversion = _read_json_object(model_dir / CONVERSION_RECORD) if (model_dir / CONVERSION_RECORD).is_file() else None
    if conversion is not None:  # the weights are the reference trainer's: its run left no log here
        info.sources.append(CONVERSION_RECORD)
        info.conversion = {str(k): str(v) for k, v in conversion.items() if not SECRET_KEY.search(str(k))}
    if not info.sources:
        return None
    info.datasets = _hub_dataset_ids(v for k, v in info.recipe.items() if k.split(".")[-1] in DATASET_KEYS)
    return info
