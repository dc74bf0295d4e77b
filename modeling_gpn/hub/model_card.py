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

Where its parts live: this module writes the card (`build_card`, section by section, and the paper's
columns); `card_inputs.py` reads the evaluation results and the training log; `card_metadata.py` builds the
model-index and validates the card. Their public names are re-exported here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..configuration_gpn import GPNConfig

from ..evaluation.report import PAPER_FINEWEB_WINDOW, PAPER_LAMBADA_EXAMPLES
from .card_inputs import (
    DATASET_KEYS,
    SECRET_KEY,
    EvalInfo,
    TrainingInfo,
    flatten,
    is_number,
    read_eval_results,
    read_training_info,
)
from .card_metadata import COUNT_METRICS, KNOWN_DATASETS, eval_results_for_model_index, validate_card
from .errors import CardError

PAPER_TITLE = "A Single-Layer Model Can Do Language Modeling"
PAPER_ARXIV = "2605.10643"
PAPER_URL = f"https://arxiv.org/abs/{PAPER_ARXIV}"
REFERENCE_CODE = "https://github.com/steve-z-wang/grounded-prediction-network"

#: The paper's Table 1 (130M parameters; GPN.md). Used when the evaluation JSON has no baselines.
PAPER_TABLE_1: list[dict[str, Any]] = [
    {
        "model": "Transformer++",
        "layers": 12,
        "state_dim": 768,
        "fineweb_ppl": 16.05,
        "lambada_acc": 0.223,
        "lambada_ppl": 18.99,
    },
    {
        "model": "Gated DeltaNet",
        "layers": 10,
        "state_dim": 768,
        "fineweb_ppl": 15.34,
        "lambada_acc": 0.208,
        "lambada_ppl": 17.23,
    },
    {
        "model": "GPN+M",
        "layers": 1,
        "state_dim": 2496,
        "fineweb_ppl": 18.06,
        "lambada_acc": 0.146,
        "lambada_ppl": 33.45,
    },
    {
        "model": "GPN+M",
        "layers": 2,
        "state_dim": 1920,
        "fineweb_ppl": 16.95,
        "lambada_acc": 0.160,
        "lambada_ppl": 27.39,
    },
    {"model": "GPN", "layers": 1, "state_dim": 3184, "fineweb_ppl": 23.51, "lambada_acc": 0.015, "lambada_ppl": 263.6},
]

#: The three columns of Table 1: key -> header.
PAPER_COLUMNS = {"fineweb_ppl": "FineWeb PPL", "lambada_acc": "LAMBADA acc", "lambada_ppl": "LAMBADA PPL"}

USAGE_PROMPT = "The meaning of life is"


# --------------------------------------------------------------------------------------------------
# The paper's columns


def _baseline_columns(row: dict[str, Any]) -> dict[str, float]:
    """Map a published-baseline row (flat or nested, any reasonable key names) to Table 1's columns."""
    values: dict[str, float] = {}
    for key, value in flatten(row).items():
        if not is_number(value):
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


def variant_name(config: GPNConfig) -> str:
    """The model's variant as the paper names it: "GPN", "GPN+M" or "N-layer GPN+M"."""
    if not config.use_memory:
        return "GPN"
    if config.num_predict_layers == 1:
        return "GPN+M"
    return f"{config.num_predict_layers}-layer GPN+M"


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or not is_number(value):
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


KERNEL_NOTE = (
    "**The remote code compiles and loads C.** On CPU, `memory_kernels.py` compiles its C kernels (the memory "
    "half of a step and its gradient, and the whole no-grad step of 1 to 16 rows: a prompt's prefill and every "
    "decoded token) with the system's C compiler (`cc`, or `$CC`) on first use, "
    "at most `GPN_KERNEL_BUILD_TIMEOUT` seconds (default 60), and loads the shared library into the Python "
    "process with `ctypes`. Builds are cached in `$GPN_KERNEL_CACHE` (default `~/.cache/gpn/kernels`) and a "
    "cached build is loaded only if it and its folder are owned by you and writable by no one else and its "
    "content matches the hash recorded when it was built; anything else is rebuilt, with a warning. "
    "`GPN_MEMORY_KERNELS=0` turns them off: nothing is compiled or loaded, and torch operations compute the "
    "same results, slower; so they do, without a warning, where there is no C compiler. "
    "`model.model.last_recurrence_backends` says what the last call ran (`'c step kernels'`, or `'torch ops'`)."
)


