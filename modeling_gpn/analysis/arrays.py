"""The one check every measurement makes of its input: a finite, non-empty float64 array of the right rank."""

from __future__ import annotations

import numpy as np


def as_float64(array, name: str, ndim: int) -> np.ndarray:
    """`array` as float64 with `ndim` dimensions; a ValueError naming `name` if it is empty or not finite."""
    values = np.asarray(array, dtype=np.float64)
    if values.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {values.shape}")
    if values.size == 0:
        raise ValueError(f"{name} is empty (shape {values.shape})")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return values
