"""The report as Markdown (report.md, and what `gpn inspect` prints): one table per measurement, the paper's
values beside the measured ones where the paper gives them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        return "∞" if value > 0 else "—"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{max(digits, 4)}g}"


def report_markdown(report: dict, figures: Sequence[str] = ()) -> str:
    """The report as Markdown tables (paper values beside the measured ones where the paper gives them)."""
    lines = overview_lines(report["model"], report["data"])
    lines += geometry_lines(report["geometry"])
    lines += mean_direction_lines(report["mean_direction"])
    lines += horizons_lines(report["horizons"])
    if report.get("memory"):
        lines += memory_lines(report["memory"], bool(report["data"].get("document_resets")))
    elif not report["model"]["use_memory"]:  # (the section was left out without a word)
        lines += ["## Memory retention", "", "Skipped: this model has no matrix memory (a GPN), so no decays γ.", ""]
    if report.get("ablations"):
        lines += ablation_lines(report["ablations"])
    if figures:
        lines += ["## Figures", ""] + [f"![{Path(f).stem}]({Path(f).name})" for f in figures] + [""]
    return "\n".join(lines)


def overview_lines(m: dict, data: dict) -> list[str]:
    """The report's title and its model and data overview."""
    return [
        "# GPN state inspection",
        "",
        f"Model `{m['name_or_path']}`: d = {m['hidden_size']}, {m['num_predict_layers']} predict layer(s), "
        + (f"memory {m['num_memory_heads']} heads" if m["use_memory"] else "no memory")
        + f", {m['parameters']:,} parameters"
        + adapter_words(m.get("adapter"))
        + ".",
        f"Data: {data['windows']} windows × {data['seq_len']} tokens = {data['tokens']:,} tokens "
        f"(each window from the zero state); perplexity {_fmt(data['perplexity'])} over {data['predicted_tokens']:,} predicted tokens.",
        document_regime_line(data),
        "",
    ]


def adapter_words(adapter: dict | None) -> str:
    """What the overview says of a PEFT adapter: that every number is the adapted model's, on which base."""
    if not adapter:
        return ""
    return (
        f" ({adapter['adapter_parameters']:,} of them a {'/'.join(adapter['peft_type'])} adapter's, attached to the "
        f"base model `{'`, `'.join(adapter['base_model'])}`: every measurement and causal test runs the adapted model)"
    )


# `data.document_resets_from` when the model's own record chose the regime (`gpn inspect`'s `document_regime`)
RECORDED = "the model's train_config.json (trained with --reset-at-document-start)"


def document_regime_line(data: dict) -> str:
    """Which regime ran (the state reset at each document start, or run on across documents) and why."""
    trained = data.get("trained_with_document_resets")
    source = data.get("document_resets_from")
    if not data.get("document_resets"):
        if not trained:
            return "Documents are joined with EOS and the state runs on across them inside a window."
        return (
            "Note: this model was trained with `--reset-at-document-start` (its state reset to zero at each "
            "document's start); here the state runs on across the documents inside a window"
            + (f" ({source})" if source else "")
            + ", so every number below (the perplexity too) measures it outside the regime it was trained in."
        )
    if source == RECORDED:
        why = ", as in training: the model was trained with `--reset-at-document-start` (its train_config.json)."
    else:
        why = f" ({source})." if source else "."
    return (
        "Documents: each starts from the zero state (the state resets at the token after every EOS, in every "
        "measurement and causal test; the horizons and the memory retention pair positions inside one document "
        "only)" + why
    )


def geometry_lines(g: dict) -> list[str]:
    """The state geometry section, beside the paper's figures."""
    return [
        "## State geometry",
        "",
        "| measure | this model | paper (1L GPN+M, 130M) |",
        "|---|---|---|",
        f"| states analysed | {g['num_states']:,} | 16k |",
        f"| ‖p‖ mean (std) | {_fmt(g['norm_mean'])} ({_fmt(g['norm_std'])}) | 132 (9) |",
        f"| per-dim std min – max | {_fmt(g['dim_std_min'])} – {_fmt(g['dim_std_max'])} | 1.05 – 11.3 |",
        f"| dead dims ({g['dead_dim_rule']}) | {g['dead_dims']} | 0 |",
        f"| mean \\|off-diag corr\\| (max) | {_fmt(g['offdiag_corr_mean_abs'])} ({_fmt(g['offdiag_corr_max_abs'])}) | 0.027 (0.61) |",
        f"| PCs for 90% / 99% variance | {g['components_for_90pct']} / {g['components_for_99pct']} of {g['state_dim']} | 1131 / 2099 of 2496 |",
        f"| stable rank | {_fmt(g['stable_rank'])} | ≈40 |",
        f"| participation ratio | {_fmt(g['participation_ratio'])} | ≈398 |",
        "",
        f"Spectrum: {g['spectrum_note']}.",
        "",
    ]


