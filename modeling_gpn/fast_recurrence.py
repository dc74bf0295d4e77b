"""The fast path of the GPN recurrence: the same function as `GPNModel.recurrence_plain`, computed faster.

What makes it fast (see the speed issue and `GPN.md`):

- **Folded weights.** Every RMSNorm weight is folded into the matrix it feeds, so a step needs one matmul
  on the unit-normalised grounded state for *all* projections of g (the memory write, the next step's key,
  and every projection of the first predict layer), one on rms(p) for the fuse gate, and one for the FFN
  and the read output together (their inputs concatenated).
- **A custom backward.** `GPNRecurrenceFunction` runs only the state-gradient chain step by step, with
  the small per-step matmuls against the (detached) weights; the gradient of every weight matrix is one
  large matmul over many positions at once (the inputs of each matmul and the gradients of its output
  are collected over up to `WEIGHT_GRAD_BLOCK` steps, then multiplied), as cuDNN-style RNN backward passes do.
- **Memory-bounded BPTT.** The forward pass keeps the state (p, g, key, M) only at segment boundaries
  (`config.bptt_segment_length`; `None` keeps every step); the backward pass recomputes each segment's
  states from its boundary before walking it backwards. Activation memory is then one segment's states
  plus the boundaries, instead of batch x length x memory cells.
- **Truncated BPTT.** With `config.bptt_truncation_length = K` the gradient through the carried state
  (p, g, M) is cut before every position t with t % K == 0 (t > 0): exactly as the plain loop detaching
  its state there.
- **Precision.** Matmuls run in the weights' dtype (e.g. bf16); the state, the memory and every
  elementwise operation stay float32.

This file ships to the Hub with the model: it imports only torch, math and typing.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

WEIGHT_GRAD_BLOCK = 64  # steps whose weight gradients are computed together in one matmul
L2_NORM_EPS = 1e-12


# --------------------------------------------------------------------------------------------------
# Folded weights
# --------------------------------------------------------------------------------------------------


class FoldedWeights(NamedTuple):
    """All weights of one step as (in, out) matrices with the RMSNorm weights folded in.

    `big_w` (d, N) maps the unit-normalised g to, in this order: the key (H*dk; used by the *next* step),
    value (H*dv), beta (H), decay (H), then layer 0's gate (d), FFN input (2f), read query (H*dk) and read
    gate (H*dv) (the memory and read columns only with memory). `layer_w[i]` is the same for predict layer
    i+1 (its gate, FFN input, query, read gate). `out_w[i]` maps [FFN hidden | gated normalised read] to d.
    """

    fg_w: torch.Tensor
    fg_b: torch.Tensor
    big_w: torch.Tensor
    big_b: torch.Tensor
    out_w: tuple[torch.Tensor, ...]
    layer_w: tuple[torch.Tensor, ...]
    layer_b: tuple[torch.Tensor, ...]
    neg_decay_rate: Optional[torch.Tensor]  # -exp(A_log) (H,), float32


class Shapes(NamedTuple):
    batch: int
    hidden: int
    inter: int
    heads: int
    key_dim: int
    value_dim: int
    layers: int
    memory: bool


def _fold(linear: torch.nn.Linear, norm_weight: torch.Tensor) -> torch.Tensor:
    """(in, out) matrix W^T * n[:, None], computed in float32, returned in the weights' dtype."""
    return (linear.weight.float().t() * norm_weight.float()[:, None]).to(linear.weight.dtype)


