"""State geometry (the paper's section 6.1): norms, per-dimension spread, dead dimensions, correlations between
dimensions, and the spectrum of the centred covariance (components for 90% / 99%, stable rank,
participation ratio)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

from .arrays import as_float64


def spectrum_summary(eigenvalues: ArrayLike, fractions: tuple[float, ...] = (0.9, 0.99)) -> dict:
    """Stable rank, participation ratio and component counts of a covariance spectrum.

    stable rank = sum(lambda) / max(lambda); participation ratio = sum(lambda)^2 / sum(lambda^2);
    `components_for_{f}` = the fewest leading components whose variance reaches the fraction f of
    the total (a relative tolerance of 1e-9 absorbs rounding when a boundary is hit exactly).
    """
    lam = np.sort(np.clip(np.asarray(eigenvalues, dtype=np.float64), 0.0, None))[::-1]
    total = lam.sum()
    if total <= 0:
        raise ValueError("the spectrum has no variance (all eigenvalues are zero)")
    cumulative = np.cumsum(lam) / total
    summary = {
        "total_variance": float(total),
        "top_eigenvalue": float(lam[0]),
        "stable_rank": float(total / lam[0]),
        "participation_ratio": float(total**2 / np.square(lam).sum()),
    }
    for fraction in fractions:
        count = int(np.searchsorted(cumulative, fraction - 1e-9) + 1)
        summary[f"components_for_{round(fraction * 100, 3):g}pct"] = min(count, lam.size)
    return summary


def covariance_eigenvalues(states: ArrayLike) -> np.ndarray:
    """Eigenvalues (descending) of the centred covariance (1/N normalisation) of the rows of `states`."""
    x = as_float64(states, "states", 2)
    centred = x - x.mean(axis=0, keepdims=True)
    n, d = centred.shape
    if n < d:  # same non-zero spectrum from the smaller Gram matrix
        gram = centred @ centred.T / n
        lam = np.linalg.eigvalsh(gram)
        lam = np.concatenate([lam, np.zeros(d - n)])
    else:
        lam = np.linalg.eigvalsh(centred.T @ centred / n)
    return np.sort(np.clip(lam, 0.0, None))[::-1]


def state_geometry(
    states: ArrayLike,
    dead_fraction: float = 1e-3,
    correlation_sample_dims: int = 300,
    histogram_bins: int = 60,
    seed: int = 0,
) -> dict:
    """Geometry of a set of predicted states (N, d), as in the paper's section 6.1.

    - norm statistics of ||p_t||;
    - per-dimension standard deviation, sorted descending; a dimension is *dead* when its std is
      below `dead_fraction` times the median std (or exactly zero);
    - correlations between dimensions: mean and max |off-diagonal correlation| over all pairs of
      live dimensions, and a histogram of the off-diagonal correlations of a random sample of
      `correlation_sample_dims` dimensions (the paper's panel (b));
    - the spectrum of the *centred* covariance: principal components for 90% / 99% of the variance,
      stable rank and participation ratio (see `spectrum_summary`). Centring matters: the mean
      direction alone would otherwise make the stable rank ~1.

    Returns a dict; `sorted_dim_std`, `eigenvalues` and the histogram are numpy arrays.
    """
    x = as_float64(states, "states", 2)
    n, d = x.shape
    if n < 2:
        raise ValueError(f"state geometry needs at least 2 states, got {n}")
    norms = np.linalg.norm(x, axis=1)
    dim_std = x.std(axis=0)
    median_std = float(np.median(dim_std))
    dead = (dim_std <= dead_fraction * median_std) | (dim_std == 0)
    live = np.flatnonzero(~dead)

    if live.size >= 2:
        centred = x[:, live] - x[:, live].mean(axis=0, keepdims=True)
        unit = centred / dim_std[live]
        corr = unit.T @ unit / n
        off = np.abs(corr[~np.eye(live.size, dtype=bool)])
        corr_mean_abs, corr_max_abs = float(off.mean()), float(off.max())
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(live.size, size=min(correlation_sample_dims, live.size), replace=False))
        sub = corr[np.ix_(sample, sample)]
        sample_values = sub[np.triu_indices(sample.size, k=1)]
    else:
        corr_mean_abs = corr_max_abs = float("nan")
        sample_values = np.zeros(0)
    counts, edges = np.histogram(sample_values, bins=histogram_bins, range=(-1.0, 1.0))

    lam = covariance_eigenvalues(x)
    spectrum = spectrum_summary(lam)
    return {
        "num_states": n,
        "state_dim": d,
        "norm_mean": float(norms.mean()),
        "norm_std": float(norms.std()),
        "norm_min": float(norms.min()),
        "norm_max": float(norms.max()),
        "dim_std_min": float(dim_std.min()),
        "dim_std_max": float(dim_std.max()),
        "dim_std_median": median_std,
        "dead_dims": int(dead.sum()),
        "dead_dim_rule": f"std <= {dead_fraction:g} x median std",
        "offdiag_corr_mean_abs": corr_mean_abs,
        "offdiag_corr_max_abs": corr_max_abs,
        "offdiag_corr_sample_mean": float(sample_values.mean()) if sample_values.size else float("nan"),
        "correlation_sample_dims": int(min(correlation_sample_dims, live.size)),
        **spectrum,
        "spectrum_note": "centred covariance of the states (1/N)"
        + (f"; only {n} states for {d} dimensions, so at most {n - 1} components carry variance" if n <= d else ""),
        "sorted_dim_std": np.sort(dim_std)[::-1],
        "norms": norms,
        "eigenvalues": lam,
        "corr_hist_counts": counts,
        "corr_hist_edges": edges,
    }
