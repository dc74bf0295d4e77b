"""Triton kernels for the GPN fast path on GPU (optional: the torch ops in `recurrence_step` compute the same
and are the reference the tests compare against).

Why: on a GPU a step of the torch-ops path is a few dozen tiny kernel launches (elementwise ops on a few
rows, the memory's write and read each as several passes over M), so it is bound by launch overhead, not
by the GPU. These kernels fuse each stretch of elementwise work between two matmuls into one launch, and the
memory half of a step (and the gradient of the write and reads) into one launch per step, one program per
(row, head) as the CPU C kernels in `memory_kernels.py` run one head per iteration. The matmuls stay
torch.matmul (cuBLAS): they are the bulk of the work and are already one launch each.

Kernels (contracts are those of the named torch functions in `recurrence_step`):
    memory_step            `_memory_step_torch`: relu + l2 of key and query, gates, the write
                           M' = e^gamma M + k (beta (v - M^T k))^T, layer 0's read M'^T q; then rms of the read
    memory_write_backward  `_memory_write_backward_torch`: gradients through the write and the reads of M'
    memory_read            a layer above 0 reading M': l2(relu(query)), M'^T q, rms of the read
    unit_rms               x / sqrt(mean(x^2) + eps) per row
    ground                 sig = sigmoid(z + b);  g = sig * p + u;  rms(g)
    predict_input          X = [silu(a) b | silu(r) rms(read)]
    gated_residual         state' = Y + sigmoid(gate) * state
`step` is `recurrence_step._step` on these kernels (same arguments, same results, same records).

When they run (`selected`): on CUDA tensors when triton imports, unless `GPN_TRITON=0`; on CPU only when
forced with `GPN_TRITON=1` *and* Triton's interpreter is on (`TRITON_INTERPRET=1`, which Triton reads when
it decorates a function, and importing torch already imports triton.language: set it before Python starts,
as tests/environment.py does), which is how the tests run them without a GPU. Every kernel
also checks its inputs (`usable_*`: float32, contiguous where needed, sizes within the block limits) and the
step falls back to the torch ops when they do not fit, never computing garbage.

The backward twin, `step_backward`, is `recurrence_step._step_backward` on kernels of the same kind:
    predict_layer_backward  through the gated residual and X (gradients of gate, FFN, read gate and read)
    memory_read_backward    a layer above 0: dq = M' d_read, through l2(relu(.)) into its query columns
    memory_gates_backward   after memory_write_backward: the gate, value, key and query columns of dZ
    rms_backward            acc [* mul] [+ acc2] + the gradient through rms(x) (and rms(x) itself)
    ground_gate_backward    through g = sigmoid(z) p + u to z
A masked step (padded rows kept their state) splits each incoming gradient first (`_split_real`: the real
rows' part enters the step, the padded rows' part passes to the carried input) and adds the passed parts
after, around the same kernels: a masked_fill per part (8 launches), ~real, and adds for the key and M (p's
rides in the last `rms_backward`).

Which steps run here is decided once per window by the dispatcher (`fast_recurrence`), from the window's
inputs and the model's sizes (`steps_refusal`, `backward_steps_refusal`: why not, which the dispatcher
records and logs); no function here picks a backend.

This file ships to the Hub with the model: it imports only torch, typing, the standard library and
`recurrence_step` (the contract its steps keep, and their fallback to the torch ops); the kernels themselves (`triton_jit.py`, which needs triton) are imported when first used, so CPU users never
need triton.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from .recurrence_step import (
    Columns,
    FoldedWeights,
    MemoryStep,
    PackedMatrix,
    Shapes,
    StepState,
    TransposedWeights,
    _split_real,
    _step,
    _step_backward,
    _WeightGrads,
    columns_of,
    keep_padded_rows,
    key_from_grounded,
    transpose_weights,
    write_memory,
)

MAX_KEY_BLOCK = 256  # largest key dimension a memory program holds at once (next power of two)
# columns of M a memory program handles per iteration of its loop over the value dimension: with 128 key
# rows, 64 columns spill registers on sm_90 in the write backward (12 B per program as the JIT specialises
# the 130M's launches on triton 3.6, 2.7 KB unspecialised), 32 do not (benchmarks/triton_compile_check.py)
VALUE_BLOCK = 32
MAX_ROW_BLOCK = 16384  # widest row the row-wise kernels hold at once (next power of two)

_kernels = None  # the jitted kernels, built on first use (`_build`)
_import_error: str | None = None
_built_interpreted = False  # whether the kernels were built for Triton's interpreter (CPU tensors)
launches: Counter = Counter()  # Triton kernel launches so far, by kernel (tests and benchmarks/launch_counts.py)
# `self_check` results by (device, sizes with batch, matmul dtype): None when the kernels matched the torch
# ops, else why not (the kernels are then off for that combination)
_self_checks: dict = {}


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def interpreter_on() -> bool:
    """Whether Triton's CPU interpreter is requested (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def available() -> bool:
    """Whether triton imports and the kernels build (building them on first call)."""
    return _build() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    _build()
    return _import_error


def selected(*tensors: torch.Tensor) -> bool:
    """Whether the fast path should use these kernels for tensors like these (see the module docstring):
    CUDA tensors unless GPN_TRITON=0; CPU tensors only with GPN_TRITON=1 under TRITON_INTERPRET=1; never
    under torch.compile (it traces the torch ops instead)."""
    setting = os.environ.get("GPN_TRITON", "auto")
    if setting == "0" or not tensors or (tensors[0].is_cpu and setting != "1"):  # (cheap: asked every window)
        return False
    if torch.compiler.is_compiling():
        return False
    devices = {t.device.type for t in tensors}
    if devices == {"cuda"}:
        wanted = not interpreter_on()  # the interpreter cannot run on CUDA tensors
    elif devices == {"cpu"}:
        wanted = setting == "1" and interpreter_on()
    else:
        wanted = False
    return wanted and available()


