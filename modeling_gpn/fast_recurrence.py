"""The fast path of the GPN recurrence: the same function as `GPNModel.recurrence_plain`, computed faster.

What makes it fast (see the speed issue and `GPN.md`):

- **Folded weights.** Every RMSNorm weight is folded into the matrix it feeds, so a step needs one matmul
  on the unit-normalised grounded state for *all* projections of g (the memory write, the next step's key,
  and every projection of the first predict layer), one on rms(p) for the fuse gate, and one for the FFN
  and the read output together (their inputs concatenated).
- **A hand-written backward.** `GPNRecurrenceFunction` runs only the state-gradient chain step by step
  (`_step_backward`, the derivative of `_step` written out, no autograd graph), with the small per-step
  matmuls against contiguous transposed weights; the gradient of every weight matrix is one large matmul
  over many positions at once (each step writes the inputs of its matmuls and the gradients of their
  outputs into blocks of `WEIGHT_GRAD_ROWS` rows, then they are multiplied), as cuDNN-style RNN backward
  passes do.
- **Few bytes per step.** A step is bound by streaming the weights (33 MB in fp32 for the "small" preset)
  through the cache, so nothing else big is touched: the memory M' is written into reused buffers,
  layer 0 reads M' through M'^T q = e^gamma M^T q + (q.k) update from the same pass over M as the write.
- **Fused memory kernels (CPU).** The memory half of a step (key and query normalisation, write gates,
  the write, layer 0's read and its norm) and the gradient of the write and reads run one head at a time
  in small C kernels (`memory_kernels.py`, compiled once per machine), so M and dL/dM are read from memory
  once per step instead of once per torch op (small preset, batch 8, 2 threads: the backward's memory part
  0.59 -> 0.23 ms per step). The torch ops stay as the path on GPU, under torch.compile, without a C
  compiler, and with GPN_MEMORY_KERNELS=0; tests run both.
- **Memory-bounded BPTT.** The forward pass keeps the state (p, g, key, M) only at segment boundaries
  (`config.bptt_segment_length`; `None` keeps every step); the backward pass recomputes each segment's
  states from its boundary before walking it backwards. Activation memory is then one segment's states
  plus the boundaries, instead of batch x length x memory cells.
- **Truncated BPTT.** With `config.bptt_truncation_length = K` the gradient through the carried state
  (p, g, M) is cut before every position t with t % K == 0 (t > 0): exactly as the plain loop detaching
  its state there.
- **Precision.** Matmuls run in the weights' dtype (e.g. bf16); the state, the memory and every
  elementwise operation stay float32. On CPU, bf16 step matrices (and fp32 ones for training on several
  threads) are prepacked for oneDNN (`PackedMatrix`).
- **Autocast.** Under `torch.autocast` the plain loop multiplies in the autocast dtype and keeps its state
  and elementwise ops float32. The fast path says the same explicitly: it casts the folded step matrices to
  the autocast dtype once (differentiably: the gradients reach the float32 parameters) and runs its steps
  and its backward with autocast off, so every tensor it makes has the dtype it (and the C kernels, which
  read float32 only) expects.

This file ships to the Hub with the model (with `memory_kernels.py`): it imports only torch, typing,
contextlib and weakref.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from .cuda_graphs import training_sweep
from .cuda_graphs import wanted as graph_wanted
from .cuda_graphs import window_forward as graph_window_forward
from .memory_kernels import KernelRefusal, MemoryStep, memory_step, memory_write_backward
from .memory_kernels import usable as memory_kernels_usable
from .triton_kernels import is_turned_off as triton_is_turned_off
from .triton_kernels import memory_step as triton_memory_step
from .triton_kernels import memory_write_backward as triton_memory_write_backward
from .triton_kernels import on_device
from .triton_kernels import self_check as triton_self_check
from .triton_kernels import self_check_needed as triton_self_check_needed
from .triton_kernels import self_check_passed as triton_self_check_passed
from .triton_kernels import selected as triton_selected
from .triton_kernels import step as triton_step
from .triton_kernels import step_backward as triton_step_backward
from .triton_kernels import turned_off as triton_turned_off
from .triton_kernels import usable_memory as triton_usable_memory
from .triton_kernels import usable_step as triton_usable_step

WEIGHT_GRAD_ROWS = 512  # rows (steps x batch) whose weight gradients are computed together in one matmul
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


class PackedMatrix:
    """An (in, out) matrix prepacked once for oneDNN's CPU linear, for the thin matmuls of the steps.

    When it pays (see `worthwhile`): torch's bf16 matmul reorders the weight on every call, which for the
    1-8 row matmuls of a step costs as much as the product, and for 8-row fp32 products on several threads
    oneDNN's packed kernel splits the work better than MKL. The small preset's three step matmuls, 8 rows:
    2 threads 0.70 ms (bf16 packed), 1.47 (bf16), 1.23 (fp32 packed), 1.61 (fp32); 1 thread 1.32 (bf16
    packed), 2.17 (fp32 packed), 2.04 (fp32). Matrices are packed once per weight change for inference and
    once per call in training (a single pass over the weights)."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix
        self.packed = torch.ops.mkldnn._reorder_linear_weight(matrix.t().contiguous(), None)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ matrix, float32 result."""
        return torch.ops.mkldnn._linear_pointwise(x.to(self.matrix.dtype), self.packed, None, "none", [], "").float()

    @staticmethod
    def worthwhile(w: FoldedWeights, rows: Optional[int] = None) -> bool:
        """Whether to pack the step matrices of `w`: bf16 on a CPU whose oneDNN has bf16 kernels, always;
        fp32 on CPU only for products of 8 or more `rows` on more than one thread (on one thread, and for
        the single rows of decoding, MKL's unpacked product is faster). `rows=None`: a batch of unknown size."""
        if w.big_w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
            return False
        if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
            return False
        if w.big_w.dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        return w.big_w.dtype == torch.float32 and rows is not None and rows >= 8 and torch.get_num_threads() > 1


def _pack(w: FoldedWeights) -> FoldedWeights:
    """`FoldedWeights` with every step matrix a `PackedMatrix`."""
    try:
        return w._replace(
            fg_w=PackedMatrix(w.fg_w), big_w=PackedMatrix(w.big_w),
            out_w=tuple(map(PackedMatrix, w.out_w)), layer_w=tuple(map(PackedMatrix, w.layer_w)),
        )  # fmt: skip
    except RuntimeError:  # a oneDNN build without these kernels: the plain bf16 matmul still works
        return w


def in_matmul_dtype(w: FoldedWeights, dtype: Optional[torch.dtype]) -> FoldedWeights:
    """`w` with its step matrices in `dtype` (what autocast multiplies in; None: unchanged), cast as
    autocast casts (every floating dtype but float64). Biases and decay rates stay float32."""
    if dtype is None:
        return w
    cast = lambda m: m if m.dtype in (dtype, torch.float64) else m.to(dtype)  # noqa: E731
    return w._replace(fg_w=cast(w.fg_w), big_w=cast(w.big_w), out_w=tuple(map(cast, w.out_w)),
                      layer_w=tuple(map(cast, w.layer_w)))  # fmt: skip


def parameters_key(model) -> tuple:
    """What identifies the model's current weights: each parameter's storage, version (bumped by every
    in-place update, an optimizer step's too), dtype and device. The caches of weights derived from them
    (`cached_folded_weights`, the CUDA graphs) are rebuilt when it changes."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


def cached_folded_weights(model, rows: Optional[int] = None, matmul_dtype: Optional[torch.dtype] = None) -> FoldedWeights:
    """`fold_weights` for inference, reused while no parameter changed (decode pays the fold once), with
    the step matrices in `matmul_dtype` (autocast's; None: the weights' own) and prepacked for oneDNN where
    that is faster for products of `rows` rows (`PackedMatrix.worthwhile`): bf16 on CPU always, fp32 for
    batches of 8+ rows on several threads. The variants are cached side by side (batch-1 decoding and
    batched scoring both stay fast)."""
    key = parameters_key(model)
    cached = getattr(model, "_gpn_folded_cache", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, {(None, False): fold_weights(model)})
        object.__setattr__(model, "_gpn_folded_cache", cached)
    variants = cached[1]
    if (matmul_dtype, False) not in variants:
        with torch.no_grad():
            variants[(matmul_dtype, False)] = in_matmul_dtype(variants[(None, False)], matmul_dtype)
    unpacked = variants[(matmul_dtype, False)]
    pack = PackedMatrix.worthwhile(unpacked, rows)
    if (matmul_dtype, pack) not in variants:
        with torch.no_grad():
            variants[(matmul_dtype, pack)] = _pack(unpacked)
    return variants[(matmul_dtype, pack)]


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
# Normalisations and their gradients
# --------------------------------------------------------------------------------------------------


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps)."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """(mean(x^2) + eps)^(-1/2), the scale `_unit_rms` applied (recomputed in backward, not stored)."""
    return x.square().mean(-1, keepdim=True).add_(eps).rsqrt_()


def _rms_backward(dy: torch.Tensor, y: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """dx for y = x * inv, inv = (mean(x^2) + eps)^(-1/2):  dx = inv * (dy - y * mean(dy * y))."""
    return torch.addcmul(dy, y, (dy * y).mean(-1, keepdim=True), value=-1).mul_(inv)


def _l2_parts(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, inv) with y = x * inv and inv = (sum(x^2) + eps)^(-1/2), over the last dimension."""
    inv = torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_NORM_EPS)
    return x * inv, inv


