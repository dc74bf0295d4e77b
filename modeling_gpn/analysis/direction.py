"""The mean direction s_bar = E_t[p_t] (the paper's section 6.2): its norm, what it decodes to and how that
ranks against the data's unigram counts, how consistent it is across batches, and how fast a running mean
converges to it."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from numpy.typing import ArrayLike

from .arrays import as_float64


def rankdata(values: ArrayLike) -> np.ndarray:
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


def spearman(a: ArrayLike, b: ArrayLike) -> float:
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
    states: ArrayLike,
    decode: Callable[[np.ndarray], np.ndarray],
    unigram_counts: ArrayLike | None = None,
    top_k: int = 10,
    num_batches: int = 8,
    thresholds: tuple[float, ...] = (0.98, 0.996),
    control_logits: ArrayLike | None = None,
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
    x = as_float64(states, "states", 3)
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
        result["spearman_unigram_seen_tokens"] = (
            spearman(logits[seen], counts[seen]) if seen.sum() > 1 else float("nan")
        )
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
