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

Choices the paper leaves open are made here and stated in each docstring (all computed in float64).
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np

INV_E = math.exp(-1.0)


def _as_float64(array, name: str, ndim: int) -> np.ndarray:
    values = np.asarray(array, dtype=np.float64)
    if values.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {values.shape}")
    if values.size == 0:
        raise ValueError(f"{name} is empty (shape {values.shape})")
    if not np.isfinite(values).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return values


# --------------------------------------------------------------------------------------------------
# Spectra
# --------------------------------------------------------------------------------------------------


def spectrum_summary(eigenvalues, fractions: tuple[float, ...] = (0.9, 0.99)) -> dict:
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


def covariance_eigenvalues(states) -> np.ndarray:
    """Eigenvalues (descending) of the centred covariance (1/N normalisation) of the rows of `states`."""
    x = _as_float64(states, "states", 2)
    centred = x - x.mean(axis=0, keepdims=True)
    n, d = centred.shape
    if n < d:  # same non-zero spectrum from the smaller Gram matrix
        gram = centred @ centred.T / n
        lam = np.linalg.eigvalsh(gram)
        lam = np.concatenate([lam, np.zeros(d - n)])
    else:
        lam = np.linalg.eigvalsh(centred.T @ centred / n)
    return np.sort(np.clip(lam, 0.0, None))[::-1]


# --------------------------------------------------------------------------------------------------
# State geometry
# --------------------------------------------------------------------------------------------------


def state_geometry(
    states,
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
    x = _as_float64(states, "states", 2)
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
        "spectrum_note": "centred covariance of the states (1/N)" + (
            f"; only {n} states for {d} dimensions, so at most {n - 1} components carry variance" if n <= d else ""
        ),
        "sorted_dim_std": np.sort(dim_std)[::-1],
        "norms": norms,
        "eigenvalues": lam,
        "corr_hist_counts": counts,
        "corr_hist_edges": edges,
    }


# --------------------------------------------------------------------------------------------------
# The mean direction
# --------------------------------------------------------------------------------------------------


def rankdata(values) -> np.ndarray:
    """Ranks 1..n with ties given their average rank (as scipy.stats.rankdata, method 'average')."""
    v = np.asarray(values, dtype=np.float64).ravel()
    order = np.argsort(v, kind="mergesort")
    sorted_v = v[order]
    boundaries = np.flatnonzero(np.diff(sorted_v) != 0) + 1
    starts = np.concatenate([[0], boundaries])
    ends = np.concatenate([boundaries, [v.size]])
    ranks_sorted = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    ranks = np.empty_like(ranks_sorted)
    ranks[order] = ranks_sorted
    return ranks


def spearman(a, b) -> float:
    """Spearman rank correlation (Pearson correlation of average ranks)."""
    ra, rb = rankdata(a), rankdata(b)
    if ra.size != rb.size:
        raise ValueError(f"spearman needs equal lengths, got {ra.size} and {rb.size}")
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-300))


def mean_direction(
    states,
    decode: Callable[[np.ndarray], np.ndarray],
    unigram_counts=None,
    top_k: int = 10,
    num_batches: int = 8,
    thresholds: tuple[float, ...] = (0.98, 0.996),
    control_logits=None,
) -> dict:
    """The mean direction s_bar = E_t[p_t] of states shaped (sequences, T, d), as in section 6.2.

    - `norm` = ||s_bar|| and `share_of_state_norm` = ||s_bar|| / mean_t ||p_t||;
    - `decode(s_bar)` gives logits over the vocabulary: `top_ids` / `top_probs` are its top-k;
    - Spearman correlation of those logits with `unigram_counts` (token counts of the data), over the
      whole vocabulary (unseen tokens tie at count 0) and over the tokens that occur in the data;
    - per-batch consistency: the sequences are split into `num_batches` contiguous groups (at most one
      per sequence); the cosine between every pair of group means (the paper: 0.988 +- 0.005 over 8);
    - running-mean convergence: cos(mean_{s<=t} p_s, s_bar) per sequence, averaged over sequences,
      for t = 1..T (1-based token count), and the first t where it reaches each threshold;
    - optional `control_logits` (e.g. the mean token embedding decoded the same way): cosine with the
      s_bar logits and overlap of the top-k sets.
    """
    x = _as_float64(states, "states", 3)
    num_seq, length, d = x.shape
    flat = x.reshape(-1, d)
    s_bar = flat.mean(axis=0)
    norms = np.linalg.norm(flat, axis=1)
    logits = np.asarray(decode(s_bar), dtype=np.float64).ravel()
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    k = min(top_k, logits.size)
    top_ids = np.argsort(-logits, kind="stable")[:k]
    result = {
        "norm": float(np.linalg.norm(s_bar)),
        "mean_state_norm": float(norms.mean()),
        "share_of_state_norm": float(np.linalg.norm(s_bar) / norms.mean()),
        "top_ids": [int(i) for i in top_ids],
        "top_probs": [float(probs[i]) for i in top_ids],
        "s_bar": s_bar,
    }
    if unigram_counts is not None:
        counts = np.asarray(unigram_counts, dtype=np.float64).ravel()
        if counts.size != logits.size:
            raise ValueError(f"unigram_counts has {counts.size} entries but the decoder gives {logits.size} logits")
        seen = counts > 0
        result["spearman_unigram_all_vocab"] = spearman(logits, counts)
        result["spearman_unigram_seen_tokens"] = spearman(logits[seen], counts[seen]) if seen.sum() > 1 else float("nan")
        result["seen_tokens"] = int(seen.sum())

    groups = [g for g in np.array_split(np.arange(num_seq), min(num_batches, num_seq)) if g.size]
    if len(groups) >= 2:
        means = np.stack([x[g].reshape(-1, d).mean(axis=0) for g in groups])
        unit = means / np.linalg.norm(means, axis=1, keepdims=True)
        pairwise = (unit @ unit.T)[np.triu_indices(len(groups), k=1)]
        result["batch_cosine_mean"] = float(pairwise.mean())
        result["batch_cosine_std"] = float(pairwise.std())
        result["batch_cosine_min"] = float(pairwise.min())
        result["num_batches"] = len(groups)
    else:
        result["batch_cosine_mean"] = result["batch_cosine_std"] = result["batch_cosine_min"] = float("nan")
        result["num_batches"] = len(groups)

    running = np.cumsum(x, axis=1) / np.arange(1, length + 1)[None, :, None]
    running_unit = running / (np.linalg.norm(running, axis=2, keepdims=True) + 1e-300)
    curve = (running_unit @ (s_bar / np.linalg.norm(s_bar))).mean(axis=0)
    result["running_mean_cosine"] = curve
    for threshold in thresholds:
        reached = np.flatnonzero(curve >= threshold)
        result[f"running_mean_reaches_{threshold:g}_at_token"] = int(reached[0] + 1) if reached.size else None
    for t in (1, 10, 100, 1000):
        if t <= length:
            result[f"running_mean_cosine_at_{t}"] = float(curve[t - 1])

    if control_logits is not None:
        control = np.asarray(control_logits, dtype=np.float64).ravel()
        control_top = np.argsort(-control, kind="stable")[:k]
        result["control_logit_cosine"] = _cosine(logits - logits.mean(), control - control.mean())
        result["control_top_overlap"] = int(len(set(top_ids.tolist()) & set(control_top.tolist())))
        result["control_top_ids"] = [int(i) for i in control_top]
    return result


