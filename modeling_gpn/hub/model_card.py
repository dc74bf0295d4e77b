"""The model card (README.md) that `gpn push` publishes beside a GPN.

Everything here is built from what is known about a model folder, and nothing is invented:

- the config (variant, widths, memory shape, state size) and the parameter count read from the
  safetensors headers;
- `eval_results.json` when present (written by `gpn eval`), with the schema
  `{"model", "n_params", "tasks": {task: {metric: value}}, "protocols": {task: str},
  "lm_eval_version", "published_baselines": [...]}` — read tolerantly: missing keys are skipped,
  non-numeric metric values (lm-eval's "alias" strings) are ignored, `*_stderr` values are shown as
  +/- beside their metric, and lm-eval's filter suffix (`acc,none`) is dropped;
- a training log when present (see `read_training_info`);
- the paper's Table 1 (GPN.md) as the published baselines, unless the evaluation JSON carries its own.

`build_card` returns the README text; `validate_card` checks it the way the Hub parses it
(`huggingface_hub.ModelCard` and its model-index tools) and raises `CardError` otherwise.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PAPER_TITLE = "A Single-Layer Model Can Do Language Modeling"
PAPER_ARXIV = "2605.10643"
PAPER_URL = f"https://arxiv.org/abs/{PAPER_ARXIV}"
REFERENCE_CODE = "https://github.com/steve-z-wang/grounded-prediction-network"

#: The paper's Table 1 (130M parameters; GPN.md). Used when the evaluation JSON has no baselines.
PAPER_TABLE_1: list[dict[str, Any]] = [
    {"model": "Transformer++", "layers": 12, "state_dim": 768, "fineweb_ppl": 16.05, "lambada_acc": 0.223, "lambada_ppl": 18.99},
    {"model": "Gated DeltaNet", "layers": 10, "state_dim": 768, "fineweb_ppl": 15.34, "lambada_acc": 0.208, "lambada_ppl": 17.23},
    {"model": "GPN+M", "layers": 1, "state_dim": 2496, "fineweb_ppl": 18.06, "lambada_acc": 0.146, "lambada_ppl": 33.45},
    {"model": "GPN+M", "layers": 2, "state_dim": 1920, "fineweb_ppl": 16.95, "lambada_acc": 0.160, "lambada_ppl": 27.39},
    {"model": "GPN", "layers": 1, "state_dim": 3184, "fineweb_ppl": 23.51, "lambada_acc": 0.015, "lambada_ppl": 263.6},
]  # fmt: skip

#: The three columns of Table 1: key -> header.
PAPER_COLUMNS = {"fineweb_ppl": "FineWeb PPL", "lambada_acc": "LAMBADA acc", "lambada_ppl": "LAMBADA PPL"}

#: Known evaluation tasks -> (Hub dataset id, dataset name, dataset config, split) for the model-index.
KNOWN_DATASETS: list[tuple[str, tuple[str, str, str | None, str | None]]] = [
    ("lambada", ("EleutherAI/lambada_openai", "LAMBADA (OpenAI)", "default", "test")),
    ("fineweb", ("HuggingFaceFW/fineweb-edu", "FineWeb-Edu", "sample-10BT", "train")),
    ("wikitext", ("EleutherAI/wikitext_document_level", "WikiText-2", "wikitext-2-raw-v1", "test")),
    ("shakespeare", ("karpathy/tiny_shakespeare", "Tiny Shakespeare", None, "test")),
]

#: Counts that evaluation tools report beside metrics (shown in the table, not in the model-index).
COUNT_METRICS = frozenset(
    {"examples", "target_tokens", "tokens_scored", "windows", "window", "stream_tokens", "dropped_tail_tokens", "documents"}
)

#: Keys whose values are never written into a card (credentials that a training config might carry).
SECRET_KEY = re.compile(r"(^|_)(token|hf_token|hub_token|password|secret|api_key|apikey)$", re.IGNORECASE)

USAGE_PROMPT = "The meaning of life is"


class CardError(ValueError):
    """The model card cannot be built or would not pass the Hub's metadata validation."""


# --------------------------------------------------------------------------------------------------
# Inputs


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


@dataclass
class TrainingInfo:
    """What the card uses from a training log: a recipe (flat key -> value) and the last logged values."""

    sources: list[str] = field(default_factory=list)
    recipe: dict[str, Any] = field(default_factory=dict)
    last: dict[str, Any] = field(default_factory=dict)
    datasets: list[str] = field(default_factory=list)
    log_rows: int = 0


