"""The figures of `gpn inspect`: geometry.png (sorted per-dimension std, off-diagonal correlations, cumulative
variance), mean_direction.png (running-mean convergence, decoded top tokens), horizons.png (state cosine
against lag, memory retention per head) and ablations.png (perplexity under each ablation)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure

from .. import analysis
from ..cli.figures import pyplot, save_figure

# The figures a report may draw (ablations.png only with the causal tests)
FIGURE_NAMES = ("geometry.png", "mean_direction.png", "horizons.png", "ablations.png")


def write_figures(report: dict, output: Path) -> list[str]:
    """Write geometry.png, mean_direction.png, horizons.png and (with ablations) ablations.png, each whole or not
    at all."""
    plt = pyplot()

    def save(fig: Figure, name: str) -> str:
        return save_figure(fig, output / name, dpi=110)

    written = [
        save(geometry_figure(plt, report["geometry"]), "geometry.png"),
        save(mean_direction_figure(plt, report["mean_direction"]), "mean_direction.png"),
        save(horizons_figure(plt, report["horizons"], report.get("memory")), "horizons.png"),
    ]
    if report.get("ablations"):
        written.append(save(ablations_figure(plt, report["ablations"]), "ablations.png"))
    return written


def geometry_figure(plt: ModuleType, g: dict) -> Figure:
    """(a) per-dimension std, sorted; (b) histogram of off-diagonal correlations; (c) cumulative variance."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    ax.plot(np.arange(1, g["sorted_dim_std"].size + 1), g["sorted_dim_std"], color="C0")
    ax.set_yscale("log")
    ax.set_xlabel("dimension (sorted by std)")
    ax.set_ylabel("std of p_t along the dimension")
    ax.set_title(f"(a) per-dim std: {g['dim_std_min']:.3g}–{g['dim_std_max']:.3g}, {g['dead_dims']} dead")
    ax.grid(alpha=0.3)
    ax = axes[1]
    edges, counts = g["corr_hist_edges"], g["corr_hist_counts"]
    ax.bar((edges[:-1] + edges[1:]) / 2, counts, width=np.diff(edges), color="C1", edgecolor="none")
    ax.set_yscale("log")
    ax.set_xlabel("off-diagonal correlation")
    ax.set_ylabel("number of dimension pairs")
    ax.set_title(
        # the histogram is of a sample of dimensions, the mean |r| of every pair of live dimensions
        f"(b) correlations ({g['correlation_sample_dims']}-dim sample); all dims: mean |r| = {g['offdiag_corr_mean_abs']:.3f}"
    )
    ax.grid(alpha=0.3)
    ax = axes[2]
    lam = g["eigenvalues"]
    cumulative = np.cumsum(lam) / lam.sum()
    ax.plot(np.arange(1, lam.size + 1), cumulative, color="C2", label="cumulative variance")
    for frac, key, colour in ((0.9, "components_for_90pct", "C3"), (0.99, "components_for_99pct", "C4")):
        ax.axhline(frac, color=colour, ls=":", lw=1)
        ax.axvline(g[key], color=colour, ls="--", lw=1, label=f"{frac:.0%}: {g[key]} PCs")
    ax.set_xscale("log")
    ax.set_xlabel("principal components (log)")
    ax.set_ylabel("fraction of variance")
    ax.set_title(f"(c) stable rank {g['stable_rank']:.1f}, participation ratio {g['participation_ratio']:.1f}")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.suptitle(f"State geometry ({g['num_states']:,} states, d = {g['state_dim']})")
    fig.tight_layout()
    return fig