# The batch sizes every self-check covers besides the run's own: the kernels are compiled per integer
# specialisation (Triton specialises an int argument on being 1 or divisible by 16: rows = B, heads = B*H), so
# batch 2 and batch 16 select different compiled variants of e.g. `memory_write_backward` at the 130M sizes
SELF_CHECK_BATCHES = (2, 16)
# How far (relative, in both the max norm and the 2-norm of each compared quantity) the kernels' results may
# be from the torch ops': 2^-13 = 1024 float32 ulps. Why that size: with its matmuls on float32 copies of the
# weights both sides compute one float32 function, and a GPU's kernels differ from torch's by a few ulps per
# operation (reduction order, approximate division, exp2, fast sqrt); a step chains some 30 such operations
# and reductions over up to ~10^4 terms (rounding growing as sqrt(n) ulps), a few hundred ulps at the worst.
# A wrong kernel (a missing term, a wrong index, a 1e-2 error in one element) is 80 times above it.
SELF_CHECK_TOLERANCE = 2.0**-13


def _self_check_key(device: torch.device, s: Shapes, matmul_dtype: torch.dtype) -> tuple:
    return (str(device), s, matmul_dtype)


def _describe(key: tuple) -> str:
    """A self-check combination in words: device, dtype and sizes."""
    device, s, dtype = key
    sizes = f"batch {s.batch}, hidden {s.hidden}, inter {s.inter}, {s.layers} layer(s)"
    if s.memory:
        sizes += f", {s.heads} heads of {s.key_dim}x{s.value_dim}"
    return f"{device} {str(dtype).replace('torch.', '')} ({sizes})"


