"""Horizons (the paper's section 6.3): E_t[cos(p_t, p_{t+k})] against the lag k, raw and centred on each
sequence's mean."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

from .arrays import as_float64, longest_document


def log_lags(max_lag: int, num: int = 40) -> np.ndarray:
    """Integer lags 1..max_lag spaced evenly on a log axis (every lag up to 10 is included)."""
    if max_lag < 1:
        raise ValueError(f"need sequences of at least 2 positions for lags, got max lag {max_lag}")
    lags = np.unique(np.round(np.logspace(0, math.log10(max_lag), num)).astype(int))
    return np.unique(np.concatenate([np.arange(1, min(10, max_lag) + 1), lags]))


def state_horizons(states: ArrayLike, lags: ArrayLike | None = None, documents: ArrayLike | None = None) -> dict:
    """E[cos(p_t, p_{t+k})] against the lag k for states shaped (sequences, T, d), section 6.3.

    `raw` uses the states as they are; `centred` subtracts each sequence's own mean state first.
    Each value averages over every valid (sequence, t) pair. By default the lags run to 3/4 of the
    window (1535 for 2048-token windows, past the paper's 1500), so every lag still averages over at
    least a quarter of the window's positions. Also reports the first lag where the
    centred cosine falls below 0.05 (`centred_below_0.05_at_lag`).

    `documents` (sequences, T) ints, for states whose recurrence restarted from the zero state at each document
    start: only pairs of positions with the same id (inside one document) count, a lag with no such pair is NaN,
    and the default lags run to 3/4 of the longest stretch of one document. The centring stays each sequence's
    mean (a short document's own mean would pull its centred cosines negative).
    """
    x = as_float64(states, "states", 3)
    length = x.shape[1]
    same = _same_document(documents, x.shape[:2])
    longest = length if documents is None else longest_document(documents)
    lags = log_lags(max(1, (3 * (longest - 1)) // 4)) if lags is None else np.asarray(lags, dtype=int)
    if lags.min() < 1 or lags.max() >= length:
        raise ValueError(f"lags must lie in [1, {length - 1}] for sequences of length {length}")

    def unit(v: np.ndarray):
        return v / (np.linalg.norm(v, axis=2, keepdims=True) + 1e-300)

    raw_unit = unit(x)
    centred_unit = unit(x - x.mean(axis=1, keepdims=True))
    if same is None:
        raw = np.array(
            [np.einsum("std,std->", raw_unit[:, :-k], raw_unit[:, k:]) / raw_unit[:, k:, 0].size for k in lags]
        )
        centred = np.array(
            [
                np.einsum("std,std->", centred_unit[:, :-k], centred_unit[:, k:]) / centred_unit[:, k:, 0].size
                for k in lags
            ]
        )
    else:
        raw = np.array([_paired_mean(raw_unit, same(k), k) for k in lags])
        centred = np.array([_paired_mean(centred_unit, same(k), k) for k in lags])
    below = np.flatnonzero(centred < 0.05)
    return {
        "lags": lags,
        "raw": raw,
        "centred": centred,
        "raw_at_1": float(raw[0]) if lags[0] == 1 else None,
        "centred_at_1": float(centred[0]) if lags[0] == 1 else None,
        "raw_at_max_lag": float(raw[-1]),
        "max_lag": int(lags[-1]),
        "centred_below_0.05_at_lag": int(lags[below[0]]) if below.size else None,
    }


def _same_document(documents: ArrayLike | None, shape: tuple[int, int]):
    """None without `documents`, else k -> (sequences, T - k) bool: positions t and t + k lie in one document."""
    if documents is None:
        return None
    ids = np.asarray(documents)
    if ids.shape != tuple(shape):
        raise ValueError(f"documents must have shape {tuple(shape)} (sequences, T), got {ids.shape}")
    return lambda k: ids[:, :-k] == ids[:, k:]


def _paired_mean(unit: np.ndarray, pairs: np.ndarray, k: int) -> float:
    """Mean cosine of the unit vectors k apart over the pairs marked (sequences, T - k); NaN with none."""
    count = int(pairs.sum())
    if count == 0:
        return math.nan
    return float(np.einsum("std,std,st->", unit[:, :-k], unit[:, k:], pairs.astype(np.float64)) / count)