def _bias(linear: torch.nn.Linear, size: int, device, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
    if linear is not None and linear.bias is not None:
        return linear.bias.float()
    if extra is not None:
        return extra.float()
    return torch.zeros(size, device=device, dtype=torch.float32)


def _layer_columns(layer, device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weights = [_fold(layer.gate, layer.gate_norm.weight), _fold(layer.ffn_in, layer.ffn_norm.weight)]
    biases = [_bias(layer.gate, 0, device), _bias(None, layer.ffn_in.weight.shape[0], device)]
    if layer.use_memory:
        weights += [_fold(layer.read_query, layer.read_norm.weight), _fold(layer.read_gate, layer.read_norm.weight)]
        biases += [_bias(layer.read_query, 0, device), _bias(None, layer.read_gate.weight.shape[0], device)]
    return weights, biases


def _out_matrix(layer) -> torch.Tensor:
    ffn_out = layer.ffn_out.weight.t()
    if not layer.use_memory:
        return ffn_out
    read_out = _fold(layer.read_out, layer.read_out_norm.weight)
    return torch.cat([ffn_out, read_out], dim=0)


def fold_weights(model) -> FoldedWeights:
    """Fold the weights of a `GPNModel` (differentiably: gradients flow back to the parameters)."""
    device = model.fuse_gate.weight.device
    first, *rest = model.predict_layers
    weights, biases = [], []
    write = model.memory_write
    if write is not None:
        norm = write.norm.weight
        weights += [_fold(write.key, norm), _fold(write.value, norm), _fold(write.beta, norm), _fold(write.decay, norm)]
        biases += [
            _bias(write.key, 0, device),
            _bias(None, write.value.weight.shape[0], device),
            _bias(None, write.beta.weight.shape[0], device),
            write.dt_bias.float(),
        ]
    layer_weights, layer_biases = _layer_columns(first, device)
    weights += layer_weights
    biases += layer_biases
    layer_w, layer_b = [], []
    for layer in rest:
        w, b = _layer_columns(layer, device)
        layer_w.append(torch.cat(w, dim=1))
        layer_b.append(torch.cat(b))
    return FoldedWeights(
        fg_w=_fold(model.fuse_gate, model.fuse_gate_norm.weight),
        fg_b=model.fuse_gate.bias.float(),
        big_w=torch.cat(weights, dim=1),
        big_b=torch.cat(biases),
        out_w=tuple(_out_matrix(layer) for layer in model.predict_layers),
        layer_w=tuple(layer_w),
        layer_b=tuple(layer_b),
        neg_decay_rate=-torch.exp(write.A_log.float()) if write is not None else None,
    )


def cached_folded_weights(model) -> FoldedWeights:
    """`fold_weights` for inference, reused while no parameter changed (decode pays the fold once)."""
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())
    cached = getattr(model, "_gpn_folded_cache", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        folded = fold_weights(model)
    object.__setattr__(model, "_gpn_folded_cache", (key, folded))
    return folded


def shapes_of(model, batch: int) -> Shapes:
    config = model.config
    return Shapes(
        batch=batch,
        hidden=config.hidden_size,
        inter=config.intermediate_size,
        heads=config.num_memory_heads if config.use_memory else 0,
        key_dim=config.memory_key_dim if config.use_memory else 0,
        value_dim=config.memory_value_dim if config.use_memory else 0,
        layers=config.num_predict_layers,
        memory=bool(config.use_memory),
    )


# --------------------------------------------------------------------------------------------------
# One step on folded weights
# --------------------------------------------------------------------------------------------------


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_NORM_EPS)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.matmul(x.to(w.dtype), w).float()


class StepRecord(NamedTuple):
    """What a step multiplies (inputs of each matmul) and produces (outputs, whose gradients we need)."""

    mm_inputs: list  # [a_p, a_g, X_0, (a_c_i, X_i) for layers i >= 1]
    mm_outputs: list  # [z_fg, Z, Y_0, (Z_i, Y_i) ...]


def key_from_grounded(grounded: torch.Tensor, w: FoldedWeights, s: Shapes, eps: float) -> torch.Tensor:
    """Key pre-activation W_k rms(g) + b_k for a grounded state (used for the state before the window)."""
    width = s.heads * s.key_dim
    return _mm(_unit_rms(grounded, eps), w.big_w[:, :width]) + w.big_b[:width]


def fast_step(
    p: torch.Tensor,
    g: torch.Tensor,
    key: Optional[torch.Tensor],
    memory: torch.Tensor,
    u: torch.Tensor,
    real: Optional[torch.Tensor],
    w: FoldedWeights,
    s: Shapes,
    eps: float,
    record: bool = False,
):
    """One token on folded weights: (p, g, key(g), M), u -> (p', g', key(g'), M', gamma[, StepRecord])."""
    B, H, dk, dv, d, f = s.batch, s.heads, s.key_dim, s.value_dim, s.hidden, s.inter
    a_p = _unit_rms(p, eps)
    z_fg = _mm(a_p, w.fg_w) + w.fg_b
    grounded = torch.sigmoid(z_fg) * p + u
    a_g = _unit_rms(grounded, eps)
    Z = _mm(a_g, w.big_w) + w.big_b
    gamma = None
    new_memory = memory
    if s.memory:
        new_key, value, beta, decay, layer_part = Z.split([H * dk, H * dv, H, H, Z.shape[1] - H * (dk + dv + 2)], 1)
        # M' = e^gamma M + k (beta (v - M^T k))^T, as two passes over M (a scale, then a batched rank-1 add)
        k = _l2(F.relu(key).reshape(B * H, 1, dk))
        gamma = w.neg_decay_rate * F.softplus(decay)
        flat = memory.view(B * H, dk, dv)
        error = value.reshape(B * H, 1, dv) - torch.bmm(k, flat)
        update = torch.sigmoid(beta).view(B * H, 1, 1) * error
        new_memory = torch.baddbmm(flat * torch.exp(gamma).view(B * H, 1, 1), k.transpose(1, 2), update).view(B, H, dk, dv)
    else:
        layer_part, new_key = Z, key
    mm_inputs, mm_outputs = [a_p, a_g], [z_fg, Z]
    state = grounded
    for i in range(s.layers):
        if i > 0:
            a_c = _unit_rms(state, eps)
            layer_part = _mm(a_c, w.layer_w[i - 1]) + w.layer_b[i - 1]
            mm_inputs.append(a_c)
            mm_outputs.append(layer_part)
        if s.memory:
            gate, ffn_a, ffn_b, query, read_gate = layer_part.split([d, f, f, H * dk, H * dv], 1)
            q = _l2(F.relu(query).reshape(B * H, 1, dk))
            read = torch.bmm(q, new_memory.view(B * H, dk, dv)).view(B, H * dv)
            X = torch.cat([F.silu(ffn_a) * ffn_b, F.silu(read_gate) * _unit_rms(read, eps)], dim=1)
        else:
            gate, ffn_a, ffn_b = layer_part.split([d, f, f], 1)
            X = F.silu(ffn_a) * ffn_b
        Y = _mm(X, w.out_w[i])
        mm_inputs.append(X)
        mm_outputs.append(Y)
        state = torch.sigmoid(gate) * state + Y
    new_p = state
    if real is not None:
        r = real[:, None]
        new_p = torch.where(r, new_p, p)
        grounded = torch.where(r, grounded, g)
        if s.memory:
            new_key = torch.where(r, new_key, key)
            new_memory = torch.where(real[:, None, None, None], new_memory, memory)
    if record:
        return new_p, grounded, new_key, new_memory, gamma, StepRecord(mm_inputs, mm_outputs)
    return new_p, grounded, new_key, new_memory, gamma


def _run_steps(U, mask, state, w, s, eps, start, stop, keep_states: bool, outputs=None, gammas=None):
    """Steps start..stop-1 without autograd; optionally keep the input state of every step."""
    p, g, key, memory = state
    kept = []
    for t in range(start, stop):
        if keep_states:
            kept.append((p, g, key, memory))
        p, g, key, memory, gamma = fast_step(p, g, key, memory, U[:, t], None if mask is None else mask[:, t], w, s, eps)
        if outputs is not None:
            outputs[:, t] = p
        if gammas is not None and gamma is not None:
            gammas[:, t] = gamma
    return (p, g, key, memory), kept


# --------------------------------------------------------------------------------------------------
# The custom autograd function
# --------------------------------------------------------------------------------------------------


class GPNRecurrenceFunction(torch.autograd.Function):
    """Predicted states of a window, with a sequential state-gradient backward and batched weight gradients.

    Inputs: token inputs U (B, T, d), the initial state p0, g0, M0, the mask (B, T) bool or None, static
    settings, then the flattened `FoldedWeights`. Outputs: P (B, T, d), final p, g, M, and gamma (B, T, H)
    (gamma is a diagnostic output without gradient).
    """

    @staticmethod
    def forward(ctx, U, p0, g0, M0, mask, settings, *flat_weights):
        s, eps, segment, truncation = settings
        w = _unflatten(flat_weights, s)
        B, T, d = U.shape
        outputs = U.new_empty(B, T, d, dtype=torch.float32)
        gammas = U.new_zeros(B, T, s.heads, dtype=torch.float32) if s.memory else None
        key0 = key_from_grounded(g0, w, s, eps) if s.memory else g0.new_zeros(B, 0)
        state = (p0, g0, key0, M0)
        boundaries = []
        seg = segment or 1
        for start in range(0, T, seg):
            boundaries.append(state)
            state, _ = _run_steps(U, mask, state, w, s, eps, start, min(start + seg, T), False, outputs, gammas)
        p, g, _, memory = state
        ctx.settings = settings
        ctx.boundaries = boundaries
        ctx.has_mask = mask is not None
        ctx.save_for_backward(U, g0, *( [mask] if mask is not None else []), *flat_weights)
        if gammas is None:
            gammas = U.new_zeros(B, T, 0)
        ctx.mark_non_differentiable(gammas)
        return outputs, p, g, memory, gammas

    @staticmethod
    def backward(ctx, dP, dp_final, dg_final, dM_final, _dgamma):
        s, eps, segment, truncation = ctx.settings
        saved = ctx.saved_tensors
        U, g0 = saved[0], saved[1]
        if ctx.has_mask:
            mask, flat_weights = saved[2], saved[3:]
        else:
            mask, flat_weights = None, saved[2:]
        w = _unflatten(flat_weights, s)
        B, T, d = U.shape
        zeros_like = lambda x: torch.zeros_like(x)  # noqa: E731
        first = ctx.boundaries[0]
        dp = dp_final if dp_final is not None else zeros_like(first[0])
        dg = dg_final if dg_final is not None else zeros_like(first[1])
        dkey = zeros_like(first[2])
        dM = dM_final if dM_final is not None else zeros_like(first[3])
        if dP is None:
            dP = torch.zeros(B, T, d, dtype=torch.float32, device=U.device)
        dU = torch.zeros_like(U, dtype=torch.float32)
        grads = _WeightGrads(w)
        seg = segment or 1
        for index in reversed(range(len(ctx.boundaries))):
            start = index * seg
            stop = min(start + seg, T)
            # recompute the segment once, keeping each step's autograd graph (cut at its input state)
            graphs, state = [], ctx.boundaries[index]
            for t in range(start, stop):
                graphs.append(_step_with_graph(state, U[:, t], mask, t, w, s, eps))
                state = tuple(x.detach() for x in graphs[-1][1][:4])
            for t in reversed(range(start, stop)):
                graph = graphs.pop()
                dp, dg, dkey, dM, du = _step_grads(graph, s, dp + dP[:, t], dg, dkey, dM, grads)
                dU[:, t] = du
                if truncation and t % truncation == 0 and t > 0:
                    # the state is cut here, the weights are not: the key of step t (from g_{t-1}) still
                    # contributes to the key projection's gradient, but nothing flows into g_{t-1}
                    if s.memory:
                        grads.add_key0(_unit_rms(graph[0][1].detach(), eps), dkey)
                    dp, dg, dkey, dM = zeros_like(dp), zeros_like(dg), zeros_like(dkey), zeros_like(dM)
            ctx.boundaries[index] = None
        if s.memory:  # the key of the first step came from g0
            with torch.enable_grad():
                g0_leaf = g0.detach().requires_grad_(True)
                a_g0 = _unit_rms(g0_leaf, eps)
                key0 = _mm(a_g0, w.big_w[:, : s.heads * s.key_dim])
                (dg0,) = torch.autograd.grad(key0, g0_leaf, dkey)
            dg = dg + dg0
            grads.add_key0(a_g0.detach(), dkey)
        weight_grads = grads.finish()
        return (dU.to(U.dtype), dp, dg, dM, None, None, *weight_grads)


def _step_with_graph(state, u, mask, t, w, s, eps):
    """Step t under autograd from a detached copy of its input state: (leaves, outputs, record)."""
    p, g, key, memory = state
    with torch.enable_grad():
        if s.memory:
            w = w._replace(neg_decay_rate=w.neg_decay_rate.detach().requires_grad_(True))
        p = p.detach().requires_grad_(True)
        g = g.detach().requires_grad_(True)
        key = key.detach().requires_grad_(s.memory)
        memory = memory.detach().requires_grad_(s.memory)
        u = u.detach().float().requires_grad_(True)
        real = None if mask is None else mask[:, t]
        new_p, new_g, new_key, new_memory, _, record = fast_step(p, g, key, memory, u, real, w, s, eps, record=True)
    leaves = [p, g, u] + ([key, memory, w.neg_decay_rate] if s.memory else [])
    return leaves, (new_p, new_g, new_key, new_memory), record


def _step_grads(graph, s, dp_out, dg_out, dkey_out, dM_out, grads):
    """Backward through one step's graph: the state gradients; matmul pairs go to `grads`."""
    leaves, (new_p, new_g, new_key, new_memory), record = graph
    outs, gouts = [new_p, new_g], [dp_out, dg_out]
    if s.memory:
        outs += [new_key, new_memory]
        gouts += [dkey_out, dM_out]
    results = torch.autograd.grad(outs, leaves + record.mm_outputs, gouts, allow_unused=True)
    leaf_grads = [torch.zeros_like(x) if r is None else r for x, r in zip(leaves, results[: len(leaves)])]
    out_grads = [torch.zeros_like(y) if r is None else r for y, r in zip(record.mm_outputs, results[len(leaves) :])]
    grads.add([x.detach() for x in record.mm_inputs], out_grads)
    dp, dg, du = leaf_grads[:3]
    if s.memory:
        dkey, dM, d_neg_decay = leaf_grads[3:]
        grads.neg_decay = d_neg_decay if grads.neg_decay is None else grads.neg_decay + d_neg_decay
    else:
        dkey, dM = dkey_out, dM_out
    return dp, dg, dkey, dM, du


class _WeightGrads:
    """Collects (matmul input, output gradient) pairs and turns them into weight gradients in blocks."""

    def __init__(self, w: FoldedWeights):
        self.w = w
        self.pending: list = []
        self.fg_w = torch.zeros(w.fg_w.shape, dtype=torch.float32, device=w.fg_w.device)
        self.fg_b = torch.zeros(w.fg_b.shape, dtype=torch.float32, device=w.fg_b.device)
        self.big_w = torch.zeros(w.big_w.shape, dtype=torch.float32, device=w.big_w.device)
        self.big_b = torch.zeros(w.big_b.shape, dtype=torch.float32, device=w.big_b.device)
        self.out_w = [torch.zeros(o.shape, dtype=torch.float32, device=o.device) for o in w.out_w]
        self.layer_w = [torch.zeros(o.shape, dtype=torch.float32, device=o.device) for o in w.layer_w]
        self.layer_b = [torch.zeros(o.shape, dtype=torch.float32, device=o.device) for o in w.layer_b]
        self.neg_decay = None

    def add(self, inputs, out_grads) -> None:
        self.pending.append((inputs, out_grads))
        if len(self.pending) >= WEIGHT_GRAD_BLOCK:
            self.flush()

    def add_key0(self, a_g0: torch.Tensor, dkey: torch.Tensor) -> None:
        """Weight gradient of a key computed from a grounded state outside the chain (g0, or a cut)."""
        width = dkey.shape[1]
        self.big_w[:, :width] += _tmm(a_g0, dkey, self.w.big_w.dtype)
        self.big_b[:width] += dkey.sum(0)

    def flush(self) -> None:
        if not self.pending:
            return
        columns = list(zip(*[[*ins] for ins, _ in self.pending]))
        grad_columns = list(zip(*[[*gs] for _, gs in self.pending]))
        self.pending = []

        def pair(j):
            x = torch.cat(columns[j], 0)
            gy = torch.cat(grad_columns[j], 0)
            return x, gy

        dtype = self.w.big_w.dtype
        x, gy = pair(0)
        self.fg_w += _tmm(x, gy, dtype)
        self.fg_b += gy.sum(0)
        x, gy = pair(1)
        self.big_w += _tmm(x, gy, dtype)
        self.big_b += gy.sum(0)
        x, gy = pair(2)
        self.out_w[0] += _tmm(x, gy, dtype)
        for i in range(1, len(self.out_w)):
            x, gy = pair(1 + 2 * i)
            self.layer_w[i - 1] += _tmm(x, gy, dtype)
            self.layer_b[i - 1] += gy.sum(0)
            x, gy = pair(2 + 2 * i)
            self.out_w[i] += _tmm(x, gy, dtype)

    def finish(self) -> list:
        self.flush()
        w = self.w
        cast = lambda g, ref: g.to(ref.dtype)  # noqa: E731
        grads = [cast(self.fg_w, w.fg_w), self.fg_b, cast(self.big_w, w.big_w), self.big_b]
        grads += [cast(g, ref) for g, ref in zip(self.out_w, w.out_w)]
        grads += [cast(g, ref) for g, ref in zip(self.layer_w, w.layer_w)]
        grads += list(self.layer_b)
        if w.neg_decay_rate is not None:
            grads.append(self.neg_decay if self.neg_decay is not None else torch.zeros_like(w.neg_decay_rate))
        return grads


def _tmm(x: torch.Tensor, gy: torch.Tensor, dtype) -> torch.Tensor:
    """x^T gy over all collected positions, in the weights' dtype with a float32 result."""
    return torch.matmul(x.t().to(dtype), gy.to(dtype)).float()


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def _flatten(w: FoldedWeights) -> list:
    flat = [w.fg_w, w.fg_b, w.big_w, w.big_b, *w.out_w, *w.layer_w, *w.layer_b]
    if w.neg_decay_rate is not None:
        flat.append(w.neg_decay_rate)
    return flat


def _unflatten(flat, s: Shapes) -> FoldedWeights:
    n = s.layers
    out_w = tuple(flat[4 : 4 + n])
    layer_w = tuple(flat[4 + n : 3 + 2 * n])
    layer_b = tuple(flat[3 + 2 * n : 2 + 3 * n])
    neg = flat[2 + 3 * n] if s.memory else None
    return FoldedWeights(flat[0], flat[1], flat[2], flat[3], out_w, layer_w, layer_b, neg)


def fast_recurrence(
    model,
    token_inputs: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: Optional[torch.Tensor],
    output_memory_decays: bool = False,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], Optional[torch.Tensor]]:
    """Drop-in for `GPNModel.recurrence_plain` (same arguments, same results, same gradients).

    Returns the predicted states (B, T, d) float32, the final (p, g, M) and, if asked, gamma (B, T, H).
    Under autograd the gradient flows to `token_inputs`, the initial state and every parameter; gamma is
    returned without gradient.
    """
    config = model.config
    B, T, _ = token_inputs.shape
    s = shapes_of(model, B)
    eps = config.rms_norm_eps
    p0, g0, M0 = (x.float() for x in state)
    if mask is not None:
        mask = mask.bool()
    needs_grad = torch.is_grad_enabled() and (
        token_inputs.requires_grad or any(x.requires_grad for x in state) or any(q.requires_grad for q in model.parameters())
    )
    if not needs_grad:
        with torch.no_grad():
            w = cached_folded_weights(model)
            outputs = torch.empty(B, T, s.hidden, dtype=torch.float32, device=token_inputs.device)
            gammas = torch.zeros(B, T, s.heads, device=token_inputs.device) if (s.memory and output_memory_decays) else None
            key0 = key_from_grounded(g0, w, s, eps) if s.memory else g0.new_zeros(B, 0)
            (p, g, _, memory), _ = _run_steps(token_inputs.float(), mask, (p0, g0, key0, M0), w, s, eps, 0, T, False, outputs, gammas)
        return outputs, (p, g, memory), gammas
    w = fold_weights(model)
    settings = (s, eps, config.bptt_segment_length, config.bptt_truncation_length)
    outputs, p, g, memory, gammas = GPNRecurrenceFunction.apply(token_inputs, p0, g0, M0, mask, settings, *_flatten(w))
    return outputs, (p, g, memory), (gammas if (s.memory and output_memory_decays) else None)


