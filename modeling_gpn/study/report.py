"""The study's report: study_report.md (the table, the ratios, the training summary, the reading) and
training_curves.png."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ..atomic_files import replacing


def fmt(value, pattern="{:.3f}") -> str:
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


def render_report(results: dict[str, Any]) -> str:
    rows, recipe = results["rows"], results["recipe"]
    lines = [
        f"# GPN small-scale replication: {results['study']}",
        "",
        f"Every model: same tokenizer ({recipe.get('tokenizer')}), data ({recipe.get('dataset')}), "
        f"{results['tokens_per_model']:,} training tokens ({recipe['steps']} steps x {recipe['batch_size']} windows x "
        f"{recipe['seq_len']} tokens), recipe and seed {recipe.get('seed', 0)}. {wall_time(results)}{left_out(results)}",
        "",
        "Parameters are matched on the non-embedding count (the token embedding dominates at this scale).",
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
    # (gpn train's own validation at the end of its run: other windows and protocol than the table's held-out PPL)
    lines += ["| model | first loss | last loss | gpn train's validation PPL | wall time |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {fmt(row['first_loss'])} | {fmt(row['last_loss'])} | {fmt(row['val_ppl'], '{:.2f}')} | "
            f"{row['train_wall_s'] / 60:.1f} min |"
        )
    lines += ["", "## Reading", ""] + [f"- {line}" for line in results["reading"]]
    lines += [
        "",
        "At this scale and budget the numbers test the pipeline and the direction of the paper's claims, not "
        "their size: the paper trains 130M-parameter models on ~2.6B tokens.",
    ]
    return "\n".join(lines) + "\n"


def plot_curves(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, run in runs.items():
        curve = run["train"]["curve"]
        if curve:
            tokens, losses = zip(*curve)
            ax.plot(tokens, losses, label=name, linewidth=1.6)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("Training curves, same data, tokenizer, recipe and seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with replacing(path, "wb") as handle:  # (whole or not at all, as the report beside it)
        fig.savefig(handle, format="png", dpi=120)
    plt.close(fig)
