"""Causal tests (the paper's Limitations (3)): perplexity of the same windows with one part of the recurrence
removed.

The conditions: s_bar subtracted from the decoded state, s_bar subtracted from the state carried to the
next step, the fast pool's memory heads off, the slow pool's heads off, and every memory read off. They run
`ablated_states` (the states of `ablated_logits`, decoded into the loss a few positions at a time:
`states.window_nll`), a copy of the model's time loop built from the model's own pieces that reproduces the
model's plain (module-calling) loop exactly when no ablation is active; the baseline they are compared with
runs that same loop with nothing removed, and decode-only conditions decode its states. With document resets
(`reset_after`, an EOS id) the loop resets (p, g, M) to the zero state right before every document start, as
the model's plain loop does for packed sequences, so each condition runs in the regime the model was trained in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

from ..packing import document_starts
from .states import window_nll


@dataclass(eq=False)
class Ablation:
    """One intervention on the recurrence (all off by default: the unablated model).

    decode_shift: subtracted from p_t before decoding only (the recurrence is untouched).
    carry_shift: subtracted from p_t before it is carried into the next step (decoding sees p_t).
    heads_off: memory heads whose share of every read is removed: their part of the normalised read vector
        rms(M^T q) is zeroed after the norm, which still runs over all heads as the model computed it. (Keeping
        their memory at zero instead would change the other heads' read too: the output norm runs over the whole
        H*dv vector, so zeroed heads scale the others' read up by sqrt(sum over all heads of r^2 / sum over the
        heads kept), and a slow pool "off" then measured mostly the fast pool turned up.)
    reads_off: every predict layer skips its memory read (the memory is still written).
    """

    name: str = "none"
    description: str = "the model as trained"
    decode_shift: torch.Tensor | None = None
    carry_shift: torch.Tensor | None = None
    heads_off: tuple[int, ...] = field(default_factory=tuple)
    reads_off: bool = False


def ablated_logits(
    model: PreTrainedModel, input_ids: torch.Tensor, ablation: Ablation | None = None, reset_after: int | None = None
) -> torch.Tensor:
    """Logits (batch, T, vocab) of `model` on `input_ids` from the zero state under `ablation`.

    Built from the model's own pieces in the order of `GPNModel.step` (token_inputs, ground,
    memory_write, the predict layers and their read, decode); with no ablation it is the model's
    forward bit for bit. `reset_after`: a token id (EOS) after which every document starts again from the
    zero state (`packing.document_starts`, as gpn train marks them); None runs the state on across documents.
    """
    ablation = ablation or Ablation()
    states = ablated_states(model, input_ids, ablation, reset_after)
    if ablation.decode_shift is not None:
        states = states - ablation.decode_shift
    return model.decode(states)


def _read_without_heads(
    layer: nn.Module, state: torch.Tensor, memory: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """`GPNPredictLayer.read` with the normalised read vector multiplied by `keep` (H * dv, 0 for removed heads)."""
    from ..modeling_gpn import l2_normalize, project

    normed = layer.read_norm(state)
    query = l2_normalize(F.relu(project(layer.read_query, normed)).view(-1, layer.num_heads, layer.key_dim))
    read_vector = torch.einsum("bhk,bhkv->bhv", query, memory).flatten(1)
    normalised = layer.read_out_norm(read_vector)
    return project(layer.read_out, F.silu(project(layer.read_gate, normed)) * (normalised * keep.to(normalised.dtype)))


def ablated_states(
    model: PreTrainedModel, input_ids: torch.Tensor, ablation: Ablation | None = None, reset_after: int | None = None
) -> torch.Tensor:
    """The predicted states p_t (batch, T, d) of `ablated_logits`, before any `decode_shift`."""
    from ..modeling_gpn import project

    ablation = ablation or Ablation()
    core = model.model
    config = model.config
    has_memory = core.memory_write is not None
    if (ablation.heads_off or ablation.reads_off) and not has_memory:
        raise ValueError(f"ablation {ablation.name!r} needs a GPN+M (this model has no memory)")
    head_mask = None
    if ablation.heads_off:
        bad = [h for h in ablation.heads_off if not 0 <= h < config.num_memory_heads]
        if bad:
            raise ValueError(f"memory heads {bad} do not exist (the model has {config.num_memory_heads})")
        head_mask = torch.ones(config.num_memory_heads, config.memory_value_dim, device=input_ids.device)
        head_mask[list(ablation.heads_off)] = 0.0
        head_mask = head_mask.flatten()  # over the flattened read vector (H * dv), head by head
    batch_size, length = input_ids.shape
    token_inputs = core.token_inputs(core.embed_tokens(input_ids))
    predicted, grounded, memory = core.zero_state(batch_size, input_ids.device)
    starts = None if reset_after is None else document_starts(input_ids, reset_after)
    outputs = []
    for t in range(length):
        if starts is not None:  # a document starts here: from the zero state (as the model's plain loop resets)
            starting = starts[:, t]
            predicted = predicted.masked_fill(starting[:, None], 0.0)
            grounded = grounded.masked_fill(starting[:, None], 0.0)
            memory = memory.masked_fill(starting.view(-1, *([1] * (memory.dim() - 1))), 0.0)
        new_grounded = core.ground(predicted, token_inputs[:, t])
        if has_memory:
            memory, _ = core.memory_write(memory, grounded, new_grounded)
        state = new_grounded
        for layer in core.predict_layers:
            if not has_memory:
                state = layer(state, None)
            elif not ablation.reads_off and head_mask is None:
                state = layer(state, memory)
            else:  # the predict layer without its read, or with part of it
                keep = torch.sigmoid(project(layer.gate, layer.gate_norm(state)))
                new_state = keep * state + layer.ffn(state)
                if not ablation.reads_off:
                    new_state = new_state + _read_without_heads(layer, state, memory, head_mask)
                state = new_state
        outputs.append(state)
        predicted = state if ablation.carry_shift is None else state - ablation.carry_shift
        grounded = new_grounded
    return torch.stack(outputs, dim=1)


@torch.inference_mode()
def ablation_perplexity(
    model: PreTrainedModel,
    windows: torch.Tensor,
    ablation: Ablation,
    batch_size: int = 8,
    progress: bool = True,
    reset_after: int | None = None,
) -> dict:
    """Token perplexity of `windows` under `ablation` (all positions of every window); `reset_after` as in
    `ablated_logits`."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    nll_sum, count = 0.0, 0
    for start in tqdm(range(0, windows.shape[0], batch_size), desc=f"ablation: {ablation.name}", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        states = ablated_states(model, batch, ablation, reset_after)
        s, c = window_nll(model, states, batch, ablation.decode_shift)
        nll_sum, count = nll_sum + s, count + c
    return {"nll": nll_sum / count, "perplexity": math.exp(nll_sum / count), "tokens": count}


@torch.inference_mode()
def decoded_perplexity(
    model: PreTrainedModel,
    states: np.ndarray,
    windows: torch.Tensor,
    decode_shift: torch.Tensor | None = None,
    batch_size: int = 8,
) -> dict:
    """Token perplexity of `windows` decoded from already collected predicted `states` (n, T, d),
    optionally with `decode_shift` subtracted before decoding."""
    device = next(model.parameters()).device
    nll_sum, count = 0.0, 0
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start : start + batch_size].to(device)
        p = torch.from_numpy(states[start : start + batch_size]).to(device)
        s, c = window_nll(model, p, batch, decode_shift)
        nll_sum, count = nll_sum + s, count + c
    return {"nll": nll_sum / count, "perplexity": math.exp(nll_sum / count), "tokens": count}