def _is_number(value: Any) -> bool:
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
            if not _is_number(value):
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
    measured = {str(k): v for k, v in measured.items() if _is_number(v) and math.isfinite(v)}
    sources = data.get("data") if isinstance(data.get("data"), dict) else {}
    return EvalInfo(
        path=path,
        model=str(data["model"]) if data.get("model") is not None else None,
        n_params=int(n_params) if _is_number(n_params) else None,
        tasks=tasks,
        stderrs=stderrs,
        protocols=protocols,
        lm_eval_version=str(data["lm_eval_version"]) if data.get("lm_eval_version") else None,
        published_baselines=baselines,
        measured=measured,
        data={str(k): str(v) for k, v in sources.items()},
    )


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
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
            flat.update(_flatten(value, name + "."))
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
            if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", item) and not Path(item).exists() and not item.startswith("."):
                if item not in found:
                    found.append(item)
    return found


def read_training_info(model_dir: str | Path) -> TrainingInfo | None:
    """Read what a training run left in `model_dir`, or None when there is nothing.

    Looked for, in this order (all optional): `training_config.json` (the recipe: any JSON object,
    nested sections are flattened), `trainer_state.json` (transformers' Trainer: `log_history`,
    `global_step`, `max_steps`, `train_batch_size`), `train_log.jsonl`, then any other `*.jsonl` whose
    rows carry a `loss` (or `train_loss`) value. From log rows the card takes the last value of each
    key (loss, validation loss/perplexity, step, tokens, learning rate). Keys that look like
    credentials (`token`, `hub_token`, `password`, ...) are never read.
    """
    model_dir = Path(model_dir)
    info = TrainingInfo()
    config_path = model_dir / "training_config.json"
    if config_path.is_file():
        try:
            data = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            data = None
        if isinstance(data, dict):
            info.sources.append(config_path.name)
            info.recipe.update(_flatten(data))
    state_path = model_dir / "trainer_state.json"
    if state_path.is_file():
        try:
            state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            state = None
        if isinstance(state, dict):
            info.sources.append(state_path.name)
            for key in ("global_step", "max_steps", "train_batch_size", "num_train_epochs"):
                if key in state and state[key] is not None:
                    info.recipe.setdefault(key, state[key])
            history = [row for row in state.get("log_history") or [] if isinstance(row, dict)]
            info.log_rows += len(history)
            for row in history:
                info.last.update({k: v for k, v in _flatten(row).items() if _is_number(v)})
    logs = []
    if (model_dir / "train_log.jsonl").is_file():
        logs.append(model_dir / "train_log.jsonl")
    logs += [p for p in sorted(model_dir.glob("*.jsonl")) if p.name != "train_log.jsonl"]
    for path in logs:
        rows = _read_jsonl_rows(path)
        if path.name != "train_log.jsonl" and not any("loss" in r or "train_loss" in r for r in rows):
            continue
        if not rows:
            continue
        info.sources.append(path.name)
        info.log_rows += len(rows)
        for row in rows:
            info.last.update({k: v for k, v in _flatten(row).items() if _is_number(v)})
            for key in DATASET_KEYS:  # a log may state its data in a header row
                if isinstance(row.get(key), str) and key not in info.recipe:
                    info.recipe[key] = row[key]
    if not info.sources:
        return None
    info.datasets = _hub_dataset_ids(v for k, v in info.recipe.items() if k.split(".")[-1] in DATASET_KEYS)
    return info


# --------------------------------------------------------------------------------------------------
# The paper's columns


def _baseline_columns(row: dict[str, Any]) -> dict[str, float]:
    """Map a published-baseline row (flat or nested, any reasonable key names) to Table 1's columns."""
    values: dict[str, float] = {}
    for key, value in _flatten(row).items():
        if not _is_number(value):
            continue
        name = key.lower()
        is_ppl = "ppl" in name or "perplexity" in name
        if "fineweb" in name and is_ppl:
            values.setdefault("fineweb_ppl", value)
        elif "lambada" in name and is_ppl:
            values.setdefault("lambada_ppl", value)
        elif "lambada" in name and "acc" in name:
            values.setdefault("lambada_acc", value)
    return values


def _baseline_label(row: dict[str, Any]) -> tuple[str, str, str]:
    name = str(row.get("model") or row.get("name") or "?")
    layers = row.get("layers", row.get("num_layers", ""))
    state = row.get("state_dim", row.get("d", row.get("hidden_size", "")))
    return name, str(layers), str(state)