# --------------------------------------------------------------------------------------------------
# Horizons
# --------------------------------------------------------------------------------------------------


def log_lags(max_lag: int, num: int = 40) -> np.ndarray:
    """Integer lags 1..max_lag spaced evenly on a log axis (every lag up to 10 is included)."""
    if max_lag < 1:
        raise ValueError(f"need sequences of at least 2 positions for lags, got max lag {max_lag}")
    lags = np.unique(np.round(np.logspace(0, math.log10(max_lag), num)).astype(int))
    return np.unique(np.concatenate([np.arange(1, min(10, max_lag) + 1), lags]))


def state_horizons(states, lags=None) -> dict:
    """E[cos(p_t, p_{t+k})] against the lag k for states shaped (sequences, T, d), section 6.3.

    `raw` uses the states as they are; `centred` subtracts each sequence's own mean state first.
    Each value averages over every valid (sequence, t) pair. By default the lags run to 3/4 of the
    window (1535 for 2048-token windows, past the paper's 1500), so every lag still averages over at
    least a quarter of the window's positions. Also reports the first lag where the
    centred cosine falls below 0.05 (`centred_below_0.05_at_lag`).
    """
    x = _as_float64(states, "states", 3)
    length = x.shape[1]
    lags = log_lags(max(1, (3 * (length - 1)) // 4)) if lags is None else np.asarray(lags, dtype=int)
    if lags.min() < 1 or lags.max() >= length:
        raise ValueError(f"lags must lie in [1, {length - 1}] for sequences of length {length}")

    def unit(v):
        return v / (np.linalg.norm(v, axis=2, keepdims=True) + 1e-300)

    raw_unit = unit(x)
    centred_unit = unit(x - x.mean(axis=1, keepdims=True))
    raw = np.array([np.einsum("std,std->", raw_unit[:, :-k], raw_unit[:, k:]) / raw_unit[:, k:, 0].size for k in lags])
    centred = np.array(
        [np.einsum("std,std->", centred_unit[:, :-k], centred_unit[:, k:]) / centred_unit[:, k:, 0].size for k in lags]
    )
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


# --------------------------------------------------------------------------------------------------
# Memory retention
# --------------------------------------------------------------------------------------------------


def retention_curves(gammas, max_lag: int | None = None) -> np.ndarray:
    """Per-head retention R_h(k) for k = 0..max_lag from gamma shaped (sequences, T, H).

    R_h(k) is the product of k consecutive per-step retentions exp(gamma) (what is left of a memory
    entry k writes later), averaged over every start position of every sequence. R_h(0) = 1.
    Returns an array (max_lag + 1, H).
    """
    g = _as_float64(gammas, "gammas", 3)
    num_seq, length, heads = g.shape
    max_lag = length if max_lag is None else min(max_lag, length)
    cumulative = np.concatenate([np.zeros((num_seq, 1, heads)), np.cumsum(g, axis=1)], axis=1)
    curves = np.ones((max_lag + 1, heads))
    for k in range(1, max_lag + 1):
        curves[k] = np.exp(cumulative[:, k:] - cumulative[:, :-k]).mean(axis=(0, 1))
    return curves


def half_lives(curves) -> tuple[np.ndarray, np.ndarray]:
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


def split_pools(half_life_values, min_ratio: float = 2.0) -> dict:
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
    no_split = {"split": False, "fast_heads": [], "slow_heads": [int(h) for h in order], "threshold": None,
                "rule": "2-means on log half-life"}  # fmt: skip
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


def memory_retention(gammas, max_lag: int | None = None, min_pool_ratio: float = 2.0) -> dict:
    """Per-head retention curves, 1/e half-lives and the fast / slow pool split (section 6.3).

    `gammas` (sequences, T, H) are the models' log retentions per step (retention = exp(gamma)).
    Also reports each head's mean gamma and the half-life of its average rate, -1 / mean(gamma).
    """
    g = _as_float64(gammas, "gammas", 3)
    curves = retention_curves(g, max_lag)
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
