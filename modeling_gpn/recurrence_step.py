"""One step of the GPN recurrence on folded weights, forward and backward, in torch ops: the fast path's
reference, and the contract every backend of it keeps (as `GPNModel.recurrence_plain` is the model's).

The fast path in layers (each file imports only the files below it; no backend imports another):
    fast_recurrence.py   the dispatcher: chooses the backends once per window, from its inputs, and runs it
    cuda_graphs.py       backend: windows of steps replayed as CUDA graphs (it is handed the step it replays)
    triton_kernels.py    backend: a whole step forward and backward in Triton kernels (GPU; `triton_jit.py`)
    memory_kernels.py    backend: the memory half of a step and its gradient in C kernels (CPU), and a whole
                         no-grad step of a few rows (`StepPlan`: this file's contract, on the modules' weights)
    recurrence_step.py   this file: folded weights, the step forward (`_step`) and backward (`_step_backward`)
The chunked loss (`chunked_loss.py`) sits beside them; the model imports only it and the dispatcher.

The contract (`_step` and `_step_backward` define it; `triton_kernels.step` / `step_backward` keep it whole,
the C kernels and Triton's memory kernels keep `MemoryOps`' part of it):

- Forward, `step(state, u, real, w, s, c, eps, saved=None, memory_out=None) -> (new state, gamma)`.
  `state` is a `StepState`: p and g (B, d), the key pre-activation W_k rms(g) + b_k (B, H*dk) that the
  next write uses, and M (B, H, dk, dv) (key and M (B, 0) without memory); u (B, d) is the token input;
  `real` (B,) bool or None says which rows are real (False: padding); `w` are the `FoldedWeights`, `s` the
  `Shapes`, `c` the `Columns`. Returns the new `StepState` and gamma (B, H) (None without memory). M' is
  written into `memory_out` when given (reused buffers; never the input M).
- The record: given `saved` (a dict), the step fills it with what its backward reads: p, g, sig_fg,
  grounded, `layers` (per predict layer: state and part; with memory read and normed_read; above layer 0
  also a, q_raw, q and q_inv), the `MemoryStep` fields, decay, old_memory and new_memory, and `real` for a
  masked step. Every backend leaves the same records with the same values, so any backward step reads any
  forward step's record.
- Backward, `step_backward(saved, grads, wt, s, c, eps, weight_grads, memory_grad_out=None) ->
  (gradients of the input state as a StepState, dL/du)` from `grads`, those of the new state. Each matmul's
  input and output gradient go into this step's rows of `weight_grads` (`_WeightGrads`), which multiplies
  them for many steps at once; dL/dM goes into `memory_grad_out` when given (never `grads.memory`).
- Guarantees: a padded row keeps its state exactly (`keep_padded_rows`) and its gradient passes by the
  step to the carried input (`_split_real`), so nothing of a padded row reaches u or the weights. The
  state, M, the records and every elementwise op are float32 whatever the weights' dtype: the matmuls run
  in the step matrices' dtype with float32 results. Under autocast the dispatcher casts the step matrices
  to the autocast dtype once and runs the steps with autocast off, so the state stays float32 there too.
  The state, the carried gradients and the records a step makes are contiguous float32 tensors (what lets
  the dispatcher choose a backend once per window from the window's inputs).
- The memory half (the write of M' and layer 0's read, and their gradient) is a parameter of both steps,
  `memory_ops` (a `MemoryOps`, the torch ops here by default), so a backend that accelerates only that part
  plugs in from above without this file importing it.

This file ships to the Hub with the model: it imports only torch, typing and the standard library.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

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
    neg_decay_rate: torch.Tensor | None  # -exp(A_log) (H,), float32


class Shapes(NamedTuple):
    """The sizes of a step: batch rows, widths, heads, layers and whether the model has a memory."""

    batch: int
    hidden: int
    inter: int
    heads: int
    key_dim: int
    value_dim: int
    layers: int
    memory: bool


class Int8Weight(NamedTuple):
    """The parts of a torchao int8 weight-only weight: W = qdata * scale (one scale per output row)."""

    qdata: torch.Tensor  # (out, in) int8
    scale: torch.Tensor  # (out,) float32
    dtype: torch.dtype  # the dtype the module computes in (its inputs are cast to it): float32 or bfloat16


_int8_checked: dict = {}  # id(weight) -> (weak reference to it, what was checked, result); dropped with the weight


def int8_weight_parts(weight: torch.Tensor) -> Int8Weight | None:
    """The parts of `weight` if it is exactly what the fast path takes of a quantized weight, else None.

    Exactly torchao's `Int8Tensor` made by `Int8WeightOnlyConfig` (that class, not a subclass; named, not
    imported: torchao stays optional): a weight-only (no activation quantization, no pre-scale), symmetric
    (zero points all 0), per-output-row (block (1, in)) int8 matrix on the CPU, with float32 or bfloat16
    as its dtype. Anything else quantized is not recognised here, so the model's eligibility check
    (`GPNModel.fast_path_blocker`) keeps it on the plain path, which calls the module."""
    kind = type(weight)
    if kind.__qualname__ != "Int8Tensor" or not kind.__module__.startswith("torchao."):
        return None
    # (this runs before every fast call, decoding too: the attributes are read without torchao's
    # __torch_function__, and a weight already checked is checked again only if what it holds changed)
    held = weight.__dict__
    stamp = tuple((id(held.get(name)), getattr(held.get(name), "_version", None)) for name in _INT8_PARTS)
    checked = _int8_checked.get(id(weight))
    if checked is not None and checked[0]() is weight and checked[1] == stamp:
        return checked[2]
    with torch._C.DisableTorchFunctionSubclass():
        parts = _int8_parts(weight, held)
    key = id(weight)
    _int8_checked[key] = (weakref.ref(weight, lambda _, key=key: _int8_checked.pop(key, None)), stamp, parts)
    return parts


_INT8_PARTS = ("qdata", "scale", "zero_point", "block_size", "act_quant_kwargs", "act_pre_scale", "act_quant_scale")


def _int8_parts(weight: torch.Tensor, held: dict) -> Int8Weight | None:
    qdata, scale = held.get("qdata"), held.get("scale")
    if not (isinstance(qdata, torch.Tensor) and isinstance(scale, torch.Tensor)):
        return None
    if qdata.dtype != torch.int8 or qdata.dim() != 2 or qdata.device.type != "cpu" or scale.dtype != torch.float32:
        return None
    rows, cols = qdata.shape
    if scale.numel() != rows or scale.shape not in ((rows,), (rows, 1)):
        return None
    if list(held.get("block_size", ())) != [1, cols] or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if any(held.get(name) is not None for name in ("act_quant_kwargs", "act_pre_scale", "act_quant_scale")):
        return None
    zero_point = held.get("zero_point")
    if zero_point is not None and (not isinstance(zero_point, torch.Tensor) or zero_point.any()):
        return None
    return Int8Weight(qdata, scale.reshape(rows), weight.dtype)


def dequantized_by_linear(weight: torch.Tensor) -> bool:
    """Whether `weight` is exactly a torchao weight-only low-bit weight whose linear multiplies by its dequantized
    matrix: `IntxUnpackedToInt8Tensor` made by `IntxWeightOnlyConfig` (int1 to int8 values, e.g. int4, per group
    or per row, with or without zero points; that class, not a subclass; named, not imported: torchao stays
    optional), without activation quantization, in float32 or bfloat16. Its `F.linear(x, W)` is
    `F.linear(x, W.dequantize())`: the fast path multiplies that same matrix, dequantized once where it derives its
    weights (a scope: one forward or generate() call, `derived_weights.py`), as it multiplies a float model's
    weights; its C kernels multiply int4 values as int4 instead where they take them (`int4_weight_parts`). Anything
    else quantized keeps the plain path (`GPNModel.fast_path_blocker`)."""
    kind = type(weight)
    if kind.__qualname__ != "IntxUnpackedToInt8Tensor" or not kind.__module__.startswith("torchao."):
        return False
    held = weight.__dict__
    qdata = held.get("qdata")
    return (
        held.get("activation_quantization") is None
        and isinstance(qdata, torch.Tensor)
        and qdata.dtype == torch.int8
        and qdata.dim() == 2
        and weight.dtype in (torch.float32, torch.bfloat16)
    )


class Int4Weight(NamedTuple):
    """The parts of a torchao int4 weight-only weight (`IntxUnpackedToInt8Tensor` of int4 values): W = (qdata -
    zero_point) * scale per group of `group` weights of a row, what its `dequantize()` computes."""

    qdata: torch.Tensor  # (out, in) int8, int4 values (in [-8, 7] unless edited: the packing checks)
    scale: torch.Tensor  # (out, in / group) float32 or bfloat16
    zero_point: torch.Tensor | None  # (out, in / group) int8, or None
    group: int
    dtype: torch.dtype  # the dtype the module computes in: float32 or bfloat16


# a group's weights the C kernels' int4 layout takes: a multiple of the first, at most the second (the C source's
# INT4_MAX_GROUP, which keeps a group's integer sum within int32)
INT4_GROUPS = (8, 4096)


def int4_weight_parts(weight: torch.Tensor) -> Int4Weight | None:
    """The parts of `weight` if it is a low-bit weight its linear dequantizes (`dequantized_by_linear`) holding int4
    values on the CPU in groups along its rows (block (1, group)) of a size the C kernels' int4 layout takes
    (`INT4_GROUPS`: a multiple of 8 weights, at most 4,096), with scales and zero points of the shapes those groups
    make; else None (other bit widths, per-column blocks, groups of other sizes keep the dequantized matrix). The
    values themselves are checked where they are packed (`memory_kernels.int4_pack`)."""
    if not dequantized_by_linear(weight):
        return None
    held = weight.__dict__
    qdata, scale, zero_point = held.get("qdata"), held.get("scale"), held.get("zero_point")
    if held.get("target_dtype") is not torch.int4 or qdata.device.type != "cpu" or not isinstance(scale, torch.Tensor):
        return None
    rows, cols = qdata.shape
    block = tuple(held.get("block_size", ()))
    if len(block) != 2 or block[0] != 1:
        return None
    group = block[1]
    if not (group % INT4_GROUPS[0] == 0 and 0 < group <= INT4_GROUPS[1] and cols % group == 0):
        return None
    groups = (rows, cols // group)
    if scale.shape != groups or scale.dtype not in (torch.float32, torch.bfloat16) or scale.device.type != "cpu":
        return None
    if zero_point is not None and (
        not isinstance(zero_point, torch.Tensor) or zero_point.shape != groups or zero_point.dtype != torch.int8
    ):
        return None
    return Int4Weight(qdata, scale, zero_point, group, weight.dtype)


def dense_weight(linear: torch.nn.Linear) -> torch.Tensor:
    """The (out, in) weight of `linear` as a plain tensor: its weight, an int8 weight dequantized (qdata * scale,
    in the module's dtype), or a low-bit weight dequantized as its linear does (`dequantized_by_linear`), for the
    torch-ops steps, which multiply plain matrices."""
    weight = linear.weight
    if dequantized_by_linear(weight):
        return weight.dequantize()
    parts = int8_weight_parts(weight)
    if parts is None:
        return weight
    return (parts.qdata.float() * parts.scale[:, None]).to(parts.dtype)


def _fold(linear: torch.nn.Linear, norm_weight: torch.Tensor) -> torch.Tensor:
    """(in, out) matrix W^T * n[:, None], computed in float32, returned in the weights' dtype."""
    weight = dense_weight(linear)
    return (weight.float().t() * norm_weight.float()[:, None]).to(weight.dtype)


def _bias(linear: torch.nn.Linear, size: int, device: torch.device) -> torch.Tensor:
    if linear is not None and linear.bias is not None:
        return linear.bias.float()
    return torch.zeros(size, device=device, dtype=torch.float32)


def _layer_columns(layer: torch.nn.Module, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    weights = [_fold(layer.gate, layer.gate_norm.weight), _fold(layer.ffn_in, layer.ffn_norm.weight)]
    biases = [_bias(layer.gate, 0, device), _bias(None, layer.ffn_in.weight.shape[0], device)]
    if layer.use_memory:
        weights += [_fold(layer.read_query, layer.read_norm.weight), _fold(layer.read_gate, layer.read_norm.weight)]
        biases += [_bias(layer.read_query, 0, device), _bias(None, layer.read_gate.weight.shape[0], device)]
    return weights, biases


def _out_matrix(layer: torch.nn.Module) -> torch.Tensor:
    ffn_out = dense_weight(layer.ffn_out).t()
    if not layer.use_memory:
        return ffn_out
    read_out = _fold(layer.read_out, layer.read_out_norm.weight)
    return torch.cat([ffn_out, read_out], dim=0)


def fold_weights(model: torch.nn.Module) -> FoldedWeights:
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
    oneDNN's packed kernel splits the work better than MKL (the timings: benchmarks/RESULTS.md). Matrices are packed once per forward or generate() call for
    inference (`cached_folded_weights`) and once per call in training (a single pass over the weights)."""

    def __init__(self, matrix: torch.Tensor):
        self.matrix = matrix
        self.packed = torch.ops.mkldnn._reorder_linear_weight(matrix.t().contiguous(), None)

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x @ matrix, float32 result."""
        return torch.ops.mkldnn._linear_pointwise(x.to(self.matrix.dtype), self.packed, None, "none", [], "").float()

    @staticmethod
    def worthwhile(w: FoldedWeights, rows: int | None = None) -> bool:
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
            fg_w=PackedMatrix(w.fg_w),
            big_w=PackedMatrix(w.big_w),
            out_w=tuple(map(PackedMatrix, w.out_w)),
            layer_w=tuple(map(PackedMatrix, w.layer_w)),
        )
    except RuntimeError:  # a oneDNN build without these kernels: the plain bf16 matmul still works
        return w


def in_matmul_dtype(w: FoldedWeights, dtype: torch.dtype | None) -> FoldedWeights:
    """`w` with its step matrices in `dtype` (what autocast multiplies in; None: unchanged), cast as
    autocast casts (every floating dtype but float64). Biases and decay rates stay float32."""
    if dtype is None:
        return w
    cast = lambda m: m if m.dtype in (dtype, torch.float64) else m.to(dtype)
    return w._replace(
        fg_w=cast(w.fg_w), big_w=cast(w.big_w), out_w=tuple(map(cast, w.out_w)), layer_w=tuple(map(cast, w.layer_w))
    )


def cached_folded_weights(
    model: torch.nn.Module,
    rows: int | None = None,
    matmul_dtype: torch.dtype | None = None,
    variants: dict | None = None,
) -> FoldedWeights:
    """`fold_weights` for inference, with the step matrices in `matmul_dtype` (autocast's; None: the weights'
    own) and prepacked for oneDNN where that is faster for products of `rows` rows (`PackedMatrix.worthwhile`):
    bf16 on CPU always, fp32 for batches of 8+ rows on several threads. Each variant is made once in
    `variants` (a dict the caller keeps for as long as the parameters cannot have changed: the dispatcher
    keeps it for one forward or one generate() call, `derived_weights.py`; batch-1 decoding and batched
    scoring keep their variants side by side); without it, everything is derived afresh."""
    variants = {} if variants is None else variants
    if (None, False) not in variants:
        with torch.no_grad():
            variants[(None, False)] = fold_weights(model)
    if (matmul_dtype, False) not in variants:
        with torch.no_grad():
            variants[(matmul_dtype, False)] = in_matmul_dtype(variants[(None, False)], matmul_dtype)
    unpacked = variants[(matmul_dtype, False)]
    pack = PackedMatrix.worthwhile(unpacked, rows)
    if (matmul_dtype, pack) not in variants:
        with torch.no_grad():
            variants[(matmul_dtype, pack)] = _pack(unpacked)
    return variants[(matmul_dtype, pack)]


def shapes_of(model: torch.nn.Module, batch: int) -> Shapes:
    """The `Shapes` of `model`'s step at `batch` rows."""
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


STEP_MODULES = ("fuse_gate", "memory_write.", "predict_layers.")  # the parameters the step's products lay out
# model -> {parameter name: the shape its class makes for its config}, from the class built on the meta device
_made_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def made_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter of `model` as its own class makes it for its config (built once per model on the
    meta device, which allocates nothing: the modules' constructors stay the one place that says a shape)."""
    shapes = _made_shapes.get(model)
    if shapes is None:
        with torch.device("meta"):
            made = type(model)(model.config)
        shapes = _made_shapes[model] = {name: tuple(p.shape) for name, p in made.named_parameters()}
    return shapes


def misshapen_step_weight(model: torch.nn.Module) -> str | None:
    """What is wrong with the first parameter of the step's modules whose shape is not the one the config makes (a
    weight replaced by one of another shape: `layer.ffn_in.weight = nn.Parameter(...)`), or None. The folded
    matrices and the C step kernels lay the products side by side at the columns the config's sizes give, so such a
    weight would shift its neighbours in silence, where the plain loop fails on the shapes."""
    expected = made_shapes(model)
    for name, parameter in model.named_parameters():
        shape = expected.get(name) if name.startswith(STEP_MODULES) else None
        if shape is not None and tuple(parameter.shape) != shape:
            return (
                f"{name} has shape {tuple(parameter.shape)} but the config makes it {shape}: a weight replaced by "
                "one of another shape (change the config, and build the model again, to change a size)"
            )
    return None


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


def _mm(x: torch.Tensor, w: torch.Tensor | PackedMatrix) -> torch.Tensor:
    """x @ w in the weights' dtype, float32 result (w a matrix or a `PackedMatrix`)."""
    if isinstance(w, PackedMatrix):
        return w.mm(x)
    if w.dtype == torch.float32:
        return torch.matmul(x, w)
    return torch.matmul(x.to(w.dtype), w).float()


def _linear(x: torch.Tensor, w: torch.Tensor | PackedMatrix, b: torch.Tensor) -> torch.Tensor:
    """x @ w + b in the weights' dtype, float32 result. (Not addmm: it first copies the broadcast bias into
    its output, a pass that costs more than adding the bias in place afterwards.)"""
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
    """Where each projection's columns lie in the fused matrices of sizes `s`."""
    H, dk, dv, d, f = s.heads, s.key_dim, s.value_dim, s.hidden, s.inter
    kw, vw = H * dk, H * dv
    return Columns(
        write=kw + vw + 2 * H,
        key=slice(0, kw),
        value=slice(kw, kw + vw),
        beta=slice(kw + vw, kw + vw + H),
        decay=slice(kw + vw + H, kw + vw + 2 * H),
        gate=slice(0, d),
        ffn_a=slice(d, d + f),
        ffn_b=slice(d + f, d + 2 * f),
        query=slice(d + 2 * f, d + 2 * f + kw),
        read_gate=slice(d + 2 * f + kw, d + 2 * f + kw + vw),
    )


# --------------------------------------------------------------------------------------------------
# The carried state
# --------------------------------------------------------------------------------------------------


class StepState(NamedTuple):
    """The carried state on the fast path: p, g, the key pre-activation computed from g, and M."""

    p: torch.Tensor  # (B, d)
    g: torch.Tensor  # (B, d)
    key: torch.Tensor  # (B, H*dk), or (B, 0) without memory
    memory: torch.Tensor  # (B, H, dk, dv), or (B, 0) without memory


# --------------------------------------------------------------------------------------------------
# The memory half of a step and its gradient (the part the C kernels and Triton's memory kernels replace)
# --------------------------------------------------------------------------------------------------


class MemoryStep(NamedTuple):
    """What the memory half of a step computes (`MemoryOps.step`; the names of `_step`'s records)."""

    kq_raw: torch.Tensor  # (BH, 2, dk): relu of the key and of layer 0's query
    kq: torch.Tensor  # (BH, 2, dk): their l2-normalised values
    kq_inv: torch.Tensor  # (BH, 2, 1): the l2 scales
    softplus_decay: torch.Tensor  # (B, H)
    gamma: torch.Tensor  # (B, H): -exp(A_log) softplus(decay)
    decay_factor: torch.Tensor  # (BH, 1): exp(gamma)
    sig_beta: torch.Tensor  # (BH, 1)
    error: torch.Tensor  # (BH, dv)
    update: torch.Tensor  # (BH, dv)
    read: torch.Tensor  # (B, H*dv): layer 0's read M'^T q
    normed_read: torch.Tensor  # (B, H*dv): rms(read) (unit weight)


def _memory_step_torch(
    Z: torch.Tensor,
    c: Columns,
    key: torch.Tensor,
    neg_decay_rate: torch.Tensor,
    memory: torch.Tensor,
    memory_out: torch.Tensor,
    eps: float,
) -> MemoryStep:
    """The memory half of a step in torch ops (the reference for `memory_kernels.memory_step` and
    `triton_kernels.memory_step`; the path under torch.compile and where neither runs): from Z and the
    carried key, write M' into `memory_out` and read it with layer 0's query.

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
    return MemoryStep(
        kq_raw, kq, kq_inv, softplus_decay, gamma, decay_factor, sig_beta, error, update, read, _unit_rms(read, eps)
    )


def _memory_write_backward_torch(
    memory_grad: torch.Tensor,
    memory: torch.Tensor,
    queries: torch.Tensor,
    read_grads: torch.Tensor,
    k: torch.Tensor,
    update: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    memory_grad_out: torch.Tensor | None,
):
    """The gradient of the memory half in torch ops (the reference for `memory_kernels.memory_write_backward`
    and `triton_kernels.memory_write_backward`):
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


class MemoryOps(NamedTuple):
    """The memory half of a step and its gradient, as a backend implements them: `step` has
    `_memory_step_torch`'s arguments and results, `write_backward` `_memory_write_backward_torch`'s. The
    dispatcher (`fast_recurrence`) passes the one it chose for a window to `_step` / `_step_backward`."""

    step: Callable[..., MemoryStep]
    write_backward: Callable[..., tuple]


TORCH_MEMORY_OPS = MemoryOps(_memory_step_torch, _memory_write_backward_torch)


# --------------------------------------------------------------------------------------------------
# One step forward (optionally keeping what its backward needs)
# --------------------------------------------------------------------------------------------------


def _predict_layer(
    state: torch.Tensor,
    part: torch.Tensor,
    memory_flat: torch.Tensor | None,
    read: torch.Tensor | None,
    normed_read: torch.Tensor | None,
    s: Shapes,
    c: Columns,
    eps: float,
    out_w: torch.Tensor | PackedMatrix,
    record: dict | None,
):
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


def write_memory(
    Z: torch.Tensor,
    key: torch.Tensor,
    memory: torch.Tensor,
    memory_out: torch.Tensor,
    w: FoldedWeights,
    s: Shapes,
    c: Columns,
    eps: float,
    saved: dict | None,
    memory_half: Callable[..., MemoryStep],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The memory half of a step from its big projection Z: M' (into `memory_out` when given) and layer 0's
    read through `memory_half` (a `MemoryOps.step`, or `triton_kernels.memory_step` on static buffers), with the
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
    state: StepState,
    u: torch.Tensor,
    real: torch.Tensor | None,
    w: FoldedWeights,
    s: Shapes,
    c: Columns,
    eps: float,
    saved: dict | None = None,
    memory_out: torch.Tensor | None = None,
    memory_ops: MemoryOps = TORCH_MEMORY_OPS,
):
    """One token on folded weights: state, u -> (new state, gamma). Fills `saved` for `_step_backward`
    (references to tensors the step computes anyway; what is cheap is recomputed there instead).
    Writes M' into `memory_out` when given (reused buffers: fresh 1.5 MB tensors every step cost page faults).
    The memory half runs on `memory_ops` (the torch ops unless the dispatcher passes a backend's).

    The equations are GPN.md's (see `GPNModel.step`), with the RMSNorm weights folded into the matrices:
        a_p = rms(p);  g = sigmoid(a_p W_fg + b_fg) * p + u;  a_g = rms(g);  Z = a_g W_big + b_big
        k = l2(relu(key));  M' = e^gamma M + k (beta (v - M^T k))^T;  key' = Z[key columns]
        state = g;  for each layer: state = sigmoid(gate) * state + [silu(a) b | silu(r) rms(M'^T q)] W_out
    """
    p, g, key, memory = state
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
        Z, key, memory, memory_out, w, s, c, eps, saved, memory_ops.step
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
        layer_state = _predict_layer(
            layer_state,
            part,
            memory_flat,
            read if first else None,
            normed_read if first else None,
            s,
            c,
            eps,
            w.out_w[i],
            record,
        )
    return keep_padded_rows(StepState(layer_state, grounded, new_key, new_memory), state, real, saved, s.memory), gamma


def keep_padded_rows(
    new: StepState, old: StepState, real: torch.Tensor | None, saved: dict | None, has_memory: bool
) -> StepState:
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
    neg_decay_rate: torch.Tensor | None  # as in FoldedWeights (not transposed; here for the decay gradient)


def transpose_weights(w: FoldedWeights, pack: bool = False) -> TransposedWeights:
    """The transposes as contiguous copies, or (`pack`) as `PackedMatrix`es straight from the transposed
    views (packing lays the weights out anew anyway, so a contiguous copy first would be wasted)."""
    ndr = None if w.neg_decay_rate is None else w.neg_decay_rate.detach()

    def transposed(t: torch.Tensor | PackedMatrix) -> TransposedWeights:
        return TransposedWeights(t(w.fg_w), t(w.big_w), tuple(map(t, w.out_w)), tuple(map(t, w.layer_w)), ndr)

    if pack:
        try:
            return transposed(lambda m: PackedMatrix(m.detach().t()))
        except RuntimeError:  # as in `_pack`: fall back to the plain matmul
            pass
    return transposed(lambda m: m.detach().t().contiguous())


def _split_real(grad: torch.Tensor, real: torch.Tensor | None, padded: torch.Tensor | None):
    """(gradient into the step, gradient passed straight to the carried input) for a masked step: the real
    rows' and the padded rows' gradient, zeros in the other rows; `padded` is ~real (made once a step).
    (One masked_fill each, one launch; unlike a multiplication by the mask it never turns an inf of one
    part into a NaN in the other. Also used by `triton_kernels.step_backward`.)"""
    if real is None:
        return grad, None
    shape = (-1, *([1] * (grad.dim() - 1)))
    return grad.masked_fill(padded.view(shape), 0.0), grad.masked_fill(real.view(shape), 0.0)


def _step_backward(
    saved: dict,
    grads: StepState,
    wt: TransposedWeights,
    s: Shapes,
    c: Columns,
    eps: float,
    weight_grads: _WeightGrads,
    memory_grad_out: torch.Tensor | None = None,
    memory_ops: MemoryOps = TORCH_MEMORY_OPS,
):
    """Gradients of a step's input state and token input from those of its outputs (the inverse of `_step`).

    `grads` holds dL/d(new p, new g, new key, new M); returns (dL/d(p, g, key, M) of the input state, dL/du).
    Every matmul's input and output gradient are written into this step's rows of `weight_grads`, which
    multiplies them for many steps at once; the output gradients are computed straight into those rows.
    dL/dM is written into `memory_grad_out` when given (it must not be `grads.memory`). The gradient of the
    memory half runs on `memory_ops` (the torch ops unless the dispatcher passes a backend's)."""
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
        d_update, d_k, d_decay_factor, dq0, d_error = memory_ops.write_backward(
            d_new_memory.reshape(B * H, dk, dv),
            old,
            queries,
            torch.stack(d_read_of),
            k,
            update,
            decay_factor,
            sig_beta,
            dM,
        )
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


# --------------------------------------------------------------------------------------------------
# Weight gradients, many steps at once
# --------------------------------------------------------------------------------------------------


def first_key_gradient(
    grads: StepState, g0: torch.Tensor, w: FoldedWeights, s: Shapes, eps: float, weight_grads: _WeightGrads
) -> torch.Tensor:
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

    def __init__(self, w: FoldedWeights, batch: int, steps_per_block: int | None = None):
        self.w = w
        zeros = lambda ref: torch.zeros(ref.shape, dtype=torch.float32, device=ref.device)
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
        empty = lambda n: torch.empty(self.steps_per_block * batch, n, dtype=torch.float32, device=w.fg_w.device)
        self.blocks = {name: (empty(g.shape[0]), empty(g.shape[1])) for name, g in self.grads.items()}
        self.step = 0

    def rows(self, name: str | tuple[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _accumulate(self, name: str | tuple[str, int], x: torch.Tensor, dy: torch.Tensor) -> None:
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
        like = lambda ref, dt: torch.empty(ref.shape, dtype=dt, device=ref.device)
        self.products = {name: like(g, dtype) for name, g in self.grads.items()}
        self.bias_sums = {name: like(b, torch.float32) for name, b in self.bias_grads.items()}
        self.cast_blocks = None
        if dtype != torch.float32:
            self.cast_blocks = {name: (like(x, dtype), like(dy, dtype)) for name, (x, dy) in self.blocks.items()}

    def zero(self) -> None:
        """Zero the static gradient buffers in place, for the next captured sweep."""
        for tensor in (*self.grads.values(), *self.bias_grads.values()):
            tensor.zero_()
        if self.neg_decay is not None:
            self.neg_decay.zero_()
        self.step = 0

    def _accumulate(self, name: str | tuple[str, int], x: torch.Tensor, dy: torch.Tensor) -> None:
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


def _tmm(x: torch.Tensor, gy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x^T gy over all collected positions, in the weights' dtype with a float32 result."""
    return torch.matmul(x.t().to(dtype), gy.to(dtype)).float()


# --------------------------------------------------------------------------------------------------
# The folded weights as a flat list (the inputs of the autograd function and the graphs' static copies)
# --------------------------------------------------------------------------------------------------


def _flatten(w: FoldedWeights) -> list:
    flat = [w.fg_w, w.fg_b, w.big_w, w.big_b, *w.out_w, *w.layer_w, *w.layer_b]
    if w.neg_decay_rate is not None:
        flat.append(w.neg_decay_rate)
    return flat


def _unflatten(flat: list, s: Shapes) -> FoldedWeights:
    n = s.layers
    out_w = tuple(flat[4 : 4 + n])
    layer_w = tuple(flat[4 + n : 3 + 2 * n])
    layer_b = tuple(flat[3 + 2 * n : 2 + 3 * n])
    neg = flat[2 + 3 * n] if s.memory else None
    return FoldedWeights(flat[0], flat[1], flat[2], flat[3], out_w, layer_w, layer_b, neg)
