"""`gpn bench --plot FILE`: decode time per token and the cache's bytes against the prompt length, one line per preset
and implementation measured, with each GPN's byte limit: the recurrent model's flat lines beside the Transformer's
growing ones."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..cli.figures import pyplot, save_figure

if TYPE_CHECKING:
    import argparse

    from matplotlib.axes import Axes

    from .measure import Row

IMPL_LABELS = {"fast": "GPN fast path", "plain": "GPN plain loop", "llama": "Llama (matched)"}
IMPL_COLOURS = {"fast": "C0", "plain": "C2", "llama": "C3"}
PRESET_MARKERS = ("o", "s", "^", "D", "v", "P")


def draw_bench_plot(rows: list[Row], args: argparse.Namespace, path: str | Path) -> str:
    """Draw `rows`' decode ms per new token and cache bytes against the prompt length to `path` (whole or not at
    all). Each GPN's byte limit (the read of a step's bytes timed beside generate()'s calls at each length, what
    the decode ratios are to) is a dotted line in the decode panel. A panel's value axis is logarithmic where its
    figures span more than a factor of 10 (several presets, or a Transformer's cache beside a GPN's state)."""
    plt = pyplot()
    fig, (decode, cache) = plt.subplots(1, 2, figsize=(13, 4.8))
    markers = {preset: PRESET_MARKERS[i % len(PRESET_MARKERS)] for i, preset in enumerate(args.preset)}
    several = len({r.preset for r in rows}) > 1
    largest = max((b for r in rows for b in r.cache_bytes.values()), default=0)
    unit_name, unit = next(
        ((name, 2**p) for name, p in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if largest >= 2**p), ("bytes", 1)
    )
    for r in rows:
        label = IMPL_LABELS.get(r.impl, r.impl) + (f", {r.preset}" if several else "")
        style = {"color": IMPL_COLOURS.get(r.impl), "marker": markers.get(r.preset, "o"), "ms": 5, "lw": 1.5}
        style["ls"] = "--" if r.impl == "plain" else "-"  # (the plain loop's cache is the fast path's: both seen)
        if r.decode_ms:
            lengths = sorted(r.decode_ms)
            decode.plot(lengths, [r.decode_ms[n] for n in lengths], label=label, **style)
        if r.cache_bytes:
            lengths = sorted(r.cache_bytes)
            cache.plot(lengths, [r.cache_bytes[n] / unit for n in lengths], label=label, **style)
    for preset in args.preset:  # one limit per GPN (its plain and fast rows read the same bytes): the fast row's
        gpn = [r for r in rows if r.preset == preset and r.impl != "llama" and r.limit_ms_at]
        if not gpn:
            continue
        limit = min(gpn, key=lambda r: r.impl != "fast")
        lengths = sorted(limit.limit_ms_at)
        decode.plot(
            lengths,
            [limit.limit_ms_at[n] for n in lengths],
            ls=":",
            lw=1.5,
            color="gray",
            marker=markers.get(preset, "o"),
            ms=3,
            label=f"GPN byte limit{f', {preset}' if several else ''}: {limit.limit_bytes / 1e6:.1f} MB a step / "
            "read bandwidth",
        )
    _finish_panel(decode, "(a) generate() decode, batch 1", "ms per new token (median gap)")
    _finish_panel(cache, "(b) what a prompt leaves in the cache", f"cache {unit_name} after the prompt")
    fig.suptitle(
        f"gpn bench: device {args.device}, dtype {args.dtype}, greedy, {args.decode_tokens} new tokens a call, "
        f"medians of {args.repeats}"
    )
    fig.tight_layout()
    return save_figure(fig, path, dpi=110, title="gpn bench")


def _finish_panel(ax: Axes, title: str, ylabel: str) -> None:
    """Log prompt lengths, the value axis from 0 (or logarithmic where its figures span over a factor of 10),
    labels, legend and grid."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.set_xscale("log")
    lengths = sorted({x for line in ax.get_lines() for x in line.get_xdata()})
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])  # (the lengths measured, as numbers: 4,096, not 4x10^3)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("prompt length, tokens (log)")
    values = [y for line in ax.get_lines() for y in line.get_ydata() if y > 0]
    if values and max(values) / min(values) > 10:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ylabel += " (log)"
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    if ax.get_lines():
        ax.legend(fontsize=8)