def build_card(
    config: GPNConfig,
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
    base_model: str | None = None,
) -> str:
    """The README.md text: YAML metadata plus usage, architecture, training and evaluation sections."""
    from huggingface_hub import ModelCardData

    model_name = model_name or repo_id.split("/")[-1]
    all_datasets = list(dict.fromkeys([*datasets, *(training.datasets if training else [])]))
    all_tags = list(
        dict.fromkeys(["gpn", "grounded-prediction-network", "recurrent", "custom_code", f"arxiv:{PAPER_ARXIV}", *tags])
    )
    eval_results = eval_results_for_model_index(evaluation) if evaluation and evaluation.tasks else None
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        datasets=all_datasets or None,
        tags=all_tags,
        model_name=model_name,
        eval_results=eval_results,
        base_model=base_model,  # the Hub links a fine-tune or a merged adapter to the model it came from
    )
    variant = variant_name(config)
    lines = intro_lines(config, variant, model_name, repo_id)
    lines += architecture_lines(config, variant, n_params, tokenizer_name)
    lines += training_lines(training)
    lines += evaluation_lines(config, model_name, n_params, evaluation)
    lines += citation_lines()
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


def intro_lines(config: GPNConfig, variant: str, model_name: str, repo_id: str) -> list[str]:
    """The title, what the model is, the note on its compiled C kernels, and how to use it."""
    return [
        f"# {model_name}",
        "",
        f'A **{variant}** language model: a Grounded Prediction Network from "{PAPER_TITLE}" '
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
    ]