def _l2_backward(dy: torch.Tensor, y: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """dx for y = x * (sum(x^2) + eps)^(-1/2):  dx = inv * (dy - y * sum(dy * y))."""
    return torch.addcmul(dy, y, (dy * y).sum(-1, keepdim=True), value=-1).mul_(inv)


def _sigmoid_grad(sig_x: torch.Tensor) -> torch.Tensor:
    """d sigma(x) / dx = sigma(x) (1 - sigma(x)), as one op."""
    return torch.addcmul(sig_x, sig_x, sig_x, value=-1)


def _silu_grad(x: torch.Tensor, sig_x: torch.Tensor) -> torch.Tensor:
    """d silu(x) / dx = sigma(x) (1 + x (1 - sigma(x))) = sigma(x) + x sigma'(x)."""
    return torch.addcmul(sig_x, x, _sigmoid_grad(sig_x))


def _mm(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w in the weights' dtype, float32 result (w a matrix or a `PackedMatrix`)."""
    if isinstance(w, PackedMatrix):
        return w.mm(x)
    if w.dtype == torch.float32:
        return torch.matmul(x, w)
    return torch.matmul(x.to(w.dtype), w).float()


def _linear(x: torch.Tensor, w, b: torch.Tensor) -> torch.Tensor:
    """x @ w + b in the weights' dtype, float32 result. (Not addmm: it first copies the broadcast bias into
    its output, a pass that costs more than adding the bias in place afterwards, 5% of a step here.)"""
    if isinstance(w, PackedMatrix):
        return w.mm(x).add_(b)
    if w.dtype == torch.float32:
        return torch.mm(x, w).add_(b)
    return torch.matmul(x.to(w.dtype), w).float().add_(b)


def key_from_grounded(grounded: torch.Tensor, w: FoldedWeights, s: Shapes, eps: float) -> torch.Tensor:
    """Key pre-activation W_k rms(g) + b_k for a grounded state (used for the state before the window)."""
    width = s.heads * s.key_dim
    big_w = w.big_w.matrix if isinstance(w.big_w, PackedMatrix) else w.big_w
    return _linear(_unit_rms(grounded, eps), big_w[:, :width], w.big_b[:width])


class Columns(NamedTuple):
    """Where each projection sits in the columns of the step's matmul outputs.

    Z = rms(g) W_big + b_big holds [key' | value | beta | decay] (memory write, without memory: nothing),
    then layer 0's part. A layer's part (layer i >= 1: its own matmul on rms(state)) holds
    [gate (d) | FFN a (f) | FFN b (f) | read query (H*dk) | read gate (H*dv)] (the read columns only with memory).
    """

    write: int  # width of the memory-write columns of Z
    key: slice
    value: slice
    beta: slice
    decay: slice
    gate: slice
    ffn_a: slice
    ffn_b: slice
    query: slice
    read_gate: slice


def columns_of(s: Shapes) -> Columns:
    H, dk, dv, d, f = s.heads, s.key_dim, s.value_dim, s.hidden, s.inter
    kw, vw = H * dk, H * dv
    return Columns(
        write=kw + vw + 2 * H,
        key=slice(0, kw), value=slice(kw, kw + vw), beta=slice(kw + vw, kw + vw + H),
        decay=slice(kw + vw + H, kw + vw + 2 * H),
        gate=slice(0, d), ffn_a=slice(d, d + f), ffn_b=slice(d + f, d + 2 * f),
        query=slice(d + 2 * f, d + 2 * f + kw), read_gate=slice(d + 2 * f + kw, d + 2 * f + kw + vw),
    )  # fmt: skip


# --------------------------------------------------------------------------------------------------
# Backends: which implementation runs a step's fused parts
# --------------------------------------------------------------------------------------------------

TRITON, C_KERNELS, TORCH_OPS = "triton", "c kernels", "torch ops"


def memory_backend(memory: torch.Tensor, *others: torch.Tensor) -> str:
    """Who runs the memory half of a step (and its gradient) for M (BH, dk, dv) and the other inputs:
    `TRITON` (`triton_kernels`: CUDA tensors with triton installed, unless GPN_TRITON=0; on CPU only when
    forced with GPN_TRITON=1 under TRITON_INTERPRET=1, as the tests do), else `C_KERNELS` (`memory_kernels`:
    float32 CPU tensors with a C compiler, unless GPN_MEMORY_KERNELS=0), else `TORCH_OPS` (the reference)."""
    if triton_selected(memory, *others) and triton_usable_memory(memory, *others):
        return TRITON
    if memory_kernels_usable(memory, *others):
        return C_KERNELS
    return TORCH_OPS


def step_function(state: "StepState", u: torch.Tensor, w: FoldedWeights, s: Shapes):
    """The function running one forward step of a window: `triton_kernels.step` (the whole step's elementwise
    work fused into Triton kernels) when the Triton backend is selected and takes these inputs, else `_step`."""
    if triton_selected(state.p, u) and triton_usable_step(state, u, w, s):
        return triton_step
    return _step


def step_backward_function(U: torch.Tensor):
    """The function running one backward step: `triton_kernels.step_backward` when the Triton backend is
    selected for the window's inputs `U` (it hands any step it cannot take to `_step_backward`), else
    `_step_backward`."""
    return triton_step_backward if triton_selected(U) else _step_backward


# --------------------------------------------------------------------------------------------------
# One step forward (optionally keeping what its backward needs)
# --------------------------------------------------------------------------------------------------


class StepState(NamedTuple):
    """The carried state on the fast path: p, g, the key pre-activation computed from g, and M."""

    p: torch.Tensor  # (B, d)
    g: torch.Tensor  # (B, d)
    key: torch.Tensor  # (B, H*dk), or (B, 0) without memory
    memory: torch.Tensor  # (B, H, dk, dv), or (B, 0) without memory


def _predict_layer(state, part, memory_flat, read, normed_read, s: Shapes, c: Columns, eps: float, out_w, record):
    """A predict layer on folded weights: state' = sigmoid(gate) * state + [silu(a) b | silu(r) rms(read)] W_out.

    `part` holds the layer's projections (`Columns`); `read` is M'^T q when already known (layer 0 reads
    it through an identity in `_step`), else it is read here; `normed_read` is rms(read) when known."""
    B, H, dk, dv = s.batch, s.heads, s.key_dim, s.value_dim
    hidden = F.silu(part[:, c.ffn_a]) * part[:, c.ffn_b]
    if s.memory:
        if read is None:
            q_raw = F.relu(part[:, c.query]).reshape(B * H, dk)
            q, q_inv = _l2_parts(q_raw)
            read = torch.bmm(q[:, None], memory_flat).view(B, H * dv)
            if record is not None:
                record.update(q_raw=q_raw, q=q, q_inv=q_inv)
        if normed_read is None:
            normed_read = _unit_rms(read, eps)
        X = torch.cat([hidden, F.silu(part[:, c.read_gate]) * normed_read], dim=1)
        if record is not None:
            record.update(read=read, normed_read=normed_read)
    else:
        X = hidden
    new_state = torch.addcmul(_mm(X, out_w), torch.sigmoid(part[:, c.gate]), state)
    if record is not None:
        record.update(state=state, part=part)  # X is rebuilt in backward (keeping it costs more)
    return new_state


def _memory_step_torch(Z, c: Columns, key, neg_decay_rate, memory, memory_out, eps: float) -> MemoryStep:
    """`memory_kernels.memory_step` in torch ops (the reference for the kernel; the path on GPU and under
    torch.compile): from Z and the carried key, write M' into `memory_out` and read it with layer 0's query.

        k = l2(relu(key)), q = l2(relu(query));  gamma = -exp(A_log) softplus(decay);  beta = sigmoid(.)
        M' = e^gamma M + k update^T,  update = beta (v - M^T k);  read = M'^T q
    """
    heads, dk, dv = memory.shape
    B = Z.shape[0]
    part = Z[:, c.write :]
    # the key (from g_{t-1}) and layer 0's query, normalised together
    kq_raw = torch.stack([key.reshape(heads, dk), part[:, c.query].reshape(heads, dk)], dim=1).relu_()
    kq, kq_inv = _l2_parts(kq_raw)  # (BH, 2, dk)
    k, q = kq[:, 0], kq[:, 1]
    softplus_decay = F.softplus(Z[:, c.decay])
    gamma = neg_decay_rate * softplus_decay  # (B, H)
    decay_factor = torch.exp(gamma).reshape(heads, 1)
    sig_beta = torch.sigmoid(Z[:, c.beta]).reshape(heads, 1)
    # one pass over M gives M^T k (for the write) and M^T q (layer 0's read, through
    # M'^T q = e^gamma M^T q + (q . k) update, which saves a second pass over M')
    both = torch.bmm(kq, memory)  # (BH, 2, dv)
    error = Z[:, c.value].reshape(heads, dv) - both[:, 0]
    update = sig_beta * error
    torch.mul(memory, decay_factor[:, :, None], out=memory_out).addcmul_(k[:, :, None], update[:, None, :])
    read = torch.addcmul(decay_factor * both[:, 1], (q * k).sum(-1, keepdim=True), update).view(B, -1)
    return MemoryStep(kq_raw, kq, kq_inv, softplus_decay, gamma, decay_factor, sig_beta, error, update, read,
                      _unit_rms(read, eps))  # fmt: skip


def _memory_half(Z, c: Columns, key, neg_decay_rate, memory, memory_out, eps: float) -> MemoryStep:
    """The memory half of a step on the backend `memory_backend` picks: Triton kernels (CUDA), one C kernel
    (one head at a time, CPU), else the same in torch ops. The C kernel checks every tensor it would read and
    refuses (`KernelRefusal`) what it cannot take: then the torch ops compute it. (M's device is asked
    first: on GPU nothing is ever compiled.)"""
    backend = memory_backend(memory, Z, key)
    if backend == TRITON:
        return triton_memory_step(Z, c, key, neg_decay_rate, memory, memory_out, eps)
    if backend == C_KERNELS:
        try:
            return memory_step(Z, c, key, neg_decay_rate, memory, memory_out, eps)
        except KernelRefusal:
            pass
    return _memory_step_torch(Z, c, key, neg_decay_rate, memory, memory_out, eps)


def write_memory(Z, key, memory, memory_out, w: FoldedWeights, s: Shapes, c: Columns, eps: float,
                 saved: Optional[dict], memory_half):  # fmt: skip
    """The memory half of a step from its big projection Z: M' (into `memory_out` when given) and layer 0's
    read through `memory_half` (`_memory_half`, or `triton_kernels.memory_step` on static buffers), with the
    records `_step_backward` reads put into `saved`. Shared by `_step` and `triton_kernels.step`, so both
    leave the same records. Without memory the state's key and M pass through unchanged.
    Returns (the next step's key, M' as (B*H, dk, dv), M' as (B, H, dk, dv), gamma, read, rms(read));
    gamma and the reads are None without memory."""
    if not s.memory:
        return key, memory, memory, None, None, None
    B, H, dk, dv = s.batch, s.heads, s.key_dim, s.value_dim
    old_flat = memory.view(B * H, dk, dv)
    memory_flat = memory_out.view(B * H, dk, dv) if memory_out is not None else torch.empty_like(old_flat)
    half = memory_half(Z, c, key, w.neg_decay_rate, old_flat, memory_flat, eps)
    if saved is not None:
        saved.update(half._asdict(), decay=Z[:, c.decay], old_memory=old_flat, new_memory=memory_flat)
    return Z[:, c.key], memory_flat, memory_flat.view(B, H, dk, dv), half.gamma, half.read, half.normed_read


def _step(
    state: StepState, u, real, w: FoldedWeights, s: Shapes, c: Columns, eps: float,
    saved: Optional[dict] = None, memory_out: Optional[torch.Tensor] = None,
):  # fmt: skip
    """One token on folded weights: state, u -> (new state, gamma). Fills `saved` for `_step_backward`
    (references to tensors the step computes anyway; what is cheap is recomputed there instead).
    Writes M' into `memory_out` when given (reused buffers: fresh 1.5 MB tensors every step cost page faults).

    The equations are GPN.md's (see `GPNModel.step`), with the RMSNorm weights folded into the matrices:
        a_p = rms(p);  g = sigmoid(a_p W_fg + b_fg) * p + u;  a_g = rms(g);  Z = a_g W_big + b_big
        k = l2(relu(key));  M' = e^gamma M + k (beta (v - M^T k))^T;  key' = Z[key columns]
        state = g;  for each layer: state = sigmoid(gate) * state + [silu(a) b | silu(r) rms(M'^T q)] W_out
    """
    p, g, key, memory = state
    B, H, dk, dv = s.batch, s.heads, s.key_dim, s.value_dim
    a_p = _unit_rms(p, eps)
    sig_fg = torch.sigmoid(_linear(a_p, w.fg_w, w.fg_b))
    grounded = torch.addcmul(u, sig_fg, p)
    a_g = _unit_rms(grounded, eps)
    Z = _linear(a_g, w.big_w, w.big_b)
    records = None
    if saved is not None:
        records = [{} for _ in range(s.layers)]
        saved.update(p=p, g=g, sig_fg=sig_fg, grounded=grounded, layers=records)  # rms(p), rms(g) are rebuilt
    new_key, memory_flat, new_memory, gamma, read, normed_read = write_memory(
        Z, key, memory, memory_out, w, s, c, eps, saved, _memory_half
    )
    part = Z[:, c.write :]
    layer_state = grounded
    for i in range(s.layers):
        record = None if records is None else records[i]
        if i > 0:
            a_c = _unit_rms(layer_state, eps)
            part = _linear(a_c, w.layer_w[i - 1], w.layer_b[i - 1])
            if record is not None:
                record["a"] = a_c
        first = i == 0
        layer_state = _predict_layer(layer_state, part, memory_flat, read if first else None,
                                     normed_read if first else None, s, c, eps, w.out_w[i], record)  # fmt: skip
    return keep_padded_rows(StepState(layer_state, grounded, new_key, new_memory), state, real, saved, s.memory), gamma


def keep_padded_rows(new: StepState, old: StepState, real: Optional[torch.Tensor], saved: Optional[dict],
                     has_memory: bool) -> StepState:  # fmt: skip
    """The state after a step in which the rows whose `real` is False (padding) keep `old` exactly; `real`
    goes into `saved` for the backward step. (Without memory, key and M are (B, 0) and pass through.)"""
    if real is None:
        return new
    if saved is not None:
        saved["real"] = real
    r = real[:, None]
    p, g = torch.where(r, new.p, old.p), torch.where(r, new.g, old.g)
    if not has_memory:
        return StepState(p, g, new.key, new.memory)
    memory = torch.where(real[:, None, None, None], new.memory, old.memory)
    return StepState(p, g, torch.where(r, new.key, old.key), memory)


# --------------------------------------------------------------------------------------------------
# One step backward, by hand
# --------------------------------------------------------------------------------------------------


class TransposedWeights(NamedTuple):
    """Contiguous transposes of the step matrices: the state-gradient matmuls read them row-major (a
    transposed view costs 2-3x on CPU)."""

    fg_w: torch.Tensor
    big_w: torch.Tensor
    out_w: tuple[torch.Tensor, ...]
    layer_w: tuple[torch.Tensor, ...]
    neg_decay_rate: Optional[torch.Tensor]  # as in FoldedWeights (not transposed; here for the decay gradient)


def transpose_weights(w: FoldedWeights, pack: bool = False) -> TransposedWeights:
    """The transposes as contiguous copies, or (`pack`) as `PackedMatrix`es straight from the transposed
    views (packing lays the weights out anew anyway, so a contiguous copy first would be wasted)."""
    ndr = None if w.neg_decay_rate is None else w.neg_decay_rate.detach()

    def transposed(t) -> TransposedWeights:
        return TransposedWeights(t(w.fg_w), t(w.big_w), tuple(map(t, w.out_w)), tuple(map(t, w.layer_w)), ndr)

    if pack:
        try:
            return transposed(lambda m: PackedMatrix(m.detach().t()))
        except RuntimeError:  # as in `_pack`: fall back to the plain matmul
            pass
    return transposed(lambda m: m.detach().t().contiguous())


def _split_real(grad: torch.Tensor, real: Optional[torch.Tensor], padded: Optional[torch.Tensor]):
    """(gradient into the step, gradient passed straight to the carried input) for a masked step: the real
    rows' and the padded rows' gradient, zeros in the other rows; `padded` is ~real (made once a step).
    (One masked_fill each, one launch; unlike a multiplication by the mask it never turns an inf of one
    part into a NaN in the other. Also used by `triton_kernels.step_backward`.)"""
    if real is None:
        return grad, None
    shape = (-1, *([1] * (grad.dim() - 1)))
    return grad.masked_fill(padded.view(shape), 0.0), grad.masked_fill(real.view(shape), 0.0)


def _memory_write_backward_torch(memory_grad, memory, queries, read_grads, k, update, a, beta, memory_grad_out):
    """`memory_kernels.memory_write_backward` in torch ops (the reference for the kernel; the path on GPU):
    gradients through M' = a M + k update^T, update = beta (v - M^T k), and the reads M'^T q_l.
    Returns (d_update, d_k, d_a, layer 0's dq, d_error) and writes dL/dM into `memory_grad_out`."""
    heads, dk, dv = memory.shape
    # dL/dM' = incoming + sum over layers of q d_read^T
    dM = torch.addcmul(memory_grad, queries[0][:, :, None], read_grads[0][:, None, :], out=memory_grad_out)
    for q, r in zip(queries[1:], read_grads[1:]):
        dM.addcmul_(q[:, :, None], r[:, None, :])
    # layer 0's dq = M' d_read = a M d_read + k (update . d_read)
    Mr = torch.bmm(memory, read_grads[0][:, :, None])[:, :, 0]
    dq0 = torch.addcmul(a * Mr, k, (update * read_grads[0]).sum(-1, keepdim=True))
    d_update = torch.bmm(k[:, None], dM)[:, 0]  # dM^T k
    d_k = torch.bmm(update[:, None], dM.mT)[:, 0]  # dM update
    # <dM, M> per head, as row-by-row dot products (torch's batched dot products are several times slower)
    d_a = torch.bmm(dM.view(heads * dk, 1, dv), memory.reshape(heads * dk, dv, 1)).view(heads, dk).sum(-1)
    d_error = beta * d_update
    d_k -= torch.bmm(d_error[:, None], memory.mT)[:, 0]  # from M^T k in the error
    dM.mul_(a[:, :, None]).addcmul_(k[:, :, None], d_error[:, None, :], value=-1)  # dL/dM
    return d_update, d_k, d_a, dq0, d_error


def _memory_write_gradients(*arguments):
    """Gradients through the write and the reads of M' (`_memory_write_backward_torch`'s arguments and
    results) on the backend `memory_backend` picks: Triton kernels (CUDA), one C kernel (one head at a time,
    CPU), else torch ops (also when the C kernel refuses its arguments)."""
    memory, memory_grad = arguments[1], arguments[0]
    backend = memory_backend(memory, memory_grad)  # M first: on GPU nothing is ever compiled
    if backend == TRITON:
        return triton_memory_write_backward(*arguments)
    if backend == C_KERNELS:
        try:
            return memory_write_backward(*arguments)
        except KernelRefusal:
            pass
    return _memory_write_backward_torch(*arguments)


def _step_backward(
    saved: dict, grads: StepState, wt: TransposedWeights, s: Shapes, c: Columns, eps: float,
    weight_grads: "_WeightGrads", memory_grad_out: Optional[torch.Tensor] = None,
):  # fmt: skip
    """Gradients of a step's input state and token input from those of its outputs (the inverse of `_step`).

    `grads` holds dL/d(new p, new g, new key, new M); returns (dL/d(p, g, key, M) of the input state, dL/du).
    Every matmul's input and output gradient are written into this step's rows of `weight_grads`, which
    multiplies them for many steps at once; the output gradients are computed straight into those rows.
    dL/dM is written into `memory_grad_out` when given (it must not be `grads.memory`)."""
    B, H, dk, dv = s.batch, s.heads, s.key_dim, s.value_dim
    real = saved.get("real")
    padded = None if real is None else ~real
    d_state, dp_pass = _split_real(grads.p, real, padded)
    d_grounded, dg_pass = _split_real(grads.g, real, padded)
    big_x, dZ = weight_grads.rows("big")
    d_read_of = []  # per layer: dL/d read (BH, dv)
    for i in reversed(range(s.layers)):
        layer = saved["layers"][i]
        part = layer["part"]
        d_part = dZ[:, c.write :] if i == 0 else weight_grads.rows(("layer", i - 1))[1]
        # state' = sigmoid(gate) * state + Y,  Y = X W_out
        out_x, dY = weight_grads.rows(("out", i))
        # rebuild X = [silu(a) b | silu(read_gate) rms(read)] straight into the weight-gradient rows
        torch.mul(F.silu(part[:, c.ffn_a]), part[:, c.ffn_b], out=out_x[:, : s.inter])
        if s.memory:
            torch.mul(F.silu(part[:, c.read_gate]), layer["normed_read"], out=out_x[:, s.inter :])
        dY.copy_(d_state)
        dX = _mm(dY, wt.out_w[i])
        sig_gate = torch.sigmoid(part[:, c.gate])
        torch.mul(d_state * layer["state"], _sigmoid_grad(sig_gate), out=d_part[:, c.gate])
        d_state = d_state * sig_gate
        # through X = [silu(a) b | silu(read_gate) rms(read)] to the layer's projections
        ffn_a, ffn_b, d_hidden = part[:, c.ffn_a], part[:, c.ffn_b], dX[:, : s.inter]
        sig_a = torch.sigmoid(ffn_a)
        torch.mul(d_hidden * ffn_b, _silu_grad(ffn_a, sig_a), out=d_part[:, c.ffn_a])
        torch.mul(d_hidden, ffn_a * sig_a, out=d_part[:, c.ffn_b])
        if s.memory:
            read_gate, d_out, normed_read = part[:, c.read_gate], dX[:, s.inter :], layer["normed_read"]
            sig_rg = torch.sigmoid(read_gate)
            torch.mul(d_out * normed_read, _silu_grad(read_gate, sig_rg), out=d_part[:, c.read_gate])
            read_inv = _inv_rms(layer["read"], eps)
            d_read = _rms_backward(d_out * (read_gate * sig_rg), normed_read, read_inv).view(B * H, dv)
            # read = M'^T q (per head): dq = M' d_read; M' collects q d_read^T (below, with layer 0's dq;
            # the layers above need theirs now, for their input gradient)
            d_read_of.append(d_read)
            if i > 0:
                dq = torch.bmm(d_read[:, None], saved["new_memory"].mT)[:, 0]
                d_query = _l2_backward(dq, layer["q"], layer["q_inv"]).masked_fill_(layer["q_raw"] <= 0, 0)
                d_part[:, c.query].copy_(d_query.view(B, H * dk))
        if i > 0:  # the layer's projections came from a = rms(its input state)
            layer_x, d_part_rows = weight_grads.rows(("layer", i - 1))
            layer_x.copy_(layer["a"])
            d_a = _mm(d_part_rows, wt.layer_w[i - 1])
            d_state = d_state + _rms_backward(d_a, layer["a"], _inv_rms(layer["state"], eps))
    d_grounded = d_grounded + d_state
    d_read_of.reverse()

    if s.memory:
        d_new_key, dkey_pass = _split_real(grads.key, real, padded)
        d_new_memory, dM_pass = _split_real(grads.memory, real, padded)
        kq, update, decay_factor, sig_beta = saved["kq"], saved["update"], saved["decay_factor"], saved["sig_beta"]
        k, old = kq[:, 0], saved["old_memory"]
        dM = memory_grad_out.view(B * H, dk, dv) if memory_grad_out is not None else torch.empty_like(old)
        # every layer's query; layer 0's is kq[:, 1]
        queries = torch.stack([kq[:, 1]] + [saved["layers"][i]["q"] for i in range(1, s.layers)])
        d_update, d_k, d_decay_factor, dq0, d_error = _memory_write_gradients(
            d_new_memory.reshape(B * H, dk, dv), old, queries, torch.stack(d_read_of), k, update, decay_factor,
            sig_beta, dM,
        )  # fmt: skip
        d_gamma = (d_decay_factor * decay_factor[:, 0]).view(B, H)
        weight_grads.neg_decay += (d_gamma * saved["softplus_decay"]).sum(0)
        dZ[:, c.key].copy_(d_new_key)
        dZ[:, c.value].copy_(d_error.view(B, H * dv))
        d_sig_beta = (d_update * saved["error"]).sum(-1).view(B, H)
        torch.mul(d_sig_beta, _sigmoid_grad(sig_beta).view(B, H), out=dZ[:, c.beta])
        torch.mul(d_gamma * wt.neg_decay_rate, torch.sigmoid(saved["decay"]), out=dZ[:, c.decay])
        # the key (from g_{t-1}, a carried state) and layer 0's query went through one l2(relu(.))
        d_kq = _l2_backward(torch.stack([d_k, dq0], dim=1), kq, saved["kq_inv"]).masked_fill_(saved["kq_raw"] <= 0, 0)
        d_key = d_kq[:, 0].reshape(B, H * dk)
        d_part = dZ[:, c.write :]
        d_part[:, c.query].copy_(d_kq[:, 1].reshape(B, H * dk))
        dM = dM.view(B, H, dk, dv)
        if dkey_pass is not None:
            d_key = d_key + dkey_pass
            dM = dM + dM_pass
    else:
        d_key, dM = grads.key, grads.memory
    g_inv = _inv_rms(saved["grounded"], eps)
    a_g = torch.mul(saved["grounded"], g_inv, out=big_x)  # rms(g), the big matmul's input
    d_grounded = d_grounded + _rms_backward(_mm(dZ, wt.big_w), a_g, g_inv)
    # g = sigmoid(z_fg) * p + u,  z_fg = rms(p) W_fg + b_fg
    sig_fg, p = saved["sig_fg"], saved["p"]
    fg_x, d_z_fg = weight_grads.rows("fg")
    p_inv = _inv_rms(p, eps)
    a_p = torch.mul(p, p_inv, out=fg_x)
    torch.mul(d_grounded * p, _sigmoid_grad(sig_fg), out=d_z_fg)
    d_p = d_grounded * sig_fg + _rms_backward(_mm(d_z_fg, wt.fg_w), a_p, p_inv)
    weight_grads.next_step()
    if dp_pass is not None:
        d_p = d_p + dp_pass
    d_g = dg_pass if dg_pass is not None else torch.zeros_like(d_grounded)
    return StepState(d_p, d_g, d_key, dM), d_grounded


def _run_steps(
    U, mask, state: StepState, w, s, eps, start, stop, outputs=None, gammas=None, records=None, memory_buffer=None
):  # fmt: skip
    """Steps start..stop-1 without autograd; with `records` (a list) keep each step's saved values.

    `mask` is (B, T) bool or None; steps where every row is real run unmasked (no selects, no gradient
    splitting), which is every step of an unpadded batch. With `memory_buffer` (n, B, H, dk, dv) step j
    writes M' into slot j % n: n = 2 alternates two slots (the input M of a step must not be its output
    slot), n = stop - start keeps every M' of the run for its records."""
    c = columns_of(s)
    masked_steps = set() if mask is None else {t for t, full in enumerate(mask.all(0).tolist()) if not full}
    step = step_function(state, U[:, start], w, s) if stop > start else _step
    for t in range(start, stop):
        saved = {} if records is not None else None
        out = None if memory_buffer is None else memory_buffer[(t - start) % memory_buffer.shape[0]]
        state, gamma = step(state, U[:, t], mask[:, t] if t in masked_steps else None, w, s, c, eps, saved, out)
        if records is not None:
            records.append(saved)
        if outputs is not None:
            outputs[:, t] = state.p
        if gammas is not None and gamma is not None:
            gammas[:, t] = gamma
    return state


# --------------------------------------------------------------------------------------------------
# Reused buffers for M
# --------------------------------------------------------------------------------------------------


class BufferPool:
    """Scratch buffers for the memory M that training calls hand back and reuse (on CPU).

    A training call writes every M' of its last segment into one buffer (400 MB for the small preset at
    batch 8 x 256); a fresh one each call costs page faults on every page, 120-155 ms against 36-39 ms for
    the same writes into a reused buffer. A buffer is taken by one call and given back when that call's
    backward is done, so overlapping calls (two forwards, one backward) never share one; a call whose
    graph is dropped without backward simply never gives its buffer back. On CUDA the caching allocator
    already reuses memory, so the pool is not used there. `release()` frees what the pool holds."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def _key(shape, dtype, device) -> tuple:
        return tuple(shape), dtype, torch.device(device)

    def take(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """A buffer of this shape: a given-back one if there is one, else a new (uninitialised) one."""
        free = self.free.get(self._key(shape, dtype, device))
        return free.pop() if free else torch.empty(shape, dtype=dtype, device=device)

    def give_back(self, *buffers: Optional[torch.Tensor]) -> None:
        for buffer in buffers:
            if buffer is not None and buffer.device.type == "cpu":
                self.free.setdefault(self._key(buffer.shape, buffer.dtype, buffer.device), []).append(buffer)

    def release(self) -> None:
        self.free.clear()


def buffer_pool_of(model) -> BufferPool:
    """The model's `BufferPool` (created on first use; `model._gpn_buffer_pool.release()` empties it)."""
    pool = getattr(model, "_gpn_buffer_pool", None)
    if pool is None:
        pool = BufferPool()
        object.__setattr__(model, "_gpn_buffer_pool", pool)
    return pool


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
        s, eps, segment, truncation, pool, sweep = settings
        w = _unflatten(flat_weights, s)
        B, T, d = U.shape
        ctx.input_dtype, ctx.device_type = U.dtype, U.device.type
        ctx.triton_turned_off = triton_is_turned_off()  # (its combination failed the self-check: so must backward)
        U = U.float()
        ctx.sweep_owner = sweep.take() if sweep is not None else None
        if ctx.sweep_owner is not None:  # the steps on static buffers (CUDA graphs: `cuda_graphs.TrainingSweep`)
            sweep.load_weights(w)
            outputs, state, gammas, ctx.boundaries = sweep.forward(U, p0, g0, M0)
            ctx.settings, ctx.has_mask = settings, False
            ctx.save_for_backward(U, g0, *flat_weights)
            ctx.mark_non_differentiable(gammas)
            return outputs, state.p, state.g, state.memory, gammas
        outputs = U.new_empty(B, T, d)
        gammas = U.new_zeros(B, T, s.heads) if s.memory else U.new_zeros(B, T, 0)
        # the steps multiply by prepacked matrices where that is faster (`PackedMatrix`), packed once per call
        ctx.step_weights = step_weights = _pack(w) if PackedMatrix.worthwhile(w, B) else w
        key0 = key_from_grounded(g0, step_weights, s, eps) if s.memory else g0.new_zeros(B, 0)
        state = StepState(p0, g0, key0, M0)
        seg = segment or T
        # M' goes into reused buffers: two alternating slots while running, one slot per step of a segment
        # whose records are kept (the last one here; backward reuses the same slots for every segment)
        alternating = pool.take((2, *M0.shape), U.dtype, U.device) if s.memory else None
        segment_memory = pool.take((min(seg, T), *M0.shape), U.dtype, U.device) if s.memory else None
        boundaries, last_records = [], []
        for start in range(0, T, seg):
            if start > 0 and s.memory:  # the boundary must outlive the alternating slots
                state = state._replace(memory=state.memory.clone())
            boundaries.append(state)
            stop = min(start + seg, T)
            # the backward pass starts with the last segment: keep its records instead of recomputing them
            last = stop == T
            buffer = (segment_memory[: stop - start] if last else alternating) if s.memory else None
            state = _run_steps(U, mask, state, step_weights, s, eps, start, stop, outputs, gammas if s.memory else None,
                               last_records if last else None, buffer)  # fmt: skip
        ctx.settings = settings
        ctx.boundaries = boundaries
        ctx.last_records = last_records
        ctx.segment_memory = segment_memory
        ctx.has_mask = mask is not None
        ctx.save_for_backward(U, g0, *([mask] if mask is not None else []), *flat_weights)
        ctx.mark_non_differentiable(gammas)
        # the final M sits in a slot that backward reuses: hand out a copy
        final_memory = state.memory.clone() if s.memory else state.memory
        pool.give_back(alternating)
        return outputs, state.p, state.g, final_memory, gammas

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dP, dp_final, dg_final, dM_final, _dgamma):
        # a backward called inside an autocast region would otherwise run the step matmuls in its dtype; the
        # backward runs on the forward's backend and GPU (autograd may call it from another thread)
        turned_off = triton_turned_off() if ctx.triton_turned_off else contextlib.nullcontext()
        with autocast_off(ctx.device_type), turned_off, on_device(dP if dP is not None else ctx.saved_tensors[0]):
            return GPNRecurrenceFunction._backward(ctx, dP, dp_final, dg_final, dM_final)

    @staticmethod
    def _backward(ctx, dP, dp_final, dg_final, dM_final):
        if ctx.boundaries[0] is None:  # (freed by the first backward, with the records and buffers)
            raise RuntimeError(
                "GPN's fast recurrence frees what its forward saved while its backward runs, so it takes one "
                "backward per forward; for a second one (backward(retain_graph=True) twice, higher-order "
                "gradients) run the plain path: model.model.use_fast_path = False"
            )
        s, eps, segment, truncation, pool, sweep = ctx.settings
        saved = ctx.saved_tensors
        if ctx.sweep_owner is not None:
            U, g0, flat_weights = saved[0], saved[1], saved[2:]
            records_kept = sweep.owner is not None and sweep.owner() is ctx.sweep_owner
            sweep.owner = weakref.ref(ctx.sweep_owner)  # the buffers are this call's until it returns
            try:
                dU, dp0, dg0, dM0, weight_grads = sweep.backward(
                    U, g0, _unflatten(flat_weights, s), ctx.boundaries, records_kept, dP, dp_final, dg_final, dM_final
                )  # fmt: skip
            finally:
                sweep.release()
            return (dU.to(ctx.input_dtype), dp0, dg0, dM0, None, None, *weight_grads)
        U, g0 = saved[0], saved[1]
        if ctx.has_mask:
            mask, flat_weights = saved[2], saved[3:]
        else:
            mask, flat_weights = None, saved[2:]
        w = _unflatten(flat_weights, s)
        wt = transpose_weights(w, pack=PackedMatrix.worthwhile(w, U.shape[0]))
        step_weights, ctx.step_weights = ctx.step_weights, None
        B, T, d = U.shape
        first = ctx.boundaries[0]
        grad_or_zero = lambda g, like: g if g is not None else torch.zeros_like(like)  # noqa: E731
        grads = StepState(grad_or_zero(dp_final, first.p), grad_or_zero(dg_final, first.g),
                          torch.zeros_like(first.key), grad_or_zero(dM_final, first.memory))  # fmt: skip
        dU = torch.empty(B, T, d, dtype=torch.float32, device=U.device)
        weight_grads = _WeightGrads(w, B)
        c = columns_of(s)
        memory_grads = U.new_empty(2, *first.memory.shape) if s.memory else None  # alternating dL/dM slots
        seg = segment or T
        step_backward = step_backward_function(U)
        for index in reversed(range(len(ctx.boundaries))):
            start = index * seg
            stop = min(start + seg, T)
            if stop == T:
                records, ctx.last_records = ctx.last_records, None
            else:  # recompute the segment from its boundary, keeping what the backward steps need
                records = []
                buffer = None if ctx.segment_memory is None else ctx.segment_memory[: stop - start]
                _run_steps(U, mask, ctx.boundaries[index], step_weights, s, eps, start, stop, records=records,
                           memory_buffer=buffer)  # fmt: skip
            ctx.boundaries[index] = None
            for t in reversed(range(start, stop)):
                record = records.pop()
                if dP is not None:
                    grads = grads._replace(p=grads.p + dP[:, t])
                out = None if memory_grads is None else memory_grads[t % 2]
                grads, dU[:, t] = step_backward(record, grads, wt, s, c, eps, weight_grads, out)
                if truncation and t % truncation == 0 and t > 0:
                    # the state is cut here, the weights are not: the key of step t (from g_{t-1}) still
                    # contributes to the key projection's gradient, but nothing flows into g_{t-1}
                    if s.memory:
                        weight_grads.add_key(_unit_rms(record["g"], eps), grads.key)
                    grads = StepState(*(torch.zeros_like(x) for x in grads))
        d_g0 = first_key_gradient(grads, g0, w, s, eps, weight_grads)
        pool.give_back(ctx.segment_memory)  # every record that pointed into it is gone
        ctx.segment_memory = None
        return (dU.to(ctx.input_dtype), grads.p, d_g0, grads.memory, None, None, *weight_grads.finish())


def first_key_gradient(grads: StepState, g0: torch.Tensor, w: FoldedWeights, s: Shapes, eps: float,
                       weight_grads: "_WeightGrads") -> torch.Tensor:
    """dL/dg0 at the end of a backward sweep: the carried g gradient plus, with memory, what flows back
    through the first step's key, which was computed from g0 (`key_from_grounded`); adds that key's share
    of the key projection's weight gradient. Shared by `GPNRecurrenceFunction` and the training graphs."""
    if not s.memory:
        return grads.g
    a_g0 = _unit_rms(g0, eps)
    key_rows = w.big_w[:, : s.heads * s.key_dim].detach().t()  # W_k^T, used once
    weight_grads.add_key(a_g0, grads.key)
    return grads.g + _rms_backward(_mm(grads.key, key_rows), a_g0, _inv_rms(g0, eps))


class _WeightGrads:
    """Weight gradients of the step matmuls, as one large x^T dy matmul per matrix over many steps.

    Every step writes each matmul's input x and output gradient dy into its own rows of a block
    (`rows`); once the block holds `WEIGHT_GRAD_ROWS` rows (or at the end) every matrix gets
    x_block^T dy_block, instead of one thin per-step product (as cuDNN-style RNN backward passes do)."""

    def __init__(self, w: FoldedWeights, batch: int, steps_per_block: Optional[int] = None):
        self.w = w
        zeros = lambda ref: torch.zeros(ref.shape, dtype=torch.float32, device=ref.device)  # noqa: E731
        self.grads = {"fg": zeros(w.fg_w), "big": zeros(w.big_w)}
        self.bias_grads = {"fg": zeros(w.fg_b), "big": zeros(w.big_b)}
        for i, o in enumerate(w.out_w):
            self.grads[("out", i)] = zeros(o)
        for i, (lw, lb) in enumerate(zip(w.layer_w, w.layer_b)):
            self.grads[("layer", i)] = zeros(lw)
            self.bias_grads[("layer", i)] = zeros(lb)
        self.neg_decay = zeros(w.neg_decay_rate) if w.neg_decay_rate is not None else None
        self.batch = batch
        self.steps_per_block = steps_per_block or max(1, WEIGHT_GRAD_ROWS // batch)
        empty = lambda n: torch.empty(self.steps_per_block * batch, n, dtype=torch.float32, device=w.fg_w.device)  # noqa: E731
        self.blocks = {name: (empty(g.shape[0]), empty(g.shape[1])) for name, g in self.grads.items()}
        self.step = 0

    def rows(self, name) -> tuple[torch.Tensor, torch.Tensor]:
        """(x rows, dy rows) of matrix `name` ("fg", "big", ("out", i), ("layer", i)) for the current step."""
        x, dy = self.blocks[name]
        rows = slice(self.step * self.batch, (self.step + 1) * self.batch)
        return x[rows], dy[rows]

    def next_step(self) -> None:
        self.step += 1
        if self.step == self.steps_per_block:
            self.flush()

    def add_key(self, a_g: torch.Tensor, dkey: torch.Tensor) -> None:
        """Weight gradient of a key computed from a grounded state outside the chain (g0, or a cut)."""
        width = dkey.shape[1]
        self.grads["big"][:, :width] += _tmm(a_g, dkey, self.w.big_w.dtype)
        self.bias_grads["big"][:width] += dkey.sum(0)

    def flush(self) -> None:
        """Add the collected rows' x^T dy (and dy's column sums) to every gradient; empty the block."""
        n = self.step * self.batch
        self.step = 0
        if n == 0:
            return
        for name, (x, dy) in self.blocks.items():
            self._accumulate(name, x[:n], dy[:n])

    def _accumulate(self, name, x: torch.Tensor, dy: torch.Tensor) -> None:
        self.grads[name] += _tmm(x, dy, self.w.big_w.dtype)
        if name in self.bias_grads:
            self.bias_grads[name] += dy.sum(0)

    def finish(self) -> list:
        """The gradients in `_flatten`'s order, in the weights' dtypes."""
        self.flush()
        w, g, b = self.w, self.grads, self.bias_grads
        layers = range(len(w.layer_w))
        grads = [g["fg"].to(w.fg_w.dtype), b["fg"], g["big"].to(w.big_w.dtype), b["big"]]
        grads += [g[("out", i)].to(o.dtype) for i, o in enumerate(w.out_w)]
        grads += [g[("layer", i)].to(w.layer_w[i].dtype) for i in layers]
        grads += [b[("layer", i)] for i in layers]
        if w.neg_decay_rate is not None:
            grads.append(self.neg_decay)
        return grads


class StaticWeightGrads(_WeightGrads):
    """`_WeightGrads` whose block sums allocate nothing: each matrix's x^T dy goes into a product buffer
    of its own (with copies of x and dy in the weights' dtype first where that is not float32, as `_tmm`
    casts them) and is then added in place, each bias sum likewise; the gradients are then static buffers,
    zeroed by `zero()` before each backward pass. What the backward steps of a captured training graph
    (`cuda_graphs.TrainingSweep`) accumulate into: the graph flushes the block at the end of each chunk."""

    def __init__(self, w: FoldedWeights, batch: int, steps_per_block: int):
        super().__init__(w, batch, steps_per_block)
        dtype = w.big_w.dtype
        like = lambda ref, dt: torch.empty(ref.shape, dtype=dt, device=ref.device)  # noqa: E731
        self.products = {name: like(g, dtype) for name, g in self.grads.items()}
        self.bias_sums = {name: like(b, torch.float32) for name, b in self.bias_grads.items()}
        self.cast_blocks = None
        if dtype != torch.float32:
            self.cast_blocks = {name: (like(x, dtype), like(dy, dtype)) for name, (x, dy) in self.blocks.items()}

    def zero(self) -> None:
        for tensor in (*self.grads.values(), *self.bias_grads.values()):
            tensor.zero_()
        if self.neg_decay is not None:
            self.neg_decay.zero_()
        self.step = 0

    def _accumulate(self, name, x: torch.Tensor, dy: torch.Tensor) -> None:
        n = x.shape[0]
        x_rows, dy_rows = x, dy
        if self.cast_blocks is not None:
            x_cast, dy_cast = self.cast_blocks[name]
            x_rows, dy_rows = x_cast[:n].copy_(x), dy_cast[:n].copy_(dy)
        self.grads[name].add_(torch.mm(x_rows.t(), dy_rows, out=self.products[name]))
        if name in self.bias_grads:
            self.bias_grads[name].add_(torch.sum(dy, 0, out=self.bias_sums[name]))

    def finish(self) -> list:
        """As `_WeightGrads.finish`, as fresh tensors (the static buffers are overwritten by the next call)."""
        statics = {t.data_ptr() for t in (*self.grads.values(), *self.bias_grads.values())}
        if self.neg_decay is not None:
            statics.add(self.neg_decay.data_ptr())
        return [g.clone() if g.data_ptr() in statics else g for g in super().finish()]


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


def autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast multiplies in on this device type, or None where autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know: no autocast there
        pass
    return None


def autocast_off(device_type: str):
    """A context with autocast off on this device type (nothing to do where it is off already)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


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
    returned without gradient. Under `torch.autocast` the step matrices multiply in the autocast dtype
    and everything else stays float32, as in the plain loop (see the module docstring).
    """
    device_type = token_inputs.device.type
    matmul_dtype = autocast_dtype(device_type)
    with autocast_off(device_type), on_device(token_inputs):  # (launches and captures on the inputs' GPU)
        return _fast_recurrence(model, token_inputs, state, mask, output_memory_decays, matmul_dtype)


def _fast_recurrence(model, token_inputs, state, mask, output_memory_decays: bool, matmul_dtype):
    config = model.config
    B, T, _ = token_inputs.shape
    s = shapes_of(model, B)
    eps = config.rms_norm_eps
    p0, g0, M0 = (x.float().contiguous() for x in state)
    if mask is not None:
        mask = mask.bool()
    if triton_selected(token_inputs):  # the kernels are checked against the torch ops once per device and sizes
        step_dtype = matmul_dtype or model.fuse_gate.weight.dtype
        if triton_self_check_needed(s, step_dtype, token_inputs.device):
            with torch.no_grad():
                w = cached_folded_weights(model, rows=B, matmul_dtype=matmul_dtype)
                triton_self_check(w, s, eps, token_inputs.device, step_dtype)
        if not triton_self_check_passed(s, step_dtype, token_inputs.device):  # (off for these sizes and dtype only)
            with triton_turned_off():
                return _fast_recurrence(model, token_inputs, state, mask, output_memory_decays, matmul_dtype)
    needs_grad = torch.is_grad_enabled() and (
        token_inputs.requires_grad or any(x.requires_grad for x in state) or any(q.requires_grad for q in model.parameters())
    )
    if not needs_grad:
        # CUDA graphs (decoding: one replay a token); their captured weights are the model's own dtype, so
        # not under autocast
        if mask is None and matmul_dtype is None and graph_wanted(model, token_inputs):
            with torch.no_grad():
                return graph_window_forward(model, token_inputs.float(), (p0, g0, M0), output_memory_decays)
        with torch.no_grad():
            w = cached_folded_weights(model, rows=B, matmul_dtype=matmul_dtype)
            outputs = torch.empty(B, T, s.hidden, dtype=torch.float32, device=token_inputs.device)
            gammas = torch.zeros(B, T, s.heads, device=token_inputs.device) if (s.memory and output_memory_decays) else None
            key0 = key_from_grounded(g0, w, s, eps) if s.memory else g0.new_zeros(B, 0)
            # M' alternates between two slots; a window of one token (decoding) writes a fresh tensor
            alternating = M0.new_empty(2, *M0.shape) if (s.memory and T > 1) else None
            final = _run_steps(token_inputs.float(), mask, StepState(p0, g0, key0, M0), w, s, eps, 0, T, outputs,
                               gammas, memory_buffer=alternating)  # fmt: skip
        return outputs, (final.p, final.g, final.memory), gammas
    w = in_matmul_dtype(fold_weights(model), matmul_dtype)
    sweep = None  # CUDA graphs for the training steps (opt-in; unmasked windows without truncation)
    if mask is None and not config.bptt_truncation_length and graph_wanted(model, token_inputs, training=True):
        # (its segments as the window's when set, else `cuda_graphs.SWEEP_SEGMENT_LENGTH`: a sweep holds one
        # segment's memories, never the whole window's)
        sweep = training_sweep(model, B, config.bptt_segment_length, T, w, token_inputs.device)
    settings = (s, eps, config.bptt_segment_length, config.bptt_truncation_length, buffer_pool_of(model), sweep)
    outputs, p, g, memory, gammas = GPNRecurrenceFunction.apply(token_inputs, p0, g0, M0, mask, settings, *_flatten(w))
    return outputs, (p, g, memory), (gammas if (s.memory and output_memory_decays) else None)


# --------------------------------------------------------------------------------------------------
# Chunked loss: the cross-entropy of the tied decoder without materialising batch x length x vocab logits
# --------------------------------------------------------------------------------------------------


class ChunkedTiedCrossEntropy(torch.autograd.Function):
    """Sum of cross-entropies of logits = h E^T over rows, computed in chunks.

    h (N, e), E (V, e), targets (N,) with -100 ignored. The logits of at most `chunk` rows exist at any
    time. Logits are float32 as in the plain loss (which upcasts them). With `with_grads` (training) the
    gradients for h and E are computed in the same pass over each chunk, while its logits are at hand
    (the loss is a scalar, so backward only scales them): three matmuls per chunk instead of four, since
    backward would otherwise recompute the logits. Without it only one log-sum-exp per row is kept.
    """

    @staticmethod
    def forward(ctx, h, E, targets, chunk: int, with_grads: bool):
        N = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        valid = targets != -100
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device) if with_grads else None
        dE = torch.zeros(E.shape, dtype=torch.float32, device=E.device) if with_grads else None
        for start in range(0, N, chunk):
            rows = slice(start, start + chunk)
            logits = torch.matmul(h[rows], E.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[rows, None])[:, 0]
            total += ((lse - picked) * valid[rows]).sum()
            if with_grads:  # d total / d logits = softmax - onehot on counted rows
                probs = logits.sub_(lse[:, None]).exp_()
                probs.scatter_add_(1, safe[rows, None], -torch.ones_like(probs[:, :1]))
                probs *= valid[rows, None]
                g = probs.to(E.dtype)
                dh[rows] = torch.matmul(g, E).float()
                dE += torch.matmul(g.t(), h[rows]).float()
        ctx.save_for_backward(dh, dE)
        ctx.h_dtype, ctx.E_dtype = h.dtype, E.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dh, dE = ctx.saved_tensors
        if dh is None:
            raise RuntimeError("ChunkedTiedCrossEntropy was called with with_grads=False: it has no gradients")
        return (
            (dh * grad_total).to(ctx.h_dtype) if ctx.needs_input_grad[0] else None,
            (dE * grad_total).to(ctx.E_dtype) if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )


def chunked_causal_lm_loss(
    decoded: torch.Tensor, embedding: torch.Tensor, labels: Optional[torch.Tensor], chunk_rows: Optional[int] = None,
    shift_labels: Optional[torch.Tensor] = None, num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Shifted cross-entropy of logits = decoded E^T (decoded (B, T, e), labels (B, T), -100 ignored): position
    t against `labels[:, t + 1]` (or `shift_labels[:, t]` when given); the mean, or the sum divided by
    `num_items_in_batch` when given (transformers' exact gradient accumulation).

    Equals `F.cross_entropy(logits[:, :-1].float(), labels[:, 1:])` without holding the (B, T, V) logits.
    """
    V, e = embedding.shape
    if chunk_rows is None:
        chunk_rows = max(64, (1 << 20) // V)  # about 4 MB of float32 logits: the chunk stays in cache
    rows, targets = (decoded, shift_labels) if shift_labels is not None else (decoded[:, :-1], labels[:, 1:])
    h = rows.reshape(-1, e).to(embedding.dtype)
    targets = targets.reshape(-1).to(decoded.device)
    with_grads = torch.is_grad_enabled() and (h.requires_grad or embedding.requires_grad)
    total = ChunkedTiedCrossEntropy.apply(h, embedding, targets, chunk_rows, with_grads)
    return divide_loss_sum(total, targets, num_items_in_batch)


def divide_loss_sum(total: torch.Tensor, targets: torch.Tensor, num_items_in_batch: torch.Tensor | int | None) -> torch.Tensor:
    """The summed loss over `num_items_in_batch` when given, else over this call's counted targets (the mean)."""
    if num_items_in_batch is None:
        return total / (targets != -100).sum()  # nan when nothing is counted, as F.cross_entropy
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