def _is_paper_lambada(task: str, protocol: str) -> bool:
    """The paper's LAMBADA variant (first-subword accuracy), not lm-eval's whole-word `lambada_openai`."""
    text = f"{task} {protocol}".lower()
    return "lambada" in task.lower() and ("paper" in text or "first subword" in text or "first-subword" in text)


def model_paper_columns(evaluation: EvalInfo) -> tuple[dict[str, float], dict[str, str]]:
    """This model's values for Table 1's columns, with the task each came from.

    Only protocol-matched tasks fill a column: a task named like `fineweb*` with a perplexity metric
    fills FineWeb PPL; the paper's LAMBADA variant (task or protocol mentions "paper" or "first
    subword") fills LAMBADA acc / PPL. lm-eval's standard `lambada_openai` measures something else
    (whole-word greedy match, per-example summed log-likelihood) and stays out of these columns.
    """
    values: dict[str, float] = {}
    sources: dict[str, str] = {}
    for key, value in evaluation.measured.items():  # `gpn eval` states the columns it measured
        if key in PAPER_COLUMNS:
            values[key] = value
            sources[key] = "comparison.measured"
    if values:
        return values, sources
    for task, metrics in evaluation.tasks.items():
        protocol = evaluation.protocols.get(task, "")
        for metric, value in metrics.items():
            m = metric.lower()
            is_ppl = m in ("ppl", "perplexity", "token_perplexity") or m.endswith("_perplexity") or m.endswith("_ppl")
            if "fineweb" in task.lower() and is_ppl and "word" not in m and "byte" not in m:
                key = "fineweb_ppl"
            elif _is_paper_lambada(task, protocol) and is_ppl:
                key = "lambada_ppl"
            elif _is_paper_lambada(task, protocol) and m == "acc":
                key = "lambada_acc"
            else:
                continue
            if key not in values:
                values[key] = value
                sources[key] = f"{task}/{metric}"
    return values, sources


# --------------------------------------------------------------------------------------------------
# The card


def variant_name(config) -> str:
    if not config.use_memory:
        return "GPN"
    if config.num_predict_layers == 1:
        return "GPN+M"
    return f"{config.num_predict_layers}-layer GPN+M"


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not _is_number(value):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if 1000 <= abs(value) < 1e7:
        return f"{value:,.1f}"
    if value == 0 or 1e-4 <= abs(value) < 1000:
        return f"{value:.4g}"
    return f"{value:.3e}"