def mean_direction_figure(plt: ModuleType, mean: dict) -> Figure:
    """(a) cosine of the running mean with s_bar against tokens read; (b) s_bar's top decoded tokens."""
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    ax = axes[0]
    curve = mean["running_mean_cosine"]
    ax.plot(np.arange(1, curve.size + 1), curve, color="C0", label="cos(running mean of p, s̄)")
    ax.axhline(0.98, color="C3", ls=":", lw=1, label="0.98")
    ax.set_xscale("log")
    ax.set_xlabel("tokens read (log)")
    ax.set_ylabel("cosine with s̄")
    ax.set_title(
        f"(a) the running mean's cosine with s̄ (‖s̄‖ = {mean['norm']:.3g}, {mean['share_of_state_norm']:.0%} of ‖p‖)"
    )
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    ax = axes[1]
    labels = mean["top_tokens"][::-1]  # (escaped already, once: a newline shows as \n)
    ax.barh(np.arange(len(labels)), mean["top_probs"][::-1], color="C1")
    ax.set_yticks(np.arange(len(labels)), labels)
    ax.set_xlabel("probability after decoding s̄")
    spearman = mean.get("spearman_unigram_seen_tokens")
    ax.set_title(
        f"(b) s̄ decoded: top tokens (Spearman with data unigram {spearman:+.2f})"
        if spearman is not None and math.isfinite(spearman)
        else "(b) s̄ decoded: top tokens"
    )
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def horizons_figure(plt: ModuleType, hz: dict, memory: dict | None) -> Figure:
    """(a) state cosine against lag, raw and centred; (b) memory retention per head (GPN+M), pools coloured."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    ax.plot(hz["lags"], hz["raw"], "o-", ms=3, color="C0", label="raw p_t")
    ax.plot(hz["lags"], hz["centred"], "o-", ms=3, color="C3", label="centred on each sequence's mean")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("lag k (tokens, log)")
    ax.set_ylabel("E[cos(p_t, p_t+k)]")
    ax.set_title("(a) state horizon")
    ax.legend()
    ax.grid(alpha=0.3)
    ax = axes[1]
    if memory:
        curves = memory["curves"]
        lags = np.arange(1, curves.shape[0])
        for h in range(curves.shape[1]):
            fast = h in memory["fast_heads"]
            colour = "C3" if fast else "C0"
            ax.plot(lags, curves[1:, h], color=colour, lw=1.2, alpha=0.85)
            life = memory["half_lives"][h]
            if math.isfinite(life) and 1 <= life <= lags[-1]:
                ax.plot([life], [analysis.INV_E], "o", color=colour, ms=4)
        ax.axhline(analysis.INV_E, color="gray", ls=":", lw=1)
        from matplotlib.lines import Line2D

        handles = [
            Line2D([], [], color="C3", label=f"fast pool ({len(memory['fast_heads'])} heads)"),
            Line2D([], [], color="C0", label=f"slow pool ({len(memory['slow_heads'])} heads)"),
            Line2D([], [], color="gray", ls=":", label="1/e (dots: half-lives)"),
        ]
        ax.legend(handles=handles, loc="lower left")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("lag k (tokens, log)")
        ax.set_ylabel("retention ∏ e^γ (mean over starts)")
        ax.set_title("(b) memory retention per head")
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, "no matrix memory (GPN)", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    fig.suptitle("Temporal horizons")
    fig.tight_layout()
    return fig


def ablations_figure(plt: ModuleType, ablations: dict) -> Figure:
    """Perplexity change of each causal test against the baseline (symlog when changes differ in size)."""
    rows = ablations["rows"]
    base = rows[0]["perplexity"]
    fig, ax = plt.subplots(figsize=(max(7, 1.5 * len(rows)), 4.5))
    deltas = [r["delta_pct"] for r in rows]
    colours = ["gray"] + ["C3" if d > 0 else "C2" for d in deltas[1:]]
    bars = ax.bar(np.arange(len(rows)), deltas, color=colours)
    for bar, row in zip(bars, rows):
        label = f"PPL {row['perplexity']:.4g}" + ("" if row["name"] == "baseline" else f"\n{row['delta_pct']:+.1f}%")
        up = bar.get_height() >= 0
        ax.annotate(
            label,
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom" if up else "top",
            xytext=(0, 3 if up else -3),
            textcoords="offset points",
        )
    ax.axhline(0, color="gray", lw=1)
    low, high = min(deltas + [0.0]), max(deltas + [0.0])
    if max(abs(low), abs(high)) > 20:  # large and small changes both readable: linear within ±1%
        ax.set_yscale("symlog", linthresh=1.0)
        ax.set_ylim(-(abs(low) * 12 + 1) if low < 0 else -1, high * 12 + 1)
    else:
        span = max(high - low, 1e-3)
        ax.set_ylim(low - 0.25 * span, high + 0.25 * span)
    ax.set_xticks(np.arange(len(rows)), [r["name"].replace("_", "\n") for r in rows])
    ax.set_ylabel("perplexity change vs baseline (%)" + (", symlog" if max(abs(low), abs(high)) > 20 else ""))
    ax.set_title(
        # (the perplexities count the predicted tokens, one fewer per window than the windows' tokens it showed)
        f"Causal tests: perplexity with one part removed (baseline {base:.4g}, {rows[0]['tokens']:,} predicted tokens)"
    )
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
