"""`loss.png`, the run's curves at a glance: training loss and held-out loss (perplexity on the right axis) against
the optimizer step (tokens seen on the top axis), drawn at the end of a run from its whole `log.jsonl`, so a resumed
run's figure holds the steps before the resume too."""

from __future__ import annotations

import math
from pathlib import Path

from ..cli.figures import pyplot, save_figure

FILE_NAME = "loss.png"


def loss_curves(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """The (step, loss) points of a run's log records: "train" (each log interval's mean loss), "held_out" (every
    validation, the final one included) and "final" (the final validation alone). Non-finite values (written as
    strings in the log) and intervals whose steps were all skipped (a null loss) have no point."""

    def finite(value: object) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    curves: dict[str, list[tuple[int, float]]] = {"train": [], "held_out": [], "final": []}
    for record in records:
        step = record.get("step", 0)
        if "event" not in record and finite(record.get("loss")):
            curves["train"].append((step, float(record["loss"])))
        if finite(record.get("val_loss")):
            curves["held_out"].append((step, float(record["val_loss"])))
            if record.get("event") == "final":
                curves["final"].append((step, float(record["val_loss"])))
    return curves


def draw_loss_figure(records: list[dict], path: Path, title: str, tokens_per_step: int) -> str:
    """Draw the curves of the log `records` to `path` (whole or not at all). The loss axis is logarithmic where the
    loss falls by more than half over the run (the late, small improvements stay readable), the step axis where the
    logged steps span two orders of magnitude. Raises ValueError when the log holds no finite loss to draw."""
    curves = loss_curves(records)
    if not curves["train"] and not curves["held_out"]:
        raise ValueError("the log holds no finite loss to draw")
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda value, _: f"{value:g}")
    fig, ax = plt.subplots(figsize=(8, 4.8))
    if curves["train"]:
        steps, losses = zip(*curves["train"])
        ax.plot(steps, losses, color="C0", lw=1.4, label="training loss (mean of each log interval)")
    if curves["held_out"]:
        steps, losses = zip(*curves["held_out"])
        final = "".join(f", final {loss:.3f}: PPL {math.exp(min(loss, 50)):.4g}" for _, loss in curves["final"])
        ax.plot(steps, losses, "o-", color="C3", ms=4, lw=1.2, label=f"held-out loss{final}")
    every = [loss for points in (curves["train"], curves["held_out"]) for _, loss in points]
    if min(every) > 0 and max(every) / min(every) > 2:
        ax.set_yscale("log")
    logged = [step for points in (curves["train"], curves["held_out"]) for step, _ in points if step > 0]
    if logged and max(logged) / min(logged) >= 100:
        ax.set_xscale("log")
    ax.set_xlabel("optimizer step" + (" (log)" if ax.get_xscale() == "log" else ""))
    ax.set_ylabel("loss, nats/token" + (" (log)" if ax.get_yscale() == "log" else ""))
    # Perplexity is e^loss: a second reading of the same axis, not another curve.
    right = ax.secondary_yaxis("right", functions=(_exp, _log))
    right.set_ylabel("perplexity (e^loss)")
    top = ax.secondary_xaxis(
        "top", functions=(lambda s: s * tokens_per_step / 1e6, lambda t: t * 1e6 / tokens_per_step)
    )
    top.set_xlabel("tokens seen (millions)")
    for axis in (ax.xaxis, ax.yaxis, top.xaxis, right.yaxis):  # (plain numbers on log axes too: 4, not 4x10^0)
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(plain if axis is ax.yaxis and ax.get_yscale() == "log" else NullFormatter())
    fig.suptitle(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best")
    fig.tight_layout()
    return save_figure(fig, path, dpi=110, title=title)


def _exp(loss: object) -> object:
    import numpy as np

    return np.exp(np.minimum(loss, 50))  # (an axis limit far beyond any loss must not overflow)


def _log(perplexity: object) -> object:
    import numpy as np

    return np.log(np.maximum(perplexity, 1e-300))