def _human(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _dataset_for(task: str, source: str | None = None) -> tuple[str, str, str | None, str | None]:
    """(Hub id, name, config, split) of a task: from `gpn eval`'s "hf://NAME (CONFIG, SPLIT)", else by name."""
    match = re.fullmatch(r"hf://([\w.-]+/[\w.-]+)(?:\s*\(([^,()]*)(?:,\s*([^()]*))?\))?", (source or "").strip())
    if match:
        name, config, split = match.group(1), match.group(2), match.group(3)
        return (name, name.split("/")[-1], (config or "").strip() or None, (split or "").strip() or None)
    for needle, spec in KNOWN_DATASETS:
        if needle in task.lower():
            return spec
    return (task, task, None, None)


def eval_results_for_model_index(evaluation: EvalInfo) -> list:
    """`huggingface_hub.EvalResult`s for every metric of every task (counts such as `examples` left out).

    The Hub groups results by (task type, dataset, config, split), so two tasks on one dataset (lm-eval's
    `lambada_openai` and the paper's `lambada_paper`) share an entry: their metric types are then
    prefixed with the task (`lambada_paper_acc`) so none is ambiguous, and the entry's task name lists
    both. Every metric's display name is "TASK METRIC".
    """
    from huggingface_hub import EvalResult

    specs = {task: _dataset_for(task, evaluation.data.get(task)) for task in evaluation.tasks}
    sharing: dict[tuple, list[str]] = {}
    for task, spec in specs.items():
        sharing.setdefault(spec, []).append(task)
    results = []
    for task, metrics in evaluation.tasks.items():
        dataset_type, dataset_name, dataset_config, split = specs[task]
        group = sharing[specs[task]]
        for metric, value in metrics.items():
            if metric in COUNT_METRICS:
                continue
            try:
                result = EvalResult(
                    task_type="text-generation",
                    task_name=", ".join(group),
                    dataset_type=dataset_type,
                    dataset_name=dataset_name,
                    dataset_config=dataset_config,
                    dataset_split=split,
                    metric_type=metric if len(group) == 1 else f"{task}_{metric}",
                    metric_name=f"{task} {metric}",
                    metric_value=value,
                )
            except (TypeError, ValueError) as error:
                raise CardError(f"task {task!r}, metric {metric!r} cannot enter the model-index: {error}") from error
            results.append(result)
    return results


def usage_snippet(repo_id: str) -> str:
    """Python that loads the model from `repo_id` with plain transformers and generates."""
    return (
        "import torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "\n"
        f'repo = "{repo_id}"\n'
        "tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)  # it reads config.json too\n"
        "model = AutoModelForCausalLM.from_pretrained(repo, trust_remote_code=True)\n"
        "\n"
        f'inputs = tokenizer("{USAGE_PROMPT}", return_tensors="pt")\n'
        "with torch.no_grad():\n"
        "    output = model.generate(**inputs, max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.eos_token_id)\n"
        "print(tokenizer.decode(output[0], skip_special_tokens=True))\n"
    )


def extract_usage_snippet(card_text: str) -> str:
    """The first ```python block of the card's Usage section (what a reader would copy)."""
    section = card_text.split("## Usage", 1)
    if len(section) < 2:
        raise CardError("the card has no '## Usage' section")
    match = re.search(r"```python\n(.*?)```", section[1], re.DOTALL)
    if not match:
        raise CardError("the card's Usage section has no ```python block")
    return match.group(1)


KERNEL_NOTE = (
    "**The remote code compiles and loads C.** On CPU, `memory_kernels.py` compiles two small C kernels (the "
    "memory update of a step and its gradient) with the system's C compiler (`cc`, or `$CC`) on first use, "
    "at most `GPN_KERNEL_BUILD_TIMEOUT` seconds (default 60), and loads the shared library into the Python "
    "process with `ctypes`. Builds are cached in `$GPN_KERNEL_CACHE` (default `~/.cache/gpn/kernels`) and a "
    "cached build is loaded only if it and its folder are owned by you and writable by no one else and its "
    "content matches the hash recorded when it was built; anything else is rebuilt, with a warning. "
    "`GPN_MEMORY_KERNELS=0` turns them off: nothing is compiled or loaded, and torch operations compute the "
    "same results (somewhat slower)."
)


def build_card(
    config,
    repo_id: str,
    *,
    n_params: int,
    evaluation: EvalInfo | None = None,
    training: TrainingInfo | None = None,
    license: str = "mit",
    datasets: Iterable[str] = (),
    tags: Iterable[str] = (),
    model_name: str | None = None,
    tokenizer_name: str | None = None,
) -> str:
    """The README.md text: YAML metadata plus usage, architecture, training and evaluation sections."""
    from huggingface_hub import ModelCardData

    model_name = model_name or repo_id.split("/")[-1]
    all_datasets = list(dict.fromkeys([*datasets, *(training.datasets if training else [])]))
    all_tags = list(dict.fromkeys(["gpn", "grounded-prediction-network", "recurrent", "custom_code", f"arxiv:{PAPER_ARXIV}", *tags]))
    eval_results = eval_results_for_model_index(evaluation) if evaluation and evaluation.tasks else None
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        datasets=all_datasets or None,
        tags=all_tags,
        model_name=model_name,
        eval_results=eval_results,
    )
    variant = variant_name(config)
    lines: list[str] = [
        f"# {model_name}",
        "",
        f"A **{variant}** language model: a Grounded Prediction Network from \"{PAPER_TITLE}\" "
        f"([arXiv {PAPER_ARXIV}]({PAPER_URL})). One state vector"
        + (" and one matrix memory are" if config.use_memory else " is")
        + " revisited at every token; depth comes from time, not from a layer stack, so generation needs a "
        "constant amount of state whatever the context length.",
        "",
        "The modeling code ships in this repository (`trust_remote_code=True`); it needs only `torch` and "
        "`transformers`.",
        "",
        KERNEL_NOTE,
        "",
        "## Usage",
        "",
        "```python",
        usage_snippet(repo_id).rstrip("\n"),
        "```",
        "",
        "The model keeps a recurrent cache (`GPNCache`), so `generate()` reads the prompt once and then costs "
        "the same per token at any length. Assisted decoding is refused (a recurrent state cannot be rolled back).",
        "",
        "## Architecture",
        "",
        f"- Variant: {variant} ({config.num_predict_layers} predict layer{'s' if config.num_predict_layers != 1 else ''}"
        + (", sharing one memory" if config.use_memory and config.num_predict_layers > 1 else "")
        + ")",
        f"- Parameters: {n_params:,} ({_human(n_params)})",
        f"- State width d = {config.hidden_size:,}; token embedding e = {config.embedding_size:,} (tied to the "
        f"output through a d -> e projection); SwiGLU FFN width {config.intermediate_size:,}; vocabulary {config.vocab_size:,}",
        "- Output: `logits = lm_head(model.model(...).last_hidden_state)`, the base model's output being the decoded "
        "vector W_dec rms(p)" + (" + b_dec" if config.use_decoder_bias else "") + " and `lm_head` the tied embedding "
        "(so TRL, PEFT and fused losses see the model as they see a Llama); the predicted state p, the paper's object "
        "of study, is `model(ids, output_predicted_states=True).predicted_states`",
    ]
    if config.use_memory:
        lines.append(
            f"- Matrix memory: {config.num_memory_heads} heads x {config.memory_key_dim} x {config.memory_value_dim} = "
            f"{config.memory_cells:,} cells, written once per token with a gated delta rule"
        )
    else:
        lines.append("- No matrix memory")
    lines += [
        f"- Recurrent state per sequence: {config.state_floats_per_row:,} floats (2 x d + memory cells; "
        f"{_bytes(config.state_floats_per_row * 4)} in float32), constant in sequence length",
    ]
    if config.max_length_hint:
        lines.append(
            f"- Training window (`max_length_hint`, the default context of evaluation tools): {config.max_length_hint:,} "
            "tokens; a GPN itself has no positional limit"
        )
    if tokenizer_name:
        lines.append(f"- Tokenizer: {tokenizer_name}")
    lines.append("")

    lines += ["## Training", ""]
    if training is None:
        lines += ["No training log was found beside the weights, so the data and recipe are not stated here.", ""]
    else:
        if training.datasets:
            lines.append("Data: " + ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in training.datasets))
            lines.append("")
        if training.recipe:
            lines += ["| setting | value |", "|---|---|"]
            for key, value in training.recipe.items():
                if key.startswith("_"):
                    continue
                shown = ", ".join(map(str, value)) if isinstance(value, list) else _fmt(value)
                if isinstance(value, str) and Path(value).is_absolute():
                    shown = Path(value).name  # local paths say nothing to a reader (and may be private)
                lines.append(f"| {key} | {shown.replace('|', '/')} |")
            lines.append("")
        if training.last:
            wanted = [k for k in training.last if re.search(r"step|loss|ppl|perplexity|tokens|lr|learning_rate|epoch", k)]
            if wanted:
                lines.append("Last logged values: " + ", ".join(f"{k} = {_fmt(training.last[k])}" for k in wanted) + ".")
                lines.append("")
        lines += [f"Read from: {', '.join(f'`{s}`' for s in training.sources)} ({training.log_rows} log rows).", ""]

    lines += ["## Evaluation", ""]
    baselines = (evaluation.published_baselines if evaluation else []) or PAPER_TABLE_1
    if not any(_baseline_columns(row) for row in baselines):
        baselines = PAPER_TABLE_1
    measured, measured_from = model_paper_columns(evaluation) if evaluation else ({}, {})
    lines += [
        f"Beside the paper's Table 1 (130M-parameter models, FineWeb-Edu-10B, [arXiv {PAPER_ARXIV}]({PAPER_URL})). "
        "LAMBADA there is the paper's variant: accuracy = top-1 match of the first subword of the last word, "
        "perplexity = exp(mean cross-entropy over the last word's subwords).",
        "",
        "| model | layers | state dim | params | FineWeb PPL | LAMBADA acc | LAMBADA PPL |",
        "|---|---|---|---|---|---|---|",
    ]
    row = [f"**{model_name}** (this model)", str(config.num_predict_layers), f"{config.hidden_size:,}", _human(n_params)]
    row += [_fmt(measured[k]) if k in measured else "—" for k in PAPER_COLUMNS]
    lines.append("| " + " | ".join(row) + " |")
    for baseline in baselines:
        values = _baseline_columns(baseline)
        name, layers, state = _baseline_label(baseline)
        params = baseline.get("params", baseline.get("n_params", "130M"))
        params = _human(params) if _is_number(params) else str(params)
        cells = [f"{name} (paper)", layers, state, params] + [_fmt(values[k]) if k in values else "—" for k in PAPER_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if evaluation is None:
        lines += ["This model has not been evaluated yet (no `eval_results.json` beside the weights): `gpn eval` writes one.", ""]
    else:
        if measured_from and set(measured_from.values()) == {"comparison.measured"}:
            lines += ["This model's columns are the ones `gpn eval` measured by the paper's protocols.", ""]
        elif measured_from:
            lines += ["This model's columns come from: " + ", ".join(f"{PAPER_COLUMNS[k]} = `{v}`" for k, v in measured_from.items()) + ".", ""]
        else:
            lines += ["None of this model's tasks follows the paper's protocols, so its Table 1 columns are empty; all results follow.", ""]
        lines += ["All results of this model" + (f" (lm-eval {evaluation.lm_eval_version})" if evaluation.lm_eval_version else "") + ":", ""]
        lines += ["| task | metric | value |", "|---|---|---|"]
        for task, metrics in evaluation.tasks.items():
            for metric, value in metrics.items():
                stderr = evaluation.stderrs.get(task, {}).get(metric)
                shown = _fmt(value) + (f" ± {_fmt(stderr)}" if stderr is not None else "")
                lines.append(f"| {task} | {metric} | {shown} |")
        lines.append("")
        protocols = [(task, evaluation.protocols[task]) for task in evaluation.tasks if evaluation.protocols.get(task)]
        if protocols:
            lines += ["What each task measures:", ""]
            lines += [f"- `{task}`: {' '.join(protocol.split())}" for task, protocol in protocols]
            lines.append("")

    lines += [
        "## Citation",
        "",
        "```bibtex",
        "@article{wang2026gpn,",
        f"  title   = {{{PAPER_TITLE}}},",
        "  author  = {Wang, Zanmin},",
        f"  journal = {{arXiv preprint arXiv:{PAPER_ARXIV}}},",
        "  year    = {2026}",
        "}",
        "```",
        "",
        f"Reference implementation (JAX): {REFERENCE_CODE}.",
        "",
    ]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


def validate_card(text: str) -> dict[str, Any]:
    """Parse the card as the Hub does; return its metadata or raise `CardError` naming the problem.

    Checks: the YAML block parses with `huggingface_hub.ModelCard`; `library_name` and `pipeline_tag`
    are set; a `model-index` converts with `huggingface_hub.repocard_data.model_index_to_eval_results`
    and every metric value is a finite number; `metadata_eval_result` rebuilds the same model-index.
    """
    from huggingface_hub import ModelCard, metadata_eval_result
    from huggingface_hub.repocard_data import model_index_to_eval_results

    try:
        card = ModelCard(text, ignore_metadata_errors=False)
    except Exception as error:  # noqa: BLE001 - any parse failure is the same refusal
        raise CardError(f"the model card's metadata does not parse: {error}") from error
    metadata = card.data.to_dict()
    for key, want in (("library_name", "transformers"), ("pipeline_tag", "text-generation")):
        if metadata.get(key) != want:
            raise CardError(f"the model card's metadata must have {key}: {want}, got {metadata.get(key)!r}")
    model_index = metadata.get("model-index")
    if model_index is not None:
        try:
            name, results = model_index_to_eval_results(model_index)
        except Exception as error:  # noqa: BLE001
            raise CardError(f"the model card's model-index is invalid: {error!r}") from error
        for result in results:
            if not _is_number(result.metric_value) or not math.isfinite(result.metric_value):
                raise CardError(
                    f"the model card's model-index has a non-finite or non-numeric value for "
                    f"{result.task_name or result.dataset_name}/{result.metric_type}: {result.metric_value!r}"
                )
        for result in results:  # the single-result helper the Hub documents must accept each one
            try:
                metadata_eval_result(
                    model_pretty_name=name,
                    task_pretty_name=result.task_name or result.task_type,
                    task_id=result.task_type,
                    metrics_pretty_name=result.metric_name or result.metric_type,
                    metrics_id=result.metric_type,
                    metrics_value=result.metric_value,
                    dataset_pretty_name=result.dataset_name,
                    dataset_id=result.dataset_type,
                )
            except Exception as error:  # noqa: BLE001
                raise CardError(f"the model card's eval result {result} is invalid: {error!r}") from error
    return metadata


__all__ = [
    "CardError",
    "EvalInfo",
    "PAPER_TABLE_1",
    "TrainingInfo",
    "build_card",
    "extract_usage_snippet",
    "model_paper_columns",
    "read_eval_results",
    "read_training_info",
    "usage_snippet",
    "validate_card",
]