def architecture_lines(config: GPNConfig, variant: str, n_params: int, tokenizer_name: str | None) -> list[str]:
    """Variant, size, widths, the memory's shape and the recurrent state's size."""
    lines = [
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
    return lines


def training_lines(training: TrainingInfo | None) -> list[str]:
    """The data, the recipe and the last logged values, from the training log when there is one."""
    lines = ["## Training", ""]
    if training is None:
        return lines + ["No training log was found beside the weights, so the data and recipe are not stated here.", ""]
    if training.conversion:
        source = training.conversion.get("source", "?")
        kind = training.conversion.get("format")
        lines += [
            f"Converted with `gpn convert` from the reference implementation's ({REFERENCE_CODE}) checkpoint "
            f"`{source}`" + (f" ({kind})" if kind else "") + ": the weights are those the reference trainer wrote, "
            "float32, computing what the reference computes.",
            "",
        ]
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
            shown = shown.replace("|", "/").replace("\n", "\\n")  # one table cell: no pipe, no line break
            lines.append(f"| {key} | {shown} |")
        lines.append("")
    if training.last:
        wanted = [k for k in training.last if re.search(r"step|loss|ppl|perplexity|tokens|lr|learning_rate|epoch", k)]
        if wanted:
            lines.append("Last logged values: " + ", ".join(f"{k} = {_fmt(training.last[k])}" for k in wanted) + ".")
            lines.append("")
    rows = f" ({training.log_rows} log rows)" if training.log_rows else ""
    return lines + [f"Read from: {', '.join(f'`{s}`' for s in training.sources)}{rows}.", ""]


def evaluation_lines(config: GPNConfig, model_name: str, n_params: int, evaluation: EvalInfo | None) -> list[str]:
    """This model beside the paper's Table 1 (protocol-matched columns only), then all of its results."""
    baselines = (evaluation.published_baselines if evaluation else []) or PAPER_TABLE_1
    if not any(_baseline_columns(row) for row in baselines):
        baselines = PAPER_TABLE_1
    measured, measured_from = model_paper_columns(evaluation) if evaluation else ({}, {})
    lines = [
        "## Evaluation",
        "",
        f"Beside the paper's Table 1 (130M-parameter models, FineWeb-Edu-10B, [arXiv {PAPER_ARXIV}]({PAPER_URL})). "
        "LAMBADA there is the paper's variant: accuracy = top-1 match of the first subword of the last word, "
        "perplexity = exp(mean cross-entropy over the last word's subwords).",
        "",
        "| model | layers | state dim | params | FineWeb PPL | LAMBADA acc | LAMBADA PPL |",
        "|---|---|---|---|---|---|---|",
    ]
    row = [
        # (a quantized run's figures are never read as the float model's: gpn eval's report names its row so too)
        f"**{model_name}** (this model"
        + (f", {evaluation.quantized} weights)" if evaluation and evaluation.quantized else ")"),
        str(config.num_predict_layers),
        f"{config.hidden_size:,}",
        _human(n_params),
    ]
    row += [_fmt(measured[k]) if k in measured else "—" for k in PAPER_COLUMNS]
    lines.append("| " + " | ".join(row) + " |")
    for baseline in baselines:
        values = _baseline_columns(baseline)
        name, layers, state = _baseline_label(baseline)
        params = baseline.get("params", baseline.get("n_params", "130M"))
        params = _human(params) if is_number(params) else str(params)
        cells = [f"{name} (paper)", layers, state, params] + [
            _fmt(values[k]) if k in values else "—" for k in PAPER_COLUMNS
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if evaluation is None:
        return lines + [
            "This model has not been evaluated yet (no `eval_results.json` beside the weights): `gpn eval` writes one.",
            "",
        ]
    # the run's differences from the paper's (shorter windows, fewer examples, cast weights) stand beside its figures
    differences = "; ".join(run_differences(evaluation))
    differences = f", but not as the paper ran them: {differences}" if differences else ""
    if measured_from and set(measured_from.values()) == {"comparison.measured"}:
        lines += [f"This model's columns are the ones `gpn eval` measured by the paper's protocols{differences}.", ""]
    elif measured_from:
        lines += [
            "This model's columns come from: "
            + ", ".join(f"{PAPER_COLUMNS[k]} = `{v}`" for k, v in measured_from.items())
            + differences
            + ".",
            "",
        ]
    else:
        lines += [
            "None of this model's tasks follows the paper's protocols, so its Table 1 columns are empty; all results follow.",
            "",
        ]
    return lines + results_lines(evaluation)


def run_differences(evaluation: EvalInfo) -> list[str]:
    """How the evaluation's run differs from the paper's, as `gpn eval`'s own report flags it: a figure beside
    Table 1 from other text than FineWeb-Edu, shorter FineWeb windows, fewer LAMBADA examples, LAMBADA contexts cut
    to a window or cast weights is not the paper's measure."""
    differences = []
    fineweb_data = evaluation.data.get("fineweb_paper")
    if "fineweb_paper" in evaluation.tasks and fineweb_data and "fineweb" not in fineweb_data.lower():
        # (gpn eval's protocol on another corpus: a held-out split of the training text, --task-data, ...)
        differences.append(f"FineWeb PPL scored on other text than FineWeb-Edu ({fineweb_data})")
    window = evaluation.tasks.get("fineweb_paper", {}).get("window")
    if is_number(window) and window != PAPER_FINEWEB_WINDOW:
        differences.append(f"FineWeb PPL over {window:,}-token windows (the paper's are {PAPER_FINEWEB_WINDOW:,})")
    examples = evaluation.tasks.get("lambada_paper", {}).get("examples")
    if is_number(examples) and examples != PAPER_LAMBADA_EXAMPLES:
        differences.append(f"LAMBADA on {examples:,} examples (the paper's are all {PAPER_LAMBADA_EXAMPLES:,})")
    truncated = evaluation.tasks.get("lambada_paper", {}).get("truncated_examples")
    if is_number(truncated) and truncated:  # (a context longer than the model's window, left-truncated as lm-eval's)
        differences.append(
            f"LAMBADA with {truncated:,} contexts left-truncated to `gpn eval --max-length` (the paper "
            "reads them whole)"
        )
    if evaluation.quantization:  # (a quantized run is never read as the float model's figures)
        differences.append(f"the weights quantized: {evaluation.quantization} (`gpn eval --dtype {evaluation.dtype}`)")
    elif evaluation.dtype and evaluation.dtype != "float32":
        differences.append(f"the weights cast to {evaluation.dtype} (`gpn eval --dtype {evaluation.dtype}`)")
    return differences


def results_lines(evaluation: EvalInfo) -> list[str]:
    """Every metric of every task (with its stderr), and what each task measures."""
    lines = [
        "All results of this model"
        + (f" (lm-eval {evaluation.lm_eval_version})" if evaluation.lm_eval_version else "")
        + (f", measured with the weights in {evaluation.dtype}" if evaluation.dtype else "")
        + (f" ({evaluation.quantization})" if evaluation.quantization else "")
        + ":",
        "",
    ]
    if evaluation.limit is not None:
        lines += [
            f"Scored on the first {evaluation.limit:,} examples of each task (`gpn eval --limit {evaluation.limit}`; "
            "`fineweb_paper` excepted, its windows are counted below), not on whole test sets: the model-index "
            f"names the split `test[:{evaluation.limit}]`.",
            "",
        ]
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
    return lines


def citation_lines() -> list[str]:
    return [
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


__all__ = [
    "COUNT_METRICS",
    "CardError",
    "DATASET_KEYS",
    "EvalInfo",
    "KNOWN_DATASETS",
    "PAPER_COLUMNS",
    "PAPER_TABLE_1",
    "SECRET_KEY",
    "TrainingInfo",
    "build_card",
    "eval_results_for_model_index",
    "model_paper_columns",
    "read_eval_results",
    "run_differences",
    "read_training_info",
    "usage_snippet",
    "validate_card",
    "variant_name",
]