# --------------------------------------------------------------------------------------------------
# Chunked loss: the cross-entropy of the tied decoder without materialising batch x length x vocab logits
# --------------------------------------------------------------------------------------------------


class ChunkedTiedCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropies of logits = h E^T over rows, computed (and recomputed in backward) in chunks.

    h (N, e), E (V, e), targets (N,) with -100 ignored. Only h, E, the targets and one log-sum-exp per
    row are kept; the logits of at most `chunk` rows exist at any time. Logits are float32 as in the
    plain loss (which upcasts them).
    """

    @staticmethod
    def forward(ctx, h, E, targets, chunk: int):
        N = h.shape[0]
        lse = torch.empty(N, dtype=torch.float32, device=h.device)
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        valid = targets != -100
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        for start in range(0, N, chunk):
            logits = torch.matmul(h[start : start + chunk], E.t()).float()
            lse[start : start + chunk] = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[start : start + chunk, None])[:, 0]
            total += ((lse[start : start + chunk] - picked) * valid[start : start + chunk]).sum()
        ctx.save_for_backward(h, E, safe, valid, lse)
        ctx.chunk = chunk
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h, E, safe, valid, lse = ctx.saved_tensors
        chunk = ctx.chunk
        dh = torch.empty_like(h, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        dE = torch.zeros(E.shape, dtype=torch.float32, device=E.device) if ctx.needs_input_grad[1] else None
        for start in range(0, h.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = torch.matmul(h[rows], E.t()).float()
            probs = torch.exp(logits - lse[rows, None])
            probs.scatter_add_(1, safe[rows, None], -torch.ones_like(probs[:, :1]))
            probs *= (valid[rows] * grad_total)[:, None]
            g = probs.to(E.dtype)
            if dh is not None:
                dh[rows] = torch.matmul(g, E).float()
            if dE is not None:
                dE += torch.matmul(g.t(), h[rows]).float()
        return (
            None if dh is None else dh.to(h.dtype),
            None if dE is None else dE.to(E.dtype),
            None,
            None,
        )


def chunked_causal_lm_loss(
    decoded: torch.Tensor, embedding: torch.Tensor, labels: torch.Tensor, chunk_rows: Optional[int] = None
) -> torch.Tensor:
    """Mean shifted cross-entropy of logits = decoded E^T (decoded (B, T, e), labels (B, T), -100 ignored).

    Equals `F.cross_entropy(logits[:, :-1].float(), labels[:, 1:])` without holding the (B, T, V) logits.
    """
    V, e = embedding.shape
    if chunk_rows is None:
        chunk_rows = max(64, (1 << 24) // V)
    h = decoded[:, :-1].reshape(-1, e).to(embedding.dtype)
    targets = labels[:, 1:].reshape(-1).to(decoded.device)
    total = ChunkedTiedCrossEntropy.apply(h, embedding, targets, chunk_rows)
    return total / (targets != -100).sum()  # nan when nothing is counted, as F.cross_entropy