@torch.inference_mode()
def baseline_states(
    model: PreTrainedModel,
    windows: torch.Tensor,
    batch_size: int = 8,
    progress: bool = True,
    reset_after: int | None = None,
) -> np.ndarray:
    """The predicted states (n, T, d), float32, of `windows` through `ablated_states` with nothing removed
    (`reset_after` as in `ablated_logits`)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    states = []
    for start in tqdm(range(0, windows.shape[0], batch_size), desc="ablation: baseline", disable=not progress):
        batch = windows[start : start + batch_size].to(device)
        states.append(ablated_states(model, batch, reset_after=reset_after).float().cpu().numpy())
    return np.concatenate(states)


def standard_ablations(model: PreTrainedModel, s_bar: np.ndarray, pools: dict | None) -> list[Ablation]:
    """The causal tests: s_bar out of the decoded state / the recurrence; fast / slow pool off; reads off."""
    device = next(model.parameters()).device
    shift = torch.tensor(s_bar, dtype=torch.float32, device=device)
    ablations = [
        Ablation(
            "mean_removed_decode", "s̄ subtracted from p_t before decoding (recurrence untouched)", decode_shift=shift
        ),
        Ablation(
            "mean_removed_recurrence", "s̄ subtracted from p_t before it is carried to the next step", carry_shift=shift
        ),
    ]
    if model.model.memory_write is not None and pools is not None:
        if pools.get("split"):
            ablations.append(
                Ablation(
                    "fast_pool_off",
                    f"fast-pool memory heads {pools['fast_heads']} removed from every read",
                    heads_off=tuple(pools["fast_heads"]),
                )
            )
            ablations.append(
                Ablation(
                    "slow_pool_off",
                    f"slow-pool memory heads {pools['slow_heads']} removed from every read",
                    heads_off=tuple(pools["slow_heads"]),
                )
            )
        ablations.append(
            Ablation("memory_reads_off", "every memory read skipped (memory still written)", reads_off=True)
        )
    return ablations


def causal_tests(
    model: PreTrainedModel,
    windows: torch.Tensor,
    s_bar: np.ndarray,
    pools: dict | None,
    ablation_windows: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
    reset_after: int | None = None,
) -> dict:
    """The report's causal tests: perplexity of the (first `ablation_windows`) windows under each of
    `standard_ablations`, beside the baseline's, as rows with their change; with `reset_after` (an EOS id),
    every condition and the baseline start each document from the zero state.

    The baseline is the time loop the ablations run (`ablated_states` with nothing removed), not the model's
    forward: the forward takes the fast path, whose rounding differs from the module-calling loop's in bf16,
    and that difference would be counted as the ablations' effect. The decode-only conditions decode the baseline's states (no second recurrence)."""
    subset = windows if ablation_windows is None else windows[: max(1, ablation_windows)]
    states = baseline_states(model, subset, batch_size, progress, reset_after)
    baseline = decoded_perplexity(model, states, subset, None, batch_size)
    rows = [{"name": "baseline", "description": "the model as trained", **baseline, "delta_ppl": 0.0, "delta_pct": 0.0}]
    for ablation in standard_ablations(model, s_bar, pools):
        decode_only = ablation.carry_shift is None and not ablation.heads_off and not ablation.reads_off
        if decode_only:
            result = decoded_perplexity(model, states, subset, ablation.decode_shift, batch_size)
        else:
            result = ablation_perplexity(model, subset, ablation, batch_size, progress, reset_after)
        rows.append(
            {
                "name": ablation.name,
                "description": ablation.description,
                **result,
                "delta_ppl": result["perplexity"] - baseline["perplexity"],
                "delta_pct": 100.0 * (result["perplexity"] / baseline["perplexity"] - 1.0),
            }
        )
    return {
        "windows": int(subset.shape[0]),
        "tokens": int(subset.numel()),
        "rows": rows,
        "s_bar_source": "estimated on the same windows (in-sample)",
    }
