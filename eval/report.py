"""The markdown report: the evaluated model's rows beside the paper's Table 1 (see `cli.py`)."""

from __future__ import annotations

import math
from typing import Any

COLUMNS = (
    ("fineweb_ppl", "FineWeb PPL", "{:.2f}"),
    ("lambada_acc", "LAMBADA acc", "{:.3f}"),
    ("lambada_ppl", "LAMBADA PPL", "{:.2f}"),
)
# The published rows as GPN.md quotes Table 1: perplexities to 4 significant figures (a fixed 2 decimals wrote the
# paper's 263.6 as 263.60, a digit it does not give), accuracies to 3 decimals (0.160, not 0.16).
PUBLISHED_PATTERNS = {"fineweb_ppl": "{:.4g}", "lambada_acc": "{:.3f}", "lambada_ppl": "{:.4g}"}


def _fmt(value: Any, pattern: str = "{:.4g}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return pattern.format(value)


def _params(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e5 else f"{n:,}"


def _direction(metrics: dict[str, Any], column: str) -> str:
    """↑ where a higher figure of `column` is better (accuracy), ↓ where a lower one is (perplexity)."""
    return "↑" if metrics[column]["higher_is_better"] else "↓"


def render_report(results: dict[str, Any]) -> str:
    """Markdown: Table 1 with the measured row, ratios to every published row, all metrics, protocols."""
    metrics = results["baseline_metrics"]
    measured = results["comparison"]["measured"]
    name = results["model"]
    quantization = results.get("quantization")  # (absent from results written before it was recorded: float)
    lines = [
        f"# Evaluation of `{name}`",
        "",
        f"- model: `{name}` ({results['architecture']}, model_type `{results['model_type']}`), "
        f"**{results['n_params']:,} parameters** ({_params(results['n_params'])})"
        + (
            f"; a PEFT adapter, scored merged into its base `{results['adapter']['base_model']}`, with the "
            f"tokenizer of `{results['adapter']['tokenizer']}`"
            if results.get("adapter")
            else ""
        ),
        f"- lm-eval {results['lm_eval_version']}; max_length {results['max_length']}; dtype {results['dtype']}; "
        f"device {results['device']}; batch size {results['batch_size']}"
        + (f"; **weights quantized: {quantization['summary']}**" if quantization else "")
        # (--limit cuts the LAMBADA and lm-eval tasks only: the FineWeb windows are counted in their own note)
        + (
            f"; **limit: the first {results['limit']} examples of each LAMBADA and lm-eval task**"
            if results.get("limit")
            else ""
        ),
        *(
            f"- **task `{task}` failed, not scored** ({error}): the figures are those of the tasks before it"
            for task, error in results.get("failed", {}).items()
        ),
        "",
        "## Beside the paper's Table 1",
        "",
        f"Published rows: {results['baselines_citation']} Measured rows use the same protocol as the column "
        "(see *Protocols*); a dash means the task was not run; ↓: lower is better, ↑: higher is better.",
        "",
        "| model | source | params | layers | state dim | "
        + " | ".join(f"{title} {_direction(metrics, key)}" for key, title, _ in COLUMNS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for row in results["published_baselines"]:
        cells = [_fmt(row.get(key), PUBLISHED_PATTERNS[key]) for key, _, _ in COLUMNS]
        lines.append(
            f"| {row['model']} | published | ≈{row['params'] / 1e6:.4g}M | {row['layers']} | {row['state_dim']} | "
            + " | ".join(cells)
            + " |"
        )
    layers = results.get("layers", "–")
    state = results.get("state_dim", "–")
    cells = [_fmt(measured.get(key), pattern) for key, _, pattern in COLUMNS]
    # (a quantized run's row says so in its name: never read as the float model's)
    row_name = f"**{name}** ({quantization['weights']} weights)" if quantization else f"**{name}**"
    lines.append(
        f"| {row_name} | measured | {_params(results['n_params'])} | {layers} | {state} | "
        + " | ".join(f"**{c}**" for c in cells)
        + " |"
    )
    lines += ["", *_measured_row_notes(results)]
    lines += [
        "",
        "## Ratio of the measured model to each published row",
        "",
        "measured / published (perplexity: below 1 is better; accuracy: above 1 is better). "
        'The paper states its gaps this way ("within 13% of Transformer++" = FineWeb PPL ratio 1.13).',
        "",
        "| published row | " + " | ".join(f"{title} ratio" for _, title, _ in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    for model, ratios in results["comparison"]["ratio_to_published"].items():
        lines.append(f"| {model} | " + " | ".join(_fmt(ratios.get(key), "{:.3f}") for key, _, _ in COLUMNS) + " |")
    lines += ["", "## All measured metrics", "", "| task | metric | value | wall time (s) |", "|---|---|---|---|"]
    for task, task_metrics in results["tasks"].items():
        for metric, value in task_metrics.items():
            lines.append(f"| {task} | {metric} | {_fmt(value, '{:.6g}')} | {results['wall_time_s'].get(task, 0):.1f} |")
    lines += ["", "## Protocols", "", "| row / task | protocol | data |", "|---|---|---|"]
    for key, spec in metrics.items():
        title = dict((k, t) for k, t, _ in COLUMNS)[key]
        lines.append(f"| published {title} | {spec['protocol']} | paper |")
    for task, protocol in results["protocols"].items():
        lines.append(f"| measured `{task}` | {protocol} | {results['data'].get(task, '')} |")
    lines.append("")
    return "\n".join(lines)


#: The paper's FineWeb window and LAMBADA test set (GPN.md), against which a measured row's run is stated (here
#: and in a model card, `modeling_gpn.hub.model_card`).
PAPER_FINEWEB_WINDOW, PAPER_LAMBADA_EXAMPLES = 2048, 5153


def _measured_row_notes(results: dict[str, Any]) -> list[str]:
    """Where the measured row's run differs in size from the paper's (fewer examples, shorter windows)."""
    notes = []
    lambada = results["tasks"].get("lambada_paper")
    if lambada:
        n = lambada.get("examples")
        flag = (
            ""
            if n == PAPER_LAMBADA_EXAMPLES
            else f" (**not the full set**; the paper uses all {PAPER_LAMBADA_EXAMPLES})"
        )
        truncated = lambada.get("truncated_examples")
        if truncated:  # (the paper reads every context whole)
            flag += (
                f" (**{truncated} of them with the context cut to its last {results['max_length']} tokens**; the paper "
                "reads them whole: raise --max-length)"
            )
        notes.append(
            f"- measured LAMBADA: {n} examples, {lambada.get('target_tokens')} last-word subwords{flag}; data {results['data'].get('lambada_paper')}"
        )
    fineweb = results["tasks"].get("fineweb_paper")
    if fineweb:
        window = fineweb.get("window")
        flag = "" if window == PAPER_FINEWEB_WINDOW else f" (**the paper uses {PAPER_FINEWEB_WINDOW}**)"
        convention = (
            "all positions, first from the empty state"
            if fineweb.get("tokens_scored") == fineweb.get("windows", 0) * (window or 0)
            else "first position of each window not scored"
        )
        notes.append(
            f"- measured FineWeb: {fineweb.get('windows')} windows of {window} tokens{flag}, {fineweb.get('tokens_scored'):,} tokens scored "
            f"({convention}); data {results['data'].get('fineweb_paper')} (the paper's held-out bin is not public)"
        )
    return notes