def self_check_needed(s: Shapes, matmul_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `self_check` has yet to run for these sizes (batch included), weights' dtype and device: on
    CUDA always (the kernels' results on a GPU are checked before they are used), elsewhere only with
    GPN_TRITON_SELF_CHECK=1 (the tests of the check itself; the CPU tests compare the kernels directly)."""
    if device.type != "cuda" and os.environ.get("GPN_TRITON_SELF_CHECK") != "1":
        return False
    return _self_check_key(device, s, matmul_dtype) not in _self_checks


def self_check_passed(s: Shapes, matmul_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernels may run these sizes, dtype and device: not turned off by a failed self-check."""
    return _self_checks.get(_self_check_key(device, s, matmul_dtype)) is None


def self_check(w: FoldedWeights, s: Shapes, eps: float, device: torch.device, matmul_dtype: torch.dtype) -> bool:
    """Check the kernels against the torch ops for sizes `s` (those of weights `w`) at batch `s.batch` and at
    each of `SELF_CHECK_BATCHES` not checked yet: one step forward and backward, `step`/`step_backward` on the
    kernels and `recurrence_step._step`/`_step_backward` on torch ops, comparing the new state, gamma, the
    state and input gradients and every weight gradient (`compare_results`). Returns whether the kernels
    passed at `s.batch`.

    Why: the kernels are compiled for the GPU they meet and were tested through Triton's CPU interpreter;
    a compiler or hardware difference must not make them compute garbage in silence. How, so that it cannot
    false-alarm on correct kernels nor miss a wrong one:
    - its own random weights of `w`'s shapes, every one non-zero (a fresh model's fuse gate, gates and FFN
      output are zero, which would compare whole branches as 0 = 0), on float32 copies for both sides: the
      kernels never see the matmul dtype (they upcast what they read), while bf16 products of inputs a few
      ulps apart round apart and move a gradient term by ~0.4%, a false alarm at bf16 sizes;
    - full float32 matmuls (`_full_float32_matmuls`: not TF32, whatever the process set);
    - normwise relative errors against `SELF_CHECK_TOLERANCE`, sized from float32 rounding;
    - the batch sizes that select different compiled variants (`SELF_CHECK_BATCHES` and the run's own);
    - the device synchronized inside the `try`, so an asynchronous CUDA error counts as a failure.
    On a mismatch (or kernels that raise: fail to compile or launch) it warns, naming the combination
    (device, dtype, sizes) and the first quantity that differs, and turns the kernels off for that
    combination only (`self_check_passed`; the torch ops, which compute the same function, run it instead).
    An error that leaves the CUDA context broken (an illegal address) cannot be recovered from, though."""
    weights = _random_weights(w, device)
    with _full_float32_matmuls():
        for batch in sorted({s.batch, *SELF_CHECK_BATCHES}):
            _self_check_batch(weights, s._replace(batch=batch), eps, device, matmul_dtype)
    return self_check_passed(s, matmul_dtype, device)


def _self_check_batch(
    weights: FoldedWeights, sizes: Shapes, eps: float, device: torch.device, matmul_dtype: torch.dtype
) -> None:
    """`self_check` at one batch size (`sizes.batch`), unless done: the verdict into `_self_checks`."""
    import warnings

    key = _self_check_key(device, sizes, matmul_dtype)
    if key in _self_checks:
        return
    s, batch = sizes, sizes.batch  # (`s`: as elsewhere in this file)
    generator = torch.Generator(device=device).manual_seed(batch)
    randn = lambda *shape: torch.randn(*shape, generator=generator, device=device)
    with torch.no_grad(), on_device(weights.fg_w):
        p, g, u = randn(batch, s.hidden), randn(batch, s.hidden), randn(batch, s.hidden)
        if s.memory:
            memory = randn(batch, s.heads, s.key_dim, s.value_dim) * 0.1
            state = StepState(p, g, key_from_grounded(g, weights, sizes, eps), memory)
        else:
            empty = torch.zeros(batch, 0, device=device)
            state = StepState(p, g, empty, empty)
        expected = _one_step(_step, _step_backward, state, u, weights, sizes, columns_of(sizes), eps)
        try:
            got = _one_step(step, step_backward, state, u, weights, sizes, columns_of(sizes), eps)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # (an asynchronous kernel error surfaces here, inside the try)
            problem = compare_results(expected, got)
        except Exception as error:  # noqa: BLE001 (see below)
            # the kernels failed to compile or launch (a Triton release that rejects one, no C compiler
            # for Triton's launcher, too many registers, an illegal address...): the torch ops can still run
            first_line = (str(error).strip() or "?").splitlines()[0][:300]
            problem = f"running them raised {type(error).__name__}: {first_line}"
    _self_checks[key] = problem
    if problem is not None:
        warnings.warn(
            f"GPN's Triton kernels disagree with the torch ops on {_describe(key)}: {problem}; the "
            "kernels are off for these sizes and dtype in this process and the torch ops run them "
            "instead. Please report this.",
            RuntimeWarning,
            stacklevel=2,
        )


@contextlib.contextmanager
def _full_float32_matmuls():
    """float32 matmuls in full float32 inside (`torch.set_float32_matmul_precision("highest")`), as before
    after: a training script's "high" or "medium" (TF32 on a GPU, bf16 in oneDNN on CPU) would round the two
    sides' inputs, a few ulps apart, apart again, the false alarm the float32 copies are there to avoid."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)


def _random_weights(w: FoldedWeights, device: torch.device):
    """Float32 random weights of `w`'s shapes (a `FoldedWeights`, matrices possibly packed): every matrix
    and bias non-zero, scaled so that the step's activations are of order one."""
    generator = torch.Generator(device=device).manual_seed(1234)

    def like(t: torch.Tensor | PackedMatrix, scale: float | None = None):
        t = getattr(t, "matrix", t)  # (a `recurrence_step.PackedMatrix`)
        x = torch.randn(t.shape, generator=generator, device=device)
        return x * (scale if scale is not None else 0.5 / t.shape[0] ** 0.5)

    return FoldedWeights(
        fg_w=like(w.fg_w),
        fg_b=like(w.fg_b, 0.1),
        big_w=like(w.big_w),
        big_b=like(w.big_b, 0.1),
        out_w=tuple(like(m) for m in w.out_w),
        layer_w=tuple(like(m) for m in w.layer_w),
        layer_b=tuple(like(b, 0.1) for b in w.layer_b),
        neg_decay_rate=None if w.neg_decay_rate is None else -torch.exp(like(w.neg_decay_rate, 0.5)),
    )


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """max(|got - expected|_inf / |expected|_inf, |got - expected|_2 / |expected|_2) in float64 (0 when
    both are zero; inf where either is not finite or only `expected` is zero)."""
    got, expected = got.double(), expected.double()
    if not (torch.isfinite(got).all() and torch.isfinite(expected).all()):
        return float("inf")
    difference = got - expected
    errors = []
    for norm in (float("inf"), 2):
        scale = torch.linalg.vector_norm(expected, norm).item()
        size = torch.linalg.vector_norm(difference, norm).item()
        errors.append(0.0 if size == 0 else (size / scale if scale > 0 else float("inf")))
    return max(errors)


def compare_results(expected: dict, got: dict, tolerance: float = SELF_CHECK_TOLERANCE) -> str | None:
    """None when every quantity of `expected` (name -> tensor) is in `got` within `tolerance`
    (`relative_error`), else what differs first."""
    for name, want in expected.items():
        have = got.get(name)
        if have is None or have.shape != want.shape:
            return f"{name}: missing or of another shape"
        error = relative_error(have, want)
        if not error <= tolerance:
            return f"{name}: relative error {error:.3g} (tolerance {tolerance:.3g})"
    return None


def _one_step(
    forward: Callable,
    backward: Callable,
    state: StepState,
    u: torch.Tensor,
    w: FoldedWeights,
    s: Shapes,
    c: Columns,
    eps: float,
) -> dict:
    """What one step forward and backward (gradients of ones) computes, by name, for `self_check`."""
    memory_out = lambda: torch.empty_like(state.memory) if s.memory else None
    saved = {}
    new_state, gamma = forward(state, u, None, w, s, c, eps, saved, memory_out())
    new_state = StepState(*(x.clone() for x in new_state))  # (kernel outputs may live in reused buffers)
    weight_grads = _WeightGrads(w, s.batch)
    grads = StepState(*(torch.ones_like(x) for x in new_state))
    d_state, d_u = backward(saved, grads, transpose_weights(w), s, c, eps, weight_grads, memory_out())
    weight_grads.flush()
    named = {f"new {n}": x for n, x in zip(StepState._fields, new_state)}
    named.update({f"d {n}": x.clone() for n, x in zip(StepState._fields, d_state)}, d_u=d_u.clone())
    if gamma is not None:
        named["gamma"] = gamma.clone()
    named.update({f"weight gradient {k}": v for k, v in weight_grads.grads.items()})
    named.update({f"bias gradient {k}": v for k, v in weight_grads.bias_grads.items()})
    if weight_grads.neg_decay is not None:
        named["weight gradient neg_decay_rate"] = weight_grads.neg_decay
    return named


def self_check_failures() -> dict:
    """The combinations a failed self-check turned the kernels off for: {description: what differed}."""
    return {_describe(key): problem for key, problem in _self_checks.items() if problem is not None}


def self_check_failure() -> str | None:
    """The failed self-checks in one line (None while every one passed)."""
    failures = self_check_failures()
    return "; ".join(f"{where}: {why}" for where, why in failures.items()) or None


def self_check_summary() -> dict:
    """Every self-check of this process: {description: "passed" or what differed} (for reports)."""
    return {_describe(key): problem or "passed" for key, problem in _self_checks.items()}


def on_device(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context running CUDA work (launches, streams, graph captures) on `tensor`'s device rather than the
    current one (a model on cuda:1 while device 0 is current); nothing to do off CUDA."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


def _float32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in tensors)


def memory_refusal(memory: torch.Tensor, *others: torch.Tensor) -> str | None:
    """Why the memory kernels do not take M (BH, dk, dv) and these tensors, or None where they do: float32, M
    contiguous, one device, dk within `MAX_KEY_BLOCK`."""
    if memory.dim() != 3 or not memory.is_contiguous():
        return "the memory is not a contiguous (rows x heads, key, value) tensor"
    if not _float32(memory, *others):
        return "the memory or the tensors beside it are not float32"
    if any(t.device != memory.device for t in others):
        return "the memory and the tensors beside it are on different devices"
    if not 0 < memory.shape[1] <= MAX_KEY_BLOCK:
        return f"the memory's key dimension {memory.shape[1]} is outside the kernels' 1 to {MAX_KEY_BLOCK}"
    return None if memory.shape[2] > 0 else "the memory's value dimension is 0"


def usable_memory(memory: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether the memory kernels take M (BH, dk, dv) and these tensors (`memory_refusal` says why not)."""
    return memory_refusal(memory, *others) is None


def rows_refusal(*tensors: torch.Tensor) -> str | None:
    """Why the row-wise kernels do not take these (rows, width) tensors, or None where they do: float32, unit
    column stride, one device, width within `MAX_ROW_BLOCK`."""
    if not _float32(*tensors):
        return "not float32"
    for t in tensors:
        if t.dim() != 2 or t.stride(1) != 1:
            return "elements not adjacent (the batch innermost, or another odd stride)"
        if t.shape[1] > MAX_ROW_BLOCK:
            return f"{t.shape[1]} columns, above the kernels' {MAX_ROW_BLOCK}"
    return None if len({t.device for t in tensors}) == 1 else "on different devices"


def usable_rows(*tensors: torch.Tensor) -> bool:
    """Whether the row-wise kernels take these (rows, width) tensors (`rows_refusal` says why not)."""
    return rows_refusal(*tensors) is None


# --------------------------------------------------------------------------------------------------
# The kernels (in triton_jit.py, imported when first needed: importing this file never needs triton, and
# TRITON_INTERPRET is read at that moment)
# --------------------------------------------------------------------------------------------------


def _build():
    """The kernels (`triton_jit`), imported on first call; None (with `_import_error` set) without triton."""
    global _kernels, _import_error, _built_interpreted
    if _kernels is not None or _import_error is not None:
        return _kernels
    try:
        from .triton_jit import KERNELS
    except ImportError as error:  # CPU installs without triton: the torch ops still work
        _import_error = str(error)
        return None
    _built_interpreted = interpreter_on()
    _kernels = KERNELS
    return _kernels


def _launch(name: str, grid: int, *args, **meta) -> None:
    kernel = _build()
    if kernel is None:
        raise RuntimeError(f"the GPN Triton kernels are unavailable: {_import_error}")
    launches[name] += 1
    kernel[name][(grid,)](*args, **meta)


def _empty(
    ws: dict | None, name: str, *shape: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A buffer for an intermediate result: fresh, or with a workspace `ws` (a dict), the one made for
    `name` on the first call (the static buffers a captured CUDA graph replays into; see `cuda_graphs`)."""
    if ws is None:
        return torch.empty(shape, dtype=dtype, device=device)
    buffer = ws.get(name)
    if buffer is None or buffer.shape != shape or buffer.dtype != dtype or buffer.device != torch.device(device):
        buffer = ws[name] = torch.empty(shape, dtype=dtype, device=device)
    return buffer


def _value_block(dv: int) -> int:
    return min(_next_power_of_two(dv), VALUE_BLOCK)


# --------------------------------------------------------------------------------------------------
# Python entry points, with the contracts of the torch ops in recurrence_step
# --------------------------------------------------------------------------------------------------


def unit_rms(
    x: torch.Tensor, eps: float, out: torch.Tensor | None = None, ws: dict | None = None, name: str = "rms"
) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) per row of a (rows, width) float32 tensor (unit column stride)."""
    rows, width = x.shape
    out = _empty(ws, name, rows, width, device=x.device) if out is None else out
    _launch("unit_rms", rows, x, x.stride(0), out, out.stride(0), width, eps, BLOCK=_next_power_of_two(width))
    return out


def memory_step(
    Z: torch.Tensor,
    c: Columns,
    key: torch.Tensor,
    neg_decay_rate: torch.Tensor,
    memory: torch.Tensor,
    memory_out: torch.Tensor,
    eps: float,
    ws: dict | None = None,
) -> MemoryStep:
    """`recurrence_step._memory_step_torch` (and `memory_kernels.memory_step`) in two launches: the memory
    half of a step per (row, head), then the read's RMS norm per row. Same arguments, same `MemoryStep`."""
    heads, dk, dv = memory.shape
    rows = Z.shape[0]
    H = heads // rows
    if Z.stride(1) != 1 or key.stride(1) != 1 or heads != rows * H or memory_out.shape != memory.shape:
        raise ValueError("Z and key must have unit column stride, and M one (dk, dv) matrix per row and head")
    if not memory_out.is_contiguous() or not memory.is_contiguous():
        raise ValueError("M and the output buffer must be contiguous")
    if neg_decay_rate.dtype != torch.float32 or not neg_decay_rate.is_contiguous():
        neg_decay_rate = neg_decay_rate.float().contiguous()
    shapes = dict(
        kq_raw=(heads, 2, dk),
        kq=(heads, 2, dk),
        kq_inv=(heads, 2, 1),
        softplus_decay=(rows, H),
        gamma=(rows, H),
        decay_factor=(heads, 1),
        sig_beta=(heads, 1),
        error=(heads, dv),
        update=(heads, dv),
        read=(rows, H * dv),
        normed_read=(rows, H * dv),
    )
    out = MemoryStep(*(_empty(ws, name, *shape, device=memory.device) for name, shape in shapes.items()))
    _launch(
        "memory_step",
        heads,
        Z,
        Z.stride(0),
        c.value.start,
        c.beta.start,
        c.decay.start,
        c.write + c.query.start,
        key,
        key.stride(0),
        neg_decay_rate,
        memory,
        memory_out,
        *out[:10],
        H,
        dk,
        dv,
        BLOCK_K=_next_power_of_two(dk),
        BLOCK_V=_value_block(dv),
    )
    unit_rms(out.read, eps, out=out.normed_read)
    return out


def memory_read(
    query: torch.Tensor, memory: torch.Tensor, ws: dict | None = None, name: str = "read"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's read of M' (BH, dk, dv) with its query pre-activation (B, H*dk, unit column stride):
    (q_raw, q, q_inv, read) with q = l2(relu(query)) per head (BH, dk), q_inv (BH, 1) and read = M'^T q (B, H*dv)."""
    heads, dk, dv = memory.shape
    rows = query.shape[0]
    empty = lambda part, *shape: _empty(ws, f"{name}.{part}", *shape, device=memory.device)
    q_raw, q, q_inv = empty("q_raw", heads, dk), empty("q", heads, dk), empty("q_inv", heads, 1)
    read = empty("read", rows, heads // rows * dv)
    _launch(
        "memory_read",
        heads,
        query,
        query.stride(0),
        memory,
        q_raw,
        q,
        q_inv,
        read,
        heads // rows,
        dk,
        dv,
        BLOCK_K=_next_power_of_two(dk),
        BLOCK_V=_value_block(dv),
    )
    return q_raw, q, q_inv, read


def memory_write_backward(
    memory_grad: torch.Tensor,
    memory: torch.Tensor,
    queries: torch.Tensor,
    read_grads: torch.Tensor,
    k: torch.Tensor,
    update: torch.Tensor,
    a: torch.Tensor,
    beta: torch.Tensor,
    memory_grad_out: torch.Tensor | None,
    ws: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`recurrence_step._memory_write_backward_torch` (and `memory_kernels.memory_write_backward`) in one
    launch, one program per (row, head). Same arguments, same results: (d_update, d_k, d_a, dq of layer 0,
    d_error), and dL/dM written into `memory_grad_out` (which may not be `memory_grad`). With a workspace
    `ws`, the results go into its buffers."""
    heads, dk, dv = memory.shape
    if memory_grad_out.shape != memory.shape or not memory_grad_out.is_contiguous():
        raise ValueError(f"output buffer must be a contiguous {tuple(memory.shape)} tensor")
    if memory_grad_out.data_ptr() == memory_grad.data_ptr():
        raise ValueError("memory_grad_out must not be memory_grad")
    if k.stride(-1) != 1:  # k may be a row-strided view (the key half of the step's kq record)
        k = k.contiguous()
    memory_grad, memory, queries, read_grads, update, a, beta = (
        t.contiguous() for t in (memory_grad, memory, queries, read_grads, update, a, beta)
    )
    empty = lambda name, *shape: _empty(ws, f"write_backward.{name}", *shape, device=memory.device)
    d_update, d_error, d_k = empty("d_update", heads, dv), empty("d_error", heads, dv), empty("d_k", heads, dk)
    d_a, dq = empty("d_a", heads), empty("dq", heads, dk)
    _launch(
        "memory_write_backward",
        heads,
        memory_grad,
        memory,
        memory_grad_out,
        queries,
        read_grads,
        k,
        k.stride(0),
        update,
        a,
        beta,
        d_update,
        d_k,
        d_a,
        dq,
        d_error,
        heads,
        dk,
        dv,
        LAYERS=queries.shape[0],
        BLOCK_K=_next_power_of_two(dk),
        BLOCK_V=_value_block(dv),
    )
    return d_update, d_k, d_a, dq, d_error


def ground(
    z_fg: torch.Tensor, bias: torch.Tensor, p: torch.Tensor, u: torch.Tensor, eps: float, ws: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sig, g, rms(g)) with sig = sigmoid(z_fg + bias), g = sig * p + u; z_fg and p contiguous (B, d),
    u (B, d) with unit column stride (a column of the window's inputs)."""
    rows, width = p.shape
    if not bias.is_contiguous():  # (the kernel reads it at unit stride: a strided nn.Parameter is possible)
        bias = bias.contiguous()
    sig, g, a_g = (_empty(ws, name, rows, width, device=p.device) for name in ("sig_fg", "grounded", "a_g"))
    _launch("ground", rows, z_fg, bias, p, u, u.stride(0), sig, g, a_g, width, eps, BLOCK=_next_power_of_two(width))
    return sig, g, a_g


def predict_input(
    part: torch.Tensor,
    c: Columns,
    normed_read: torch.Tensor | None,
    inter: int,
    ws: dict | None = None,
    name: str = "X",
) -> torch.Tensor:
    """X = [silu(a) b | silu(read_gate) normed_read] (B, f (+ H*dv)) from a layer's projections `part`."""
    rows = part.shape[0]
    read_width = 0 if normed_read is None else normed_read.shape[1]
    X = _empty(ws, name, rows, inter + read_width, device=part.device)
    normed = X if normed_read is None else normed_read.contiguous()
    col_r = 0 if normed_read is None else c.read_gate.start
    _launch(
        "predict_input",
        rows,
        part,
        part.stride(0),
        c.ffn_a.start,
        c.ffn_b.start,
        col_r,
        normed,
        X,
        inter,
        read_width,
        BLOCK_F=min(_next_power_of_two(inter), 1024),
        BLOCK_R=min(_next_power_of_two(max(read_width, 1)), 1024),
    )
    return X


def gated_residual(
    Y: torch.Tensor, part: torch.Tensor, c: Columns, state: torch.Tensor, ws: dict | None = None, name: str = "state"
) -> torch.Tensor:
    """state' = Y + sigmoid(part[:, gate]) * state, (B, d)."""
    rows, width = state.shape
    out = _empty(ws, name, rows, width, device=state.device)
    _launch(
        "gated_residual",
        rows,
        Y,
        part,
        part.stride(0),
        c.gate.start,
        state,
        out,
        width,
        BLOCK=min(_next_power_of_two(width), 1024),
    )
    return out


# --------------------------------------------------------------------------------------------------
# One step on the kernels
# --------------------------------------------------------------------------------------------------


def steps_refusal(s: Shapes, U: torch.Tensor, p0: torch.Tensor, g0: torch.Tensor, M0: torch.Tensor) -> str | None:
    """Why `step` does not take every forward step of a window of the fast path, or None where it does: token
    inputs U (B, T, d), the state before it (p0, g0, M0) and the model's sizes `s`. Asked once for the window,
    not of each step: each step's state and key (float32, contiguous or with unit column stride, on U's device)
    are made by the previous step, so the window's inputs and the sizes decide for all of them. (The dispatcher records and logs the reason: `fast_recurrence.choose_backends`.)"""
    if U.dim() != 3 or U.shape[1] == 0:
        return "the window has no steps"
    if not (p0.is_contiguous() and g0.is_contiguous()):
        return "the carried state is not contiguous"
    refusal = rows_refusal(p0, g0, U[:, 0])
    if refusal is not None:
        return f"the rows of the state and token inputs: {refusal}"
    if s.memory:  # (the key the fast path computes from g0 is a contiguous float32 (B, H*dk) on g0's device)
        refusal = memory_refusal(M0.reshape(-1, s.key_dim, s.value_dim), g0)
        if refusal is not None:
            return refusal
        for name, dim in (("key", s.key_dim), ("value", s.value_dim)):
            if s.heads * dim > MAX_ROW_BLOCK:
                return f"the memory's {name} rows ({s.heads} heads of {dim}) are above the kernels' {MAX_ROW_BLOCK}"
    return None


def backward_steps_refusal(s: Shapes, U: torch.Tensor) -> str | None:
    """Why `step_backward` does not take every backward step of a window of the fast path with token inputs U
    (B, T, d) and the model's sizes `s`, or None where it does. What `usable_step_backward` asks of one step,
    asked once for the window: the records the forward steps saved and the gradients carried between backward
    steps are contiguous float32 tensors on U's device (the dispatcher makes those handed in by autograd so,
    and asks this only of a window whose forward steps are this file's `step`: the torch-ops step's records
    follow its inputs' layout), so the sizes decide."""
    if U.dtype != torch.float32:
        return "the token inputs are not float32"
    if s.hidden > MAX_ROW_BLOCK:
        return f"the hidden size {s.hidden} is above the kernels' {MAX_ROW_BLOCK}"
    if s.memory:
        if not 0 < s.key_dim <= MAX_KEY_BLOCK:
            return f"the memory's key dimension {s.key_dim} is outside the kernels' 1 to {MAX_KEY_BLOCK}"
        if s.value_dim <= 0:
            return "the memory's value dimension is 0"
        if s.heads * s.value_dim > MAX_ROW_BLOCK:
            return f"the memory's value rows ({s.heads} heads of {s.value_dim}) are above the kernels' {MAX_ROW_BLOCK}"
    return None


def sizes_fit(config: Any) -> bool:
    """Whether the Triton step takes this model's sizes whatever its inputs (what the CUDA graphs, which have
    no torch-ops fallback inside, need: the dispatcher asks it before choosing them)."""
    widths = [config.hidden_size, config.intermediate_size]
    if config.use_memory:  # (the key rows too: `steps_refusal` bounds them)
        widths += [config.num_memory_heads * config.memory_value_dim, config.num_memory_heads * config.memory_key_dim]
        if config.memory_key_dim > MAX_KEY_BLOCK:
            return False
    return max(widths) <= MAX_ROW_BLOCK


def _product(x: torch.Tensor, w: torch.Tensor | PackedMatrix, ws: dict | None = None, name: str = "") -> torch.Tensor:
    """x @ w in the weights' dtype, the result left in that dtype (float32 from a `PackedMatrix`): the
    kernels that read it upcast as they load (exact, so the same numbers as `recurrence_step._mm`'s
    float32 copy, one launch fewer). With a workspace, into its buffers (`torch.mm(out=)`: nothing
    allocated, as a captured CUDA graph needs)."""
    if not isinstance(w, torch.Tensor):  # a `recurrence_step.PackedMatrix` (CPU)
        return w.mm(x)
    if ws is None:
        return torch.matmul(x if x.dtype == w.dtype else x.to(w.dtype), w)
    if x.dtype != w.dtype:
        x = _empty(ws, f"{name}.x", *x.shape, device=x.device, dtype=w.dtype).copy_(x)
    return torch.mm(x, w, out=_empty(ws, name, x.shape[0], w.shape[1], device=x.device, dtype=w.dtype))


def _linear(
    x: torch.Tensor, w: torch.Tensor | PackedMatrix, b: torch.Tensor, ws: dict | None = None, name: str = ""
) -> torch.Tensor:
    """x @ w + b as float32 (`recurrence_step._linear`): one add after the product, in place for float32
    weights, else the add that upcasts (bf16 + float32 gives float32: one launch instead of two)."""
    product = _product(x, w, ws, name)
    if product.dtype == torch.float32:
        return product.add_(b)
    if ws is None:
        return torch.add(product, b)
    return torch.add(product, b, out=_empty(ws, f"{name}.float", *product.shape, device=x.device))


def step(
    state: StepState,
    u: torch.Tensor,
    real: torch.Tensor | None,
    w: FoldedWeights,
    s: Shapes,
    c: Columns,
    eps: float,
    saved: dict | None = None,
    memory_out: torch.Tensor | None = None,
    ws: dict | None = None,
) -> tuple[StepState, torch.Tensor | None]:
    """`recurrence_step._step` with its elementwise work and the memory half fused into Triton kernels (the
    matmuls stay torch's). Same arguments, same results, same records in `saved` (for `_step_backward`).
    With a workspace `ws` (a dict) every intermediate goes into its buffers (made on the first call): a
    step then allocates nothing, as a captured CUDA graph needs (`cuda_graphs`); results are only valid
    until the next step with the same workspace.

    Launches per step of a one-layer GPN+M (float32 weights): rms(p), the gate matmul, `ground`, the big
    matmul and its bias, `memory_step` (2), `predict_input`, the output matmul, `gated_residual`; with bf16
    weights one cast to bf16 before each matmul (its bf16 result is read by the next kernel as it is)."""
    p, g, key, memory = state
    a_p = unit_rms(p, eps, ws=ws, name="a_p")
    sig_fg, grounded, a_g = ground(_product(a_p, w.fg_w, ws, "z_fg"), w.fg_b, p, u, eps, ws=ws)
    Z = _linear(a_g, w.big_w, w.big_b, ws, "Z")
    records = None
    if saved is not None:
        records = [{} for _ in range(s.layers)]
        saved.update(p=p, g=g, sig_fg=sig_fg, grounded=grounded, layers=records)
    new_key, memory_flat, new_memory, gamma, read, normed_read = write_memory(
        Z, key, memory, memory_out, w, s, c, eps, saved, lambda *args: memory_step(*args, ws=ws)
    )
    part = Z[:, c.write :]
    layer_state = grounded
    for i in range(s.layers):
        record = None if records is None else records[i]
        if i > 0:
            a_c = unit_rms(layer_state, eps, ws=ws, name=f"a.{i}")
            part = _linear(a_c, w.layer_w[i - 1], w.layer_b[i - 1], ws, f"part.{i}")
            if s.memory:
                q_raw, q, q_inv, read = memory_read(part[:, c.query], memory_flat, ws=ws, name=f"read.{i}")
                normed_read = unit_rms(read, eps, ws=ws, name=f"normed_read.{i}")
            if record is not None:
                record["a"] = a_c
                if s.memory:
                    record.update(q_raw=q_raw, q=q, q_inv=q_inv)
        X = predict_input(part, c, normed_read if s.memory else None, s.inter, ws=ws, name=f"X.{i}")
        if record is not None:
            record.update(state=layer_state, part=part)
            if s.memory:
                record.update(read=read, normed_read=normed_read)
        Y = _product(X, w.out_w[i], ws, f"Y.{i}")
        layer_state = gated_residual(Y, part, c, layer_state, ws=ws, name=f"state.{i}")
    return keep_padded_rows(StepState(layer_state, grounded, new_key, new_memory), state, real, saved, s.memory), gamma


# --------------------------------------------------------------------------------------------------
# One step backward on the kernels
# --------------------------------------------------------------------------------------------------


def predict_layer_backward(
    part: torch.Tensor,
    c: Columns,
    state: torch.Tensor,
    d_state: torch.Tensor,
    dX: torch.Tensor,
    normed_read: torch.Tensor | None,
    read: torch.Tensor | None,
    d_part: torch.Tensor,
    out_x: torch.Tensor,
    d_read: torch.Tensor | None,
    eps: float,
    s: Shapes,
    ws: dict | None = None,
    name: str = "d_state",
) -> torch.Tensor:
    """Through one predict layer (see `predict_layer_backward_kernel`): fills the layer's columns of
    `d_part` (not its query: see `memory_read_backward`), X into `out_x` and d_read (B, H*dv) into `d_read`;
    returns the gradient of the layer's input state through its gate (sigmoid(gate) d_state)."""
    rows, width = state.shape
    d_state_out = _empty(ws, name, rows, width, device=state.device)
    read_width = 0 if normed_read is None else normed_read.shape[1]
    dummy = d_state_out
    _launch(
        "predict_layer_backward",
        rows,
        part,
        part.stride(0),
        c.gate.start,
        c.ffn_a.start,
        c.ffn_b.start,
        c.read_gate.start if read_width else 0,
        state,
        d_state.contiguous(),
        dX,
        dummy if normed_read is None else normed_read,
        dummy if read is None else read,
        d_part,
        d_part.stride(0),
        out_x,
        d_state_out,
        dummy if d_read is None else d_read,
        width,
        s.inter,
        read_width,
        eps,
        BLOCK=min(_next_power_of_two(width), 1024),
        BLOCK_F=min(_next_power_of_two(s.inter), 1024),
        BLOCK_R=min(_next_power_of_two(max(read_width, 1)), 1024),
    )
    return d_state_out


def rms_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    eps: float,
    acc: torch.Tensor,
    acc2: torch.Tensor | None = None,
    mul: torch.Tensor | None = None,
    y_out: torch.Tensor | None = None,
    ws: dict | None = None,
    name: str = "rms_backward",
) -> torch.Tensor:
    """acc [* mul] [+ acc2] + the gradient through y = rms(x) for dy (all (B, width), contiguous), writing
    y into `y_out` when given."""
    rows, width = x.shape
    out = _empty(ws, name, rows, width, device=x.device)
    _launch(
        "rms_backward",
        rows,
        dy,
        x,
        acc,
        out if acc2 is None else acc2,
        out if mul is None else mul,
        out,
        out if y_out is None else y_out,
        width,
        eps,
        HAS_ACC2=acc2 is not None,
        HAS_MUL=mul is not None,
        WRITE_Y=y_out is not None,
        BLOCK=_next_power_of_two(width),
    )
    return out


def _contiguous_rows(*tensors: torch.Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


def usable_step_backward(saved: dict, grads: StepState, s: Shapes) -> bool:
    """Whether `step_backward` takes this step: one whose records and gradients the kernels take (float32, contiguous rows, sizes within the block limits), masked or not."""
    rows = [saved["p"], saved["grounded"], saved["sig_fg"], grads.p, grads.g]
    if not (usable_rows(*rows) and _contiguous_rows(*rows)):
        return False
    if s.memory:
        if not usable_memory(saved["old_memory"], saved["new_memory"], grads.memory, grads.key):
            return False
        if grads.key.stride(-1) != 1 or not grads.memory.is_contiguous() or s.heads * s.value_dim > MAX_ROW_BLOCK:
            return False
    return True


def step_backward(
    saved: dict,
    grads: StepState,
    wt: TransposedWeights,
    s: Shapes,
    c: Columns,
    eps: float,
    weight_grads: _WeightGrads,
    memory_grad_out: torch.Tensor | None = None,
    ws: dict | None = None,
) -> tuple[StepState, torch.Tensor]:
    """`recurrence_step._step_backward` with its elementwise work fused into Triton kernels (the matmuls
    stay torch's). Same arguments, same results, for a step `usable_step_backward` accepts: the dispatcher
    runs it only on windows whose every step it takes (`backward_steps_refusal`, asked once per window), and
    `_step_backward` on the others. A masked step runs on the kernels too, as `_step_backward` runs
    one: the real rows' gradients go through the step, the padded rows' pass straight to the input state.
    With a workspace `ws` (a dict) every intermediate and result goes into its buffers, as in `step` (then
    the weight gradients must be a `recurrence_step.StaticWeightGrads`, whose block sums allocate nothing
    either): the backward steps of a captured training graph, which are never masked (checked here, where a
    graph captures the step once)."""
    real = saved.get("real")
    if ws is not None and not (real is None and usable_step_backward(saved, grads, s)):
        raise ValueError("a step on static buffers must be one the Triton backward takes, unmasked (float32, ...)")
    # padded rows kept their state: their gradients pass by the step (`*_pass`; None when unmasked) and only
    # the real rows' enter it, so every gradient of a padded row inside the step is zero
    padded = None if real is None else ~real
    d_new_p, dp_pass = _split_real(grads.p, real, padded)
    d_new_g, dg_pass = _split_real(grads.g, real, padded)
    d_new_key, dkey_pass = _split_real(grads.key, real, padded) if s.memory else (grads.key, None)
    d_new_memory, dM_pass = _split_real(grads.memory, real, padded) if s.memory else (grads.memory, None)
    B, H, dk, dv = s.batch, s.heads, s.key_dim, s.value_dim
    big_x, dZ = weight_grads.rows("big")
    d_state = d_new_p
    d_reads = _empty(ws, "d_reads", s.layers, B, H * dv, device=dZ.device) if s.memory else None
    for i in reversed(range(s.layers)):
        layer = saved["layers"][i]
        part = layer["part"]
        d_part = dZ[:, c.write :] if i == 0 else weight_grads.rows(("layer", i - 1))[1]
        out_x, dY = weight_grads.rows(("out", i))
        dY.copy_(d_state)
        dX = _product(dY, wt.out_w[i], ws, f"dX.{i}")
        d_state = predict_layer_backward(
            part,
            c,
            layer["state"],
            d_state,
            dX,
            layer.get("normed_read"),
            layer.get("read"),
            d_part,
            out_x,
            d_reads[i] if s.memory else None,
            eps,
            s,
            ws=ws,
            name=f"d_state.{i}",
        )
        if s.memory and i > 0:  # its query's gradient now: its input state's gradient needs it
            _launch(
                "memory_read_backward",
                B * H,
                d_reads[i],
                saved["new_memory"],
                layer["q"],
                layer["q_inv"],
                layer["q_raw"],
                d_part[:, c.query.start :],
                d_part.stride(0),
                H,
                dk,
                dv,
                BLOCK_K=_next_power_of_two(dk),
                BLOCK_V=_value_block(dv),
            )
        if i > 0:  # the layer's projections came from a = rms(its input state)
            layer_x, d_part_rows = weight_grads.rows(("layer", i - 1))
            d_a = _product(d_part_rows, wt.layer_w[i - 1], ws, f"d_a.{i}")
            d_state = rms_backward(d_a, layer["state"], eps, acc=d_state, y_out=layer_x, ws=ws, name=f"d_state_in.{i}")
    if s.memory:
        kq, old = saved["kq"], saved["old_memory"]
        dM = memory_grad_out.view(B * H, dk, dv) if memory_grad_out is not None else torch.empty_like(old)
        query_list = [kq[:, 1]] + [saved["layers"][i]["q"] for i in range(1, s.layers)]
        queries = torch.stack(query_list, out=_empty(ws, "queries", s.layers, B * H, dk, device=dZ.device))
        d_update, d_k, d_a, dq0, d_error = memory_write_backward(
            d_new_memory.reshape(B * H, dk, dv),
            old,
            queries,
            d_reads.view(s.layers, B * H, dv),
            kq[:, 0],
            saved["update"],
            saved["decay_factor"],
            saved["sig_beta"],
            dM,
            ws=ws,
        )
        d_key = _empty(ws, "d_key", B, H * dk, device=dZ.device)
        neg_terms = _empty(ws, "neg_terms", B, H, device=dZ.device)
        decay = saved["decay"]  # Z's decay columns (a view)
        _launch(
            "memory_gates_backward",
            B * H,
            d_update,
            saved["error"],
            d_error,
            d_k,
            dq0,
            d_a,
            saved["decay_factor"],
            saved["sig_beta"],
            saved["softplus_decay"],
            decay,
            decay.stride(0),
            wt.neg_decay_rate,
            kq,
            saved["kq_inv"],
            saved["kq_raw"],
            d_new_key,
            d_new_key.stride(0),
            dZ,
            dZ.stride(0),
            c.value.start,
            c.beta.start,
            c.decay.start,
            c.write + c.query.start,
            d_key,
            neg_terms,
            H,
            dk,
            dv,
            BLOCK_K=_next_power_of_two(dk),
            BLOCK_V=_value_block(dv),
        )
        if ws is None:
            weight_grads.neg_decay += neg_terms.sum(0)
        else:
            weight_grads.neg_decay.add_(torch.sum(neg_terms, 0, out=_empty(ws, "neg_sum", H, device=dZ.device)))
        dM = dM.view(B, H, dk, dv)
        if real is not None:  # the padded rows' gradients (the step gave those rows zeros)
            d_key.add_(dkey_pass)
            dM.add_(dM_pass)
    else:
        d_key, dM = grads.key, grads.memory
    p, sig_fg = saved["p"], saved["sig_fg"]
    d_a_g = _product(dZ, wt.big_w, ws, "d_a_g")
    d_grounded = rms_backward(
        d_a_g, saved["grounded"], eps, acc=d_new_g, acc2=d_state, y_out=big_x, ws=ws, name="d_grounded"
    )
    fg_x, d_z_fg = weight_grads.rows("fg")
    _launch(
        "ground_gate_backward",
        B,
        d_grounded,
        p,
        sig_fg,
        d_z_fg,
        s.hidden,
        BLOCK=min(_next_power_of_two(s.hidden), 1024),
    )
    d_a_p = _product(d_z_fg, wt.fg_w, ws, "d_a_p")
    # (+ dp_pass: the padded rows' gradient, added in the same launch; the step gives those rows zeros)
    d_p = rms_backward(d_a_p, p, eps, acc=d_grounded, mul=sig_fg, acc2=dp_pass, y_out=fg_x, ws=ws, name="d_p")
    weight_grads.next_step()
    # nothing flows past a step into g_{t-1} but through p, except the padded rows' gradient, which passes by
    if real is not None:
        d_g = dg_pass
    elif ws is None:
        d_g = torch.zeros_like(d_grounded)
    else:  # zeros, written once
        d_g = ws.get("d_g")
        if d_g is None or d_g.shape != d_grounded.shape:
            d_g = ws["d_g"] = torch.zeros_like(d_grounded)
    return StepState(d_p, d_g, d_key, dM), d_grounded
