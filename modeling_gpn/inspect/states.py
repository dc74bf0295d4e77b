"""Collecting the state: one pass of the model over the windows keeps the predicted state p_t at every
position (`output_predicted_states`), the per-head memory decays gamma (`output_memory_decays`) and the loss.

Documents are joined with EOS inside a window. With document resets (the regime of a model trained with
`gpn train --reset-at-document-start`), every document starts from the zero state: the first token after each
EOS is a document start (`packing.document_starts`, the one rule gpn train uses too), and the model's forward is
given position ids that restart there (`packing.document_position_ids`), which it reads as packed sequences and
resets its state at."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from transformers import PreTrainedModel

from ..packing import document_position_ids, document_starts


@dataclass
class Collected:
    """What one pass of the model over the windows gives: p_t, gamma_t and the per-token loss."""

    states: np.ndarray  # (windows, T, d) float32
    gammas: np.ndarray | None  # (windows, T, H) float32, GPN+M only
    nll_sum: float
    nll_count: int

    @property
    def perplexity(self) -> float:
        """Token perplexity over every position collected."""
        return math.exp(self.nll_sum / self.nll_count)


def document_ids(windows: torch.Tensor, eos_token_id: int) -> np.ndarray:
    """(n, T) int: which document of its window each position belongs to (0, 1, ... from the window's start); the
    statistics that pair positions (horizons, memory retention) pair only those with the same id."""
    return document_starts(windows, eos_token_id).long().cumsum(dim=1).cpu().numpy()


# Positions decoded at a time into logits for the loss: about 16 MB of float32 logits at a LLaMA-sized vocabulary.
# A batch's (batch, T, vocab) logits at once would be gigabytes (8 windows of 2048 at vocab 32000: 2.1 GB, and as
# much again for cross_entropy's log-softmax), beside predicted states of a few tens of MB.
NLL_CHUNK_POSITIONS = 128


def window_nll(
    model: PreTrainedModel,
    predicted_states: torch.Tensor,
    input_ids: torch.Tensor,
    decode_shift: torch.Tensor | None = None,
) -> tuple[float, int]:
    """Summed next-token cross-entropy of every window position, and how many: p_t (`predicted_states`, batch, T,
    d, minus `decode_shift` where given) decoded (`model.decode`) predicts token t+1, `NLL_CHUNK_POSITIONS`
    positions at a time, so the whole batch's logits never exist at once."""
    states = predicted_states[:, :-1].reshape(-1, predicted_states.shape[-1])
    targets = input_ids[:, 1:].reshape(-1)
    total = 0.0
    for start in range(0, states.shape[0], NLL_CHUNK_POSITIONS):
        rows = states[start : start + NLL_CHUNK_POSITIONS]
        logits = model.decode(rows if decode_shift is None else rows - decode_shift).float()
        total += float(F.cross_entropy(logits, targets[start : start + NLL_CHUNK_POSITIONS], reduction="sum"))
    return total, targets.numel()


@torch.inference_mode()
def collect(
    model: PreTrainedModel,
    windows: torch.Tensor,
    batch_size: int = 8,
    progress: bool = True,
    reset_after: int | None = None,
) -> Collected:
    """Run the model over `windows` (n, T), each from the zero state, and keep p_t, gamma_t and the loss.

    `reset_after`: a token id (EOS) after which every document starts again from the zero state
    (`packing.document_starts`); None runs the state on across the documents inside a window."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    states, gammas = [], []
    nll_sum, nll_count = 0.0, 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc="collecting states", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        resets = {} if reset_after is None else {"position_ids": document_position_ids(batch, reset_after)}
        # (logits_to_keep=1: the loss is decoded from p_t a few positions at a time, `window_nll`)
        out = model(
            batch,
            output_predicted_states=True,
            output_memory_decays=True,
            use_cache=False,
            logits_to_keep=1,
            **resets,
        )
        states.append(out.predicted_states.float().cpu().numpy())
        if out.memory_decays is not None:
            gammas.append(out.memory_decays.float().cpu().numpy())
        s, c = window_nll(model, out.predicted_states, batch)
        nll_sum, nll_count = nll_sum + s, nll_count + c
    return Collected(
        states=np.concatenate(states),
        gammas=np.concatenate(gammas) if gammas else None,
        nll_sum=nll_sum,
        nll_count=nll_count,
    )
