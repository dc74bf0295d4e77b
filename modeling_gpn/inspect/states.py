"""Collecting the state: one pass of the model over the windows keeps the predicted state p_t at every
position (`output_predicted_states`), the per-head memory decays gamma (`output_memory_decays`) and the loss."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Collected:
    """What one pass of the model over the windows gives: p_t, gamma_t and the per-token loss."""

    states: np.ndarray  # (windows, T, d) float32
    gammas: np.ndarray | None  # (windows, T, H) float32, GPN+M only
    nll_sum: float
    nll_count: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.nll_count)


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[float, int]:
    """Summed next-token cross-entropy of every window position (logits[:, t] predicts token t+1)."""
    loss = F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="sum"
    )
    return float(loss), input_ids[:, 1:].numel()


@torch.inference_mode()
def collect(model, windows: torch.Tensor, batch_size: int = 8, progress: bool = True) -> Collected:
    """Run the model over `windows` (n, T), each from the zero state, and keep p_t, gamma_t and the loss."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    states, gammas = [], []
    nll_sum, nll_count = 0.0, 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc="collecting states", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        out = model(batch, output_predicted_states=True, output_memory_decays=True, use_cache=False)
        states.append(out.predicted_states.float().cpu().numpy())
        if out.memory_decays is not None:
            gammas.append(out.memory_decays.float().cpu().numpy())
        s, c = window_nll(out.logits, batch)
        nll_sum, nll_count = nll_sum + s, nll_count + c
    return Collected(
        states=np.concatenate(states),
        gammas=np.concatenate(gammas) if gammas else None,
        nll_sum=nll_sum,
        nll_count=nll_count,
    )
