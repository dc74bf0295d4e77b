"""Memory retention (the paper's section 6.3): per memory head, the product of k consecutive per-step decays
exp(gamma) averaged over the start positions that have k steps left in the window, its 1/e half-life, and the
split of the heads into a fast and a slow pool."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

from .arrays import as_float64, longest_document

INV_E = math.exp(-1.0)


def retention_curves(gammas: ArrayLike, max_lag: int | None = None, documents: ArrayLike | None = None) -> np.ndarray:
    """Per-head retention R_h(k) for k = 0..max_lag from gamma shaped (sequences, T, H).

    R_h(k) = mean over sequences n and start positions s = 0 .. T-k of exp(gamma[n, s] + ... + gamma[n, s+k-1]):
    the share of what the memory held before position s that is left after the k writes at s .. s+k-1. A mean
    of products (not the product of mean retentions), over the T-k+1 starts that still have k steps in the
    window: fewer as k grows, so the long lags average over the window's early starts only (the paper's
    product runs from the window's first token alone, s = 0). R_h(0) = 1. Returns an array (max_lag + 1, H).

    `documents` (sequences, T) ints, for a memory reset to zero at each document start: only the starts whose k
    writes s .. s+k-1 lie in one document count (a reset in between leaves nothing), and max_lag is at most the
    longest stretch of one document, so every lag has a start.
    """
    g = as_float64(gammas, "gammas", 3)
    num_seq, length, heads = g.shape
    if documents is not None:
        ids = np.asarray(documents)
        if ids.shape != (num_seq, length):
            raise ValueError(f"documents must have shape {(num_seq, length)} (sequences, T), got {ids.shape}")
        length = longest_document(ids)
    max_lag = length if max_lag is None else min(max_lag, length)
    cumulative = np.concatenate([np.zeros((num_seq, 1, heads)), np.cumsum(g, axis=1)], axis=1)
    curves = np.ones((max_lag + 1, heads))
    for k in range(1, max_lag + 1):
        if documents is None:
            curves[k] = np.exp(cumulative[:, k:] - cumulative[:, :-k]).mean(axis=(0, 1))
        else:  # the starts s whose first and last of the k writes lie in one document (documents are contiguous)
            inside = ids[:, : ids.shape[1] - k + 1] == ids[:, k - 1 :]
            curves[k] = np.exp(cumulative[:, k:] - cumulative[:, :-k])[inside].mean(axis=0)
    return curves


def half_lives(curves: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """The 1/e half-life of each retention curve (max_lag + 1, H) and whether it lies past max_lag.

    The crossing of log R = -1 is interpolated linearly in log R between the two integer lags that
    bracket it, so a head with a constant decay gamma gets exactly -1/gamma. A head that has not
    reached 1/e by the last lag K is extrapolated at its average rate, K / (-log R(K)).
    """
    curves = np.asarray(curves, dtype=np.float64)
    log_r = np.log(np.clip(curves, 1e-300, None))
    max_lag = curves.shape[0] - 1
    lives = np.empty(curves.shape[1])
    beyond = np.zeros(curves.shape[1], dtype=bool)
    for h in range(curves.shape[1]):
        below = np.flatnonzero(log_r[:, h] <= -1.0)
        if below.size:
            k = below[0]
            if k == 0:
                lives[h] = 0.0
            else:
                before, after = log_r[k - 1, h], log_r[k, h]
                lives[h] = (k - 1) + (before + 1.0) / (before - after)
        else:
            beyond[h] = True
            lives[h] = max_lag / -log_r[-1, h] if log_r[-1, h] < 0 else math.inf
    return lives, beyond


def split_pools(half_life_values: ArrayLike, min_ratio: float = 2.0) -> dict:
    """Split heads into a fast and a slow pool by their half-lives.

    The rule: the optimal two-class split of log half-life (1-D 2-means / Jenks natural breaks with
    two classes: the cut between sorted heads that minimises the within-pool sum of squared
    deviations of log half-life). Log scale because retention times are scale quantities (the paper
    plots them on a log axis). No split is made (everything is one "slow" pool, `split` False) with
    fewer than 2 heads or when the two pools' geometric-mean half-lives differ by less than
    `min_ratio`. Infinite half-lives (no decay) sort last.
    """
    values = np.asarray(half_life_values, dtype=np.float64).ravel()
    heads = values.size
    finite = np.where(np.isfinite(values), values, np.nan)
    cap = np.nanmax(finite) * 10 if np.isfinite(np.nanmax(finite)) else 1e12
    logs = np.log(np.clip(np.where(np.isfinite(values), values, cap), 1e-6, None))
    order = np.argsort(logs, kind="stable")
    no_split = {
        "split": False,
        "fast_heads": [],
        "slow_heads": [int(h) for h in order],
        "threshold": None,
        "rule": "2-means on log half-life",
    }
    if heads < 2:
        return no_split
    sorted_logs = logs[order]
    best_cut, best_cost = None, math.inf
    for cut in range(1, heads):
        left, right = sorted_logs[:cut], sorted_logs[cut:]
        cost = ((left - left.mean()) ** 2).sum() + ((right - right.mean()) ** 2).sum()
        if cost < best_cost - 1e-12:
            best_cut, best_cost = cut, cost
    fast, slow = order[:best_cut], order[best_cut:]
    ratio = math.exp(sorted_logs[best_cut:].mean() - sorted_logs[:best_cut].mean())
    if ratio < min_ratio:
        return {**no_split, "pool_ratio": ratio}
    threshold = math.exp((sorted_logs[best_cut - 1] + sorted_logs[best_cut]) / 2)
    return {
        "split": True,
        "fast_heads": sorted(int(h) for h in fast),
        "slow_heads": sorted(int(h) for h in slow),
        "threshold": threshold,
        "pool_ratio": ratio,
        "rule": "2-means on log half-life",
    }


def memory_retention(
    gammas: ArrayLike, max_lag: int | None = None, min_pool_ratio: float = 2.0, documents: ArrayLike | None = None
) -> dict:
    """Per-head retention curves, 1/e half-lives and the fast / slow pool split (section 6.3).

    `gammas` (sequences, T, H) are the models' log retentions per step (retention = exp(gamma)).
    Also reports each head's mean gamma and the half-life of its average rate, -1 / mean(gamma).
    `documents`: as in `retention_curves`, for a memory reset at each document start.
    """
    g = as_float64(gammas, "gammas", 3)
    curves = retention_curves(g, max_lag, documents)
    lives, beyond = half_lives(curves)
    mean_gamma = g.mean(axis=(0, 1))
    pools = split_pools(lives, min_ratio=min_pool_ratio)
    return {
        "num_heads": int(g.shape[2]),
        "max_lag": int(curves.shape[0] - 1),
        "half_lives": lives,
        "half_life_beyond_window": beyond,
        "mean_gamma": mean_gamma,
        "mean_rate_half_lives": np.where(mean_gamma < 0, -1.0 / np.minimum(mean_gamma, -1e-300), np.inf),
        "curves": curves,
        **pools,
    }
