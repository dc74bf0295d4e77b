"""What the tools' figures share (gpn train's loss.png, gpn bench --plot, gpn inspect's and gpn study's figures):
matplotlib started without a display, only when a figure is drawn, and a figure written whole or not at all."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ..atomic_files import replacing

if TYPE_CHECKING:
    from types import ModuleType

    from matplotlib.figure import Figure


def pyplot() -> ModuleType:
    """`matplotlib.pyplot` on the Agg backend: no display is needed (a training node, a CI runner, ssh). Imported
    here, when a figure is drawn, not at the tools' import: matplotlib's import costs most of a second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Figure, path: str | os.PathLike, dpi: int = 110, title: str | None = None) -> str:
    """Write `fig` as a PNG to `path` through `atomic_files.replacing` (a crash, a full disk or a failed draw
    leaves the old file or none, never half a PNG), with `title` and `lines_drawn(fig)` as its Title and
    Description text chunks; close the figure whatever happens. Returns the path as a string."""
    metadata = {"Description": lines_drawn(fig)}
    if title:
        metadata["Title"] = title
    try:
        with replacing(path, "wb") as handle:
            fig.savefig(handle, format="png", dpi=dpi, metadata=metadata)
    finally:
        pyplot().close(fig)
    return str(path)


def lines_drawn(fig: Figure) -> str:
    """The labelled lines of `fig`, read from its axes, in words: "PANEL TITLE: LABEL: N points at x X0-X1; ...".
    Written into the PNG, it says what the picture shows to a reader without eyes (a search, a test), from what
    was drawn rather than from what was meant to be."""
    parts = []
    for ax in fig.axes:
        for line in ax.get_lines():
            label = line.get_label()
            xs = list(line.get_xdata())
            if label.startswith("_") or not xs:  # (matplotlib's unlabelled lines: "_child0")
                continue
            where = f"{ax.get_title()}: " if ax.get_title() else ""
            parts.append(f"{where}{label}: {len(xs)} points at x {xs[0]:g}-{xs[-1]:g}")
    return "; ".join(parts)
