"""The paper's analyses of a GPN's single state, as pure measurement functions.

Everything here takes plain arrays (numpy or anything `np.asarray` accepts) and returns plain
dictionaries of Python numbers and numpy arrays; `modeling_gpn.inspect` collects the arrays from a
model and writes the report. Definitions follow "A Single-Layer Model Can Do Language Modeling"
(arXiv 2605.10643), section 6, and `GPN.md` ("The paper's analyses"):

- state geometry: statistics of the predicted states p_t (one row per position);
- the mean direction s_bar = E_t[p_t], decoded through the model's decoder;
- horizons: E_t[cos(p_t, p_{t+k})] against the lag k, raw and centred on each sequence's mean;
- memory retention: per memory head, the running product of the per-step decays exp(gamma),
  averaged over start positions, its 1/e half-life, and the split of the heads into a fast and a
  slow pool.

The horizons and the memory retention pair positions; given per-position document ids (`documents`, for states
collected with the state reset at each document start), they pair positions inside one document only.

Choices the paper leaves open are made here and stated in each docstring (all computed in float64).

Where its parts live (this face re-exports their public names):

    geometry.py   `state_geometry`, `spectrum_summary`, `covariance_eigenvalues`
    direction.py  `mean_direction`, `spearman`, `rankdata`
    horizons.py   `state_horizons`, `log_lags`
    retention.py  `memory_retention`, `retention_curves`, `half_lives`, `split_pools`, `INV_E`
    arrays.py     the input check they share, `longest_document`
"""

from __future__ import annotations

from .direction import mean_direction, rankdata, spearman
from .geometry import covariance_eigenvalues, spectrum_summary, state_geometry
from .horizons import log_lags, state_horizons
from .retention import INV_E, half_lives, memory_retention, retention_curves, split_pools

__all__ = [
    "INV_E",
    "covariance_eigenvalues",
    "half_lives",
    "log_lags",
    "mean_direction",
    "memory_retention",
    "rankdata",
    "retention_curves",
    "spearman",
    "spectrum_summary",
    "split_pools",
    "state_geometry",
    "state_horizons",
]
