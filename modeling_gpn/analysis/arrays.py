"""The one check every measurement makes of its input (a finite, non-empty float64 array of the right rank), and
the length of the longest document in the per-position document ids that the measurements pairing positions take."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike


def as_float64(array: ArrayLike, name: str, ndim: int) -> np.ndarray:
    """`array` as float64 with `ndim` dimensions; a ValueError naming `name` if it is empty or not finite."""
    values = np.asarray(array, dtype=np.float64)
    if values.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {values.shape}")
    if values.size == 0:
        raise ValueError(f"{name} is empty (shape {values.shape})")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return values


def longest_document(documents: ArrayLike) -> int:
    """The longest run of one document id (sequences, T) inside a sequence: the longest lag + 1 with a pair."""
    ids = np.asarray(documents)
    changes = np.ones(ids.shape, dtype=bool)
    changes[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = np.flatnonzero(changes.ravel())  # (each sequence's first position is a change, so runs stay inside one)
    return int(np.diff(np.append(starts, ids.size)).max())
