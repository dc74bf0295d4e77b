"""The study's report: study_report.md (the table, the ratios, the training summary, the reading) and
training_curves.png."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..cli.figures import pyplot, save_figure


def fmt(value: object, pattern: str = "{:.3f}") -> str:
    """`value` by `pattern`, or a dash for None or a non-finite float."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    return pattern.format(value)


def wall_time(results: dict[str, Any]) -> str:
    """The study's wall time, saying which models an earlier run trained (their time is not in it)."""
    minutes = results["wall_time_s"] / 60
    reused = results.get("reused")
    if not reused:
        return f"Wall time of the whole study: {minutes:.1f} min."
    return f"Wall time of this run: {minutes:.1f} min (reused from earlier runs of the study: {', '.join(reused)})."


def left_out(results: dict[str, Any]) -> str:
    """The models of the study missing from the table, and why (a run of part of it: `--only`)."""
    missing = results.get("left_out")
    if not missing:
        return ""
    reasons = "; ".join(f"{name} ({why})" for name, why in missing.items())
    return f" Left out of this report, models of the study without finished figures here: {reasons}."


def first_position(results: dict[str, Any]) -> str:
    """Which models' first position of a window the held-out PPL scores (`gpn eval`'s default: a GPN's, predicted
    from its empty state as in the paper; a baseline has nothing to predict it from, so its first is left out)."""
    if results["eval"].get("first_position") == "skip":
        return "every window's first position not scored"
    return "a GPN's first position predicted from its empty state, a baseline's not scored (nothing precedes it)"


def parameter_match(rows: dict[str, dict]) -> str:
    """How close the models' non-embedding parameter counts are, measured from the models (the report said they
    were matched whatever they were: the toy study's differ by 39%)."""
    counts = {name: row["non_embedding_params"] for name, row in rows.items()}
    if not counts:
        return ""
    low, high = min(counts.values()), max(counts.values())
    spread = (high - low) / low * 100 if low else math.inf
    return (
        "Parameters are compared on the non-embedding count (the token embedding dominates at this scale): "
        f"{low:,} to {high:,} here, the largest {spread:.1f}% above the smallest."
    )


def smoothing(results: dict[str, Any]) -> str:
    """What each point of the training curves and the first / last loss are: `gpn train` logs the mean loss of
    the `log_interval` steps before each record, not one step's."""
    interval = results.get("log_interval")
    if interval is None:  # (study_results.json written before it was recorded)
        return "the training loss gpn train logged"
    if interval == 1:
        return "each step's training loss"
    return f"the mean training loss of the {interval} steps up to each logged step (gpn train's log_interval)"


def resumed(row: dict[str, Any]) -> str:
    """Beside a model's wall time: that its training was stopped and resumed (its time before a stop the study saw
    is counted, before a crash not)."""
    step = row.get("resumed_at_step")
    return "" if step is None else f" (resumed at step {step})"


def render_report(results: dict[str, Any]) -> str:
    """The study's Markdown report: the comparison table and the recipe."""
    rows, recipe = results["rows"], results["recipe"]
    lines = [
        f"# GPN small-scale replication: {results['study']}",
        "",
        f"Every model: same tokenizer ({recipe.get('tokenizer')}), data ({recipe.get('dataset')}), "
        f"{results['tokens_per_model']:,} training tokens ({recipe['steps']} steps x {recipe['batch_size']} windows x "
        f"{recipe['seq_len']} tokens), recipe and seed {recipe.get('seed', 0)}. {wall_time(results)}{left_out(results)}",
        "",
        parameter_match(rows),
        "",
        "| model | layers | state dim | memory cells | params (non-emb.) | held-out PPL | LAMBADA acc | LAMBADA PPL "
        "| lm-eval LAMBADA acc | lm-eval LAMBADA PPL | train tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['layers']} | {row['state_dim']} | {row['memory_cells']:,} | {row['params']:,} "
            f"({row['non_embedding_params']:,}) | {fmt(row['fineweb_ppl'], '{:.2f}')} | {fmt(row['lambada_acc'])} | "
            f"{fmt(row['lambada_ppl'], '{:.2f}')} | {fmt(row['lm_eval_lambada_acc'])} | "
            f"{fmt(row['lm_eval_lambada_ppl'], '{:.1f}')} | {fmt(row['train_tokens_per_s'], '{:,.0f}')} |"
        )
    lines += [
        "",
        f"Held-out PPL: the paper's FineWeb protocol on {results['held_out_data']} (non-overlapping windows, each "
        f"from the zero state; {first_position(results)}). LAMBADA acc / PPL: the "
        "paper's variant (first subword of the last word; PPL pooled over the last word's subwords). lm-eval "
        "columns: the standard `lambada_openai` (whole-word greedy match, per-example perplexity).",
        "",
        "## Gaps as ratios (perplexity of the GPN / perplexity of the baseline)",
        "",
        "| model | baseline | metric | measured here | paper (130M) |",
        "|---|---|---|---|---|",
    ]
    for row in results["ratios"]:
        lines.append(
            f"| {row['model']} | {row['baseline']} | {row['metric']} | {fmt(row['measured'])} | {fmt(row['published'])} |"
        )
    lines += ["", "## Training", "", "![loss against tokens](training_curves.png)", ""]
    lines += [f"Curves, first and last loss: {smoothing(results)}, for every model alike.", ""]
    # (gpn train's own validation at the end of its run: other windows and protocol than the table's held-out PPL)
    lines += ["| model | first loss | last loss | gpn train's validation PPL | wall time |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {fmt(row['first_loss'])} | {fmt(row['last_loss'])} | {fmt(row['val_ppl'], '{:.2f}')} | "
            f"{row['train_wall_s'] / 60:.1f} min{resumed(row)} |"
        )
    lines += ["", "## Reading", ""] + [f"- {line}" for line in results["reading"]]
    lines += [
        "",
        "At this scale and budget the numbers test the pipeline and the direction of the paper's claims, not "
        "their size: the paper trains 130M-parameter models on ~2.6B tokens.",
    ]
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, dict], path: Path) -> None:
    """Plot each run's training and validation loss curves to `path`."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        curve = run["train"]["curve"]
        if curve:
            tokens, losses = zip(*curve)
            ax.plot(tokens, losses, label=name, linewidth=1.6)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("training loss (nats/token, mean of each log interval)")  # (gpn train's log records)
    ax.set_title("Training curves, same data, tokenizer, recipe and seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)  # (whole or not at all, as the report beside it)