def mean_direction_lines(mean: dict) -> list[str]:
    """The mean direction (s_bar) section, beside the paper's figures."""
    return [
        "## Mean direction s̄",
        "",
        "| measure | this model | paper |",
        "|---|---|---|",
        # The paper states 58%, but its own ‖s̄‖ ≈ 107 and ‖p‖ ≈ 132 give 81% by this measure: show both.
        f"| ‖s̄‖ (share of mean ‖p‖) | {_fmt(mean['norm'])} ({100 * mean['share_of_state_norm']:.0f}%) | "
        "107 (58% stated; 107/132 = 81%) |",
        f"| per-batch mean cosine, {mean['num_batches']} batches (pairwise mean ± std) | "
        f"{_fmt(mean['batch_cosine_mean'])} ± {_fmt(mean['batch_cosine_std'])} | 0.988 ± 0.005 |",
        f"| Spearman(decoded s̄, data unigram), seen tokens / all vocab | "
        f"{_fmt(mean.get('spearman_unigram_seen_tokens'))} / {_fmt(mean.get('spearman_unigram_all_vocab'))} | +0.46 (training unigram) |",
        f"| running mean reaches cos 0.98 / 0.996 at token | {_fmt(mean.get('running_mean_reaches_0.98_at_token'))} / "
        f"{_fmt(mean.get('running_mean_reaches_0.996_at_token'))} | 10 / 100 |",
        f"| decoded mean embedding: top-{len(mean['top_ids'])} overlap, logit cosine | "
        f"{mean.get('control_top_overlap')}/{len(mean['top_ids'])}, {_fmt(mean.get('control_logit_cosine'))} | 0/10, −0.62 |",
        "",
        "Top decoded tokens of s̄ (probability): "
        + ", ".join(f"`{t}` ({p:.3f})" for t, p in zip(mean["top_tokens"], mean["top_probs"])),
        "",
        "Most frequent data tokens: " + ", ".join(f"`{t}`" for t in mean["data_top_tokens"]),
        "",
    ]


def horizons_lines(hz: dict) -> list[str]:
    """The horizons section (state cosine against lag), beside the paper's figures."""
    return [
        "## Horizons",
        "",
        f"E[cos(p_t, p_t+k)]: raw {_fmt(hz['raw_at_1'])} at k = 1 and {_fmt(hz['raw_at_max_lag'])} at k = {hz['max_lag']} "
        f"(paper: plateau ≈0.65 to k = 1500); centred on each sequence's mean {_fmt(hz['centred_at_1'])} at k = 1 "
        f"(paper 0.31), below 0.05 from k = {_fmt(hz['centred_below_0.05_at_lag'])} (paper ≈0 by k ≈ 256).",
        "",
    ]


def memory_lines(memory: dict, documents: bool = False) -> list[str]:
    """Each head's half-life (shortest first) and pool, and the pools' ranges (`documents`: the memory was reset
    at each document start, and the products of decays stay inside one document)."""
    lines = [
        "## Memory retention",
        "",
        "Half-life = lag k where the product of k consecutive e^γ, averaged over every start that has k steps left "
        + (
            "in its document (the memory resets at each document start), reaches 1/e "
            f"(longest document stretch {memory['max_lag']} tokens; past it, extrapolated at the head's average rate, "
            "marked *). "
            if documents
            else "in its window, reaches 1/e "
            f"(window {memory['max_lag']} tokens; past it, extrapolated at the head's average rate, marked *). "
        )
        + f"Pools: {memory['rule']}"
        + (
            f", cut at {_fmt(memory['threshold'])} tokens (pool ratio {_fmt(memory.get('pool_ratio'))}×)."
            if memory["split"]
            else f": no split (pool ratio {_fmt(memory.get('pool_ratio'))}× below 2×)."
        ),
        "",
        "| head | half-life (tokens) | −1/mean γ | pool |",
        "|---|---|---|---|",
    ]
    order = np.argsort(memory["half_lives"])
    for h in order:
        pool = "fast" if h in memory["fast_heads"] else "slow"
        star = "*" if memory["half_life_beyond_window"][h] else ""
        lines.append(
            f"| {h} | {_fmt(memory['half_lives'][h])}{star} | {_fmt(memory['mean_rate_half_lives'][h])} | {pool} |"
        )
    fast = [memory["half_lives"][h] for h in memory["fast_heads"]]
    slow = [memory["half_lives"][h] for h in memory["slow_heads"]]
    lines += [
        "",
        f"Fast pool: {len(fast)} heads"
        + (f" ({_fmt(min(fast))}–{_fmt(max(fast))} tokens)" if fast else "")
        + f"; slow pool: {len(slow)} heads"
        + (f" ({_fmt(min(slow))}–{_fmt(max(slow))} tokens)" if slow else "")
        + ". Paper: 6 fast (1–3 tokens), 9 slow (5–322 tokens).",
        "",
    ]
    return lines


def ablation_lines(ablations: dict) -> list[str]:
    """The causal tests: perplexity under each condition and its change from the baseline."""
    lines = [
        "## Causal tests",
        "",
        f"Perplexity over {ablations['rows'][0]['tokens']:,} predicted tokens ({ablations['windows']} windows of "
        f"{ablations['tokens'] // ablations['windows']}); s̄ {ablations['s_bar_source']}. The baseline and every "
        "intervention run the same time loop (the model's plain, module-calling one), the decode-only condition on the "
        "baseline's states; the perplexity above is the model's forward.",
        "",
        "| condition | what changes | PPL | ΔPPL | Δ% |",
        "|---|---|---|---|---|",
    ]
    for row in ablations["rows"]:
        lines.append(
            f"| {row['name']} | {row['description']} | {row['perplexity']:.3f} | "
            f"{row['delta_ppl']:+.3f} | {row['delta_pct']:+.1f}% |"
        )
    lines.append("")
    return lines
