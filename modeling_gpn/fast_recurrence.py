"""The fast path of the GPN recurrence: the same function as `GPNModel.recurrence_plain`, computed faster.
This file is its dispatcher: `fast_recurrence()` chooses, once per window, which backend runs each part of
it (`choose_backends`, the one place that chooses; the choice is kept in `model.last_recurrence_backends`),
then runs the window: the forward steps, the hand-written backward, BPTT segments, the buffers.

The layers (each file imports only those below it; see `recurrence_step` for the contract they keep):
    fast_recurrence.py   this file: the dispatcher (the model imports only it and `chunked_loss`)
    cuda_graphs.py       windows of steps replayed as CUDA graphs (handed Triton's steps from here)
    triton_kernels.py    a whole step forward and backward in Triton kernels (GPU; kernels in triton_jit.py)
    memory_kernels.py    the memory half of a step and its gradient in C kernels (CPU); the whole no-grad step
                         of a few rows in one C call (`StepPlan`)
    recurrence_step.py   folded weights and one step forward and backward in torch ops: the reference
Beside them, `derived_weights.py` says how long weights derived from the parameters may live: one forward
or one generate() call (the model opens that scope; this file reads it for the folded weights and graphs).

What makes it fast (see the speed issue and `GPN.md`):

- **Folded weights** (`recurrence_step.fold_weights`). Every RMSNorm weight is folded into the matrix it
  feeds, so a step needs one matmul on the unit-normalised grounded state for *all* projections of g (the
  memory write, the next step's key, and every projection of the first predict layer), one on rms(p) for
  the fuse gate, and one for the FFN and the read output together (their inputs concatenated).
- **A hand-written backward.** `GPNRecurrenceFunction` runs only the state-gradient chain step by step
  (`recurrence_step._step_backward`, the derivative of `_step` written out, no autograd graph), with the
  small per-step matmuls against contiguous transposed weights; the gradient of every weight matrix is one
  large matmul over many positions at once (each step writes the inputs of its matmuls and the gradients
  of their outputs into blocks of `WEIGHT_GRAD_ROWS` rows, then they are multiplied), as cuDNN-style RNN
  backward passes do.
- **Few bytes per step.** A step is bound by streaming the weights (33 MB in fp32 for the "small" preset)
  through the cache, so nothing else big is touched: the memory M' is written into reused buffers,
  layer 0 reads M' through M'^T q = e^gamma M^T q + (q.k) update from the same pass over M as the write.
- **Fused memory kernels (CPU).** The memory half of a step (key and query normalisation, write gates,
  the write, layer 0's read and its norm) and the gradient of the write and reads run one head at a time
  in small C kernels (`memory_kernels.py`, compiled once per machine), so M and dL/dM are read from memory
  once per step instead of once per torch op (the figures: benchmarks/RESULTS.md). The torch ops stay as the path under torch.compile, without a C compiler,
  and with GPN_MEMORY_KERNELS=0; tests run both.
- **The whole step in C at a small batch (CPU, no autograd).** A window of up to `MAX_STEP_ROWS` rows
  (decoding, a prompt's prefill) runs each step, or all of an unmasked window's steps, in one C call on the
  modules' own weights (fp32, bf16, torchao int8 weight-only, torchao int4 packed once per call;
  `memory_kernels.StepPlan`, backend `C_STEP`): the products stream every weight once at close to the
  machine's read bandwidth, which torch's matrix-vector products here reach a third of; the decoder and token
  projections and the logits of a few rows use the same products (`fast_project`, `output_logits`).
  GPN_STEP_KERNELS=0 turns them off.
- **Triton kernels (GPU)** (`triton_kernels.py`): the whole step's elementwise work and its memory half
  fused between the matmuls, forward and backward; and opt-in CUDA graphs (`cuda_graphs.py`).
- **Memory-bounded BPTT.** The forward pass keeps the state (p, g, key, M) only at segment boundaries
  (`config.bptt_segment_length`; `None` keeps every step); the backward pass recomputes each segment's
  states from its boundary before walking it backwards. Activation memory is then one segment's states
  plus the boundaries, instead of batch x length x memory cells. Under saved-tensor hooks (offloading, a
  non-reentrant checkpoint) the boundaries go through `save_for_backward`, so the hooks see them too.
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

This file ships to the Hub with the model (with the files above): it imports only torch, typing, the
standard library and them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .cache import GPNCache

from .arguments import check_input_ids
from .cache import CLAIM_ATTRIBUTE, snapshot_before_call
from .cuda_graphs import GRAPHS_ATTRIBUTE, SWEEPS_ATTRIBUTE, GraphKernels, training_sweep
from .cuda_graphs import asked as graphs_asked
from .cuda_graphs import window_forward as graph_window_forward
from .derived_weights import (
    KEPT_ATTRIBUTE,
    DerivedWeights,
    WatchedModules,
    as_read,
    called_as_is,
    derived_weights_of,
    derived_weights_scope,
    keep_with,
    registered_global_hook,
    replaced_method,
    replaced_method_reason,
    version_of,
)
from .memory_kernels import (
    MAX_STEP_ROWS,
    DecodePlan,
    KernelRefusal,
    StepPlan,
    linear_rows,
    memory_step,
    memory_write_backward,
    module_rows,
    switched_off,
)
from .memory_kernels import available as memory_kernels_available
from .memory_kernels import usable as memory_kernels_usable
from .recurrence_step import (
    TORCH_MEMORY_OPS,
    Columns,
    FoldedWeights,
    MemoryOps,
    MemoryStep,
    PackedMatrix,
    Shapes,
    StepState,
    _flatten,
    _memory_step_torch,
    _memory_write_backward_torch,
    _pack,
    _step,
    _step_backward,
    _unflatten,
    _unit_rms,
    _WeightGrads,
    cached_folded_weights,
    columns_of,
    dequantized_by_linear,
    first_key_gradient,
    fold_weights,
    in_matmul_dtype,
    int8_weight_parts,
    key_from_grounded,
    misshapen_step_weight,
    shapes_of,
    transpose_weights,
)
from .tracing import is_tracing
from .triton_kernels import _linear as triton_linear
from .triton_kernels import backward_steps_refusal as triton_backward_steps_refusal
from .triton_kernels import memory_step as triton_memory_step
from .triton_kernels import memory_write_backward as triton_memory_write_backward
from .triton_kernels import on_device
from .triton_kernels import selected as triton_selected
from .triton_kernels import self_check as triton_self_check
from .triton_kernels import self_check_needed as triton_self_check_needed
from .triton_kernels import self_check_passed as triton_self_check_passed
from .triton_kernels import sizes_fit as triton_sizes_fit
from .triton_kernels import step as triton_step
from .triton_kernels import step_backward as triton_step_backward
from .triton_kernels import steps_refusal as triton_steps_refusal
from .triton_kernels import unit_rms as triton_unit_rms
from .triton_kernels import usable_memory as triton_usable_memory

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------------
# Backends: which implementation runs each part of a window, chosen once per window
# --------------------------------------------------------------------------------------------------

TRITON, C_KERNELS, TORCH_OPS = "triton", "c kernels", "torch ops"
C_STEP = "c step kernels"  # the whole no-grad step of a small batch in one C call (`memory_kernels.StepPlan`)
INFERENCE_GRAPHS, TRAINING_GRAPHS = "inference", "training"


class Backends(NamedTuple):
    """Which backend runs each part of one window, as `choose_backends` chose it; the last eager window's is
    `model.model.last_recurrence_backends` (None after a window on the plain path)."""

    step: str  # the forward steps: TRITON (`triton_kernels.step`), C_STEP (`memory_kernels.StepPlan.step`,
    # no-grad windows of up to `MAX_STEP_ROWS` rows on CPU) or TORCH_OPS (`recurrence_step._step`)
    step_backward: str | None  # the backward steps, likewise (`step_backward`, `_step_backward`); None: no autograd
    memory: str | None  # the memory half of the torch-ops steps and its gradient: TRITON, C_KERNELS or
    # TORCH_OPS (a Triton step runs Triton's memory kernels itself); None without memory
    graphs: str | None  # INFERENCE_GRAPHS (`cuda_graphs.window_forward`), TRAINING_GRAPHS
    # (`cuda_graphs.TrainingSweep`) or None
    triton_refused: str | None = None  # why Triton, selected for this window's device, does not run all of its
    # steps (the part it leaves to the torch ops and why: inputs or sizes its kernels do not take, a failed
    # self-check); logged once per reason at info level. None: Triton runs them all, or was not selected


def memory_backend(memory: torch.Tensor, *others: torch.Tensor, triton: bool = True, c_kernels: bool = True) -> str:
    """Who runs the memory half of a step (and its gradient) for M (BH, dk, dv) and the other inputs:
    `TRITON` (`triton_kernels`: CUDA tensors with triton installed, unless GPN_TRITON=0; on CPU only when
    forced with GPN_TRITON=1 under TRITON_INTERPRET=1, as the tests do), else `C_KERNELS` (`memory_kernels`:
    float32 CPU tensors with a C compiler, unless GPN_MEMORY_KERNELS=0), else `TORCH_OPS` (the reference).
    `triton=False`: not Triton (its self-check failed for these sizes and dtype, or the model's `use_triton` is
    off); `c_kernels=False`: not the C kernels (the model's `use_c_kernels` is off)."""
    if triton and triton_selected(memory, *others) and triton_usable_memory(memory, *others):
        return TRITON
    if c_kernels and memory_kernels_usable(memory, *others):
        return C_KERNELS
    return TORCH_OPS


def choose_backends(
    model: torch.nn.Module,
    U: torch.Tensor,
    p0: torch.Tensor,
    g0: torch.Tensor,
    M0: torch.Tensor,
    mask: torch.Tensor | None,
    s: Shapes,
    needs_grad: bool,
    matmul_dtype: torch.dtype | None,
    packed: bool = False,
) -> Backends:
    """Which backend runs each part of a window (the one place the fast path chooses), from its inputs:
    the float32 token inputs U (B, T, d), the state before it (float32, contiguous), the mask, the sizes,
    whether it needs gradients and autocast's matmul dtype. The device decides first (Triton on CUDA, or
    on CPU when forced through its interpreter; never under torch.compile, nor for sizes and a dtype whose
    self-check failed; the C kernels on float32 CPU
    tensors where they build), then whether the kernels take these inputs and sizes (every step of the
    window then: the states and records the steps make are contiguous float32, see `recurrence_step`).
    CUDA graphs run unmasked windows when asked for (`cuda_graphs.asked`) on the Triton backend: no-grad
    windows outside autocast (the captured weights are the model's own dtype), training windows without
    truncated BPTT; never `packed` windows (sequences starting inside rows: their steps reset the state,
    which the graphs' static steps do not), and no training graphs under saved-tensor hooks (their static buffers
    keep the boundaries, which the hooks would not see). (Module wrappers, hooks and tracing were decided before: the
    plain path runs them, `GPNModel.recurrence_path`.)"""
    # (the kernels were checked against the torch ops for these sizes, dtype and device before: `self_check`)
    selected = model.use_triton and triton_selected(U)
    triton = selected and triton_self_check_passed(s, matmul_dtype or model.fuse_gate.weight.dtype, U.device)
    refusal = None  # (what the selected Triton leaves to the torch ops, and why: said, never silent)
    if selected and not triton:
        refusal = "all", "its self-check failed for these sizes and dtype (`triton_kernels.self_check_failures()`)"
    c_kernels = model.use_c_kernels
    steps_refusal = triton_steps_refusal(s, U, p0, g0, M0) if triton else None
    if steps_refusal is not None:
        refusal = "the forward and backward steps" if needs_grad else "the steps", steps_refusal
    step = TRITON if triton and steps_refusal is None else TORCH_OPS
    if step == TORCH_OPS and c_kernels and step_kernels_fit(U, s, needs_grad, matmul_dtype, packed):
        step = C_STEP
    step_backward = None
    if needs_grad:
        # Triton's backward reads the records of Triton's forward steps (row-major rows); the torch-ops step's
        # records follow their inputs' layout (a window whose token inputs have the batch innermost makes
        # column-major ones), which the kernels would read as garbage: it runs behind Triton's steps only
        backward_refusal = triton_backward_steps_refusal(s, U) if step == TRITON else None
        step_backward = TRITON if step == TRITON and backward_refusal is None else TORCH_OPS
        if backward_refusal is not None:
            refusal = "the backward steps", backward_refusal
    memory = (
        memory_backend(M0.view(-1, s.key_dim, s.value_dim), U, triton=triton, c_kernels=c_kernels) if s.memory else None
    )
    graphs = None
    graphs_possible = mask is None and not packed and triton and triton_sizes_fit(model.config)
    if graphs_possible and graphs_asked(model, training=needs_grad):
        if not needs_grad and matmul_dtype is None:
            graphs = INFERENCE_GRAPHS
        elif needs_grad and not model.config.bptt_truncation_length and not saved_tensors_hooks_active():
            graphs = TRAINING_GRAPHS
    triton_refused = None
    if refusal is not None:
        triton_refused = "Triton leaves {} of this window to the torch ops: {}".format(*refusal)
        log_once(logger, model, f"GPN: {triton_refused}")
    return Backends(step, step_backward, memory, graphs, triton_refused)


def log_once(log: logging.Logger, model: torch.nn.Module, message: str) -> None:
    """`log.info(message)` the first time `model` meets it: why the fast path, or a backend of it, gives way is said
    once per reason and model (`GPNModel.recurrence_path`, `choose_backends`), not at every window."""
    logged = model.__dict__.setdefault("_gpn_logged_reasons", set())
    if message not in logged:
        logged.add(message)
        log.info(message)


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are active on this thread (`torch.autograd.graph.saved_tensors_hooks` and what
    is built on it: `save_on_cpu`, TRL's activation offloading, `checkpoint(use_reentrant=False)`), which see only
    what a backward keeps through `save_for_backward`. (torch's private query; were it gone, assume they are.)"""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


# (C-level and module-level reads, cheap enough for every decoded token: benchmarks/RESULTS.md, "The decode path
# after the cache claim and the autograd-mode check")
_functorch_level = getattr(torch._C._functorch, "maybe_current_level", None)
_forward_ad = torch.autograd.forward_ad


def autograd_mode_blocker() -> str | None:
    """Why the fast path cannot honour the autograd mode active now, or None where it can.

    The C kernels read the tensors' memory and write plain results, the Triton kernels likewise, and the
    custom autograd Function has a hand-written backward only: under a torch.func transform (grad, vjp,
    jvp, vmap: its tensors are wrappers without storage, which the kernels cannot read and the transform
    cannot see through) or forward-mode AD (`torch.autograd.forward_ad.dual_level`, which propagates tangents
    under `no_grad` too) they would drop the tangents or the batching in silence, or fail obscurely. The
    plain path, made of torch ops, honours both. (torch's private queries, read where they exist: the level
    of the innermost functorch transform, and forward AD's open dual level.)"""
    if _functorch_level is not None and _functorch_level() is not None:
        return "a torch.func transform (grad, vjp, jvp, vmap, ...) is active, which the fast path's kernels cannot see through"
    if getattr(_forward_ad, "_current_level", -1) >= 0:
        return "forward-mode AD (torch.autograd.forward_ad.dual_level) is active: the fast path's kernels carry no tangents"
    return None


def foldable_parameter(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter) -> bool:
    """Whether the fast path takes `parameter` (`module.<name>`) as the plain loop would use it: a plain
    nn.Parameter (or None), or the weight of an nn.Linear quantized by torchao's int8 weight-only config
    (exactly that tensor class and layout: `recurrence_step.int8_weight_parts`), which the C step kernels
    multiply as it is and the torch-ops steps dequantize, or by its low-bit weight-only config (int4, ...:
    `recurrence_step.dequantized_by_linear`), whose dequantized matrix every backend multiplies, but the C kernels,
    which multiply int4 values packed as int4 where they can (`memory_kernels.int4_operand`). Any other
    tensor subclass keeps the plain path (`GPNModel.fast_path_blocker`), which calls the module."""
    if parameter is None or type(parameter) is torch.nn.Parameter:
        return True
    return (
        name == "weight"
        and type(module) is torch.nn.Linear
        and (int8_weight_parts(parameter) is not None or dequantized_by_linear(parameter))
    )


def step_kernels_enabled() -> bool:
    """Whether the C step kernels may run (`GPN_STEP_KERNELS=0` turns them off, for A/B runs and tests; the
    C memory kernels' own switch, GPN_MEMORY_KERNELS=0, turns off both: they are one library)."""
    return not switched_off("GPN_STEP_KERNELS")


def step_kernels_fit(
    U: torch.Tensor, s: Shapes, needs_grad: bool, matmul_dtype: torch.dtype | None, packed: bool
) -> bool:
    """Whether a window goes to the C step kernels (`C_STEP`): no gradient (they keep no records), float32 CPU
    inputs, at most `MAX_STEP_ROWS` rows (a larger batch amortises the weight read in a matmul), no autocast
    (they multiply in the weights' own dtype), no packed sequences, and the kernels built. (Whether they take
    the model's weights is asked when the window's `StepPlan` is built; a refusal runs the torch ops.)"""
    if needs_grad or packed or matmul_dtype is not None or not 1 <= s.batch <= MAX_STEP_ROWS:
        return False
    return step_kernels_enabled() and memory_kernels_usable(U)


def _step_plan(model: torch.nn.Module, derived: dict, rows: int) -> StepPlan | None:
    """The `StepPlan` of `rows` rows for this scope (`derived_weights.py`), built on first use; None where the
    kernels refuse the model's weights (remembered for the scope, so the refusal costs one try)."""
    plans = derived.setdefault("step plans", {})
    if rows not in plans:
        try:
            with torch.no_grad():
                plans[rows] = StepPlan(model, rows)
        except KernelRefusal:
            plans[rows] = None
    return plans[rows]


def _carried_key(derived: dict, g0: torch.Tensor) -> torch.Tensor | None:
    """The key pre-activation of `g0` if this scope's last window ended on exactly this grounded state (a
    decode loop's next token, a prompt's next chunk): that window computed it with these weights. None: the
    first step computes it (one more read of the key matrix)."""
    last = derived.get("last key")
    if last is not None and last[0].shape == g0.shape and torch.equal(last[0], g0):
        return last[1]
    return None


def _decoded_key(derived: dict, plan: DecodePlan, g0: torch.Tensor) -> torch.Tensor | None:
    """The key of the grounded state `g0` for a one-call token: the plan's own key buffer where the last such
    token left it for exactly this state (the same tensor, not written since: a decode loop's next token),
    else as `_carried_key` finds it (a prompt's last window), else None (the call computes it)."""
    decoded = derived.get("decoded key")
    version = version_of(g0)  # (None: an inference tensor, whose writes nothing tracks: never "not written since")
    if (
        decoded is not None
        and decoded[0] is g0
        and version is not None
        and decoded[1] == version
        and decoded[2] is plan.key
    ):
        return plan.key
    return _carried_key(derived, g0)


def _few_rows_on_kernels(x: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a product of `x` (..., K) may run on the C kernels: 1 to `MAX_STEP_ROWS` float32 CPU rows, no
    autograd through it, not traced or compiled, the kernels built and switched on."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *tensors)))
        # (before the rows are counted: under torch.export or a dynamic compile they are symbolic, and comparing
        # them made the traced program guard on its batch size, refusing rows on the other side of the limit)
        and not is_tracing()
        and 1 <= x.numel() // max(1, x.shape[-1]) <= MAX_STEP_ROWS
        and step_kernels_enabled()
        and memory_kernels_usable(x)
    )


def _plain_linear(module: torch.nn.Module) -> bool:
    """`module` is exactly an nn.Linear with no hooks of its own or global ones and no `forward` of its instance
    (what the C kernels compute as it would; a wrapper, adapter, hook or patched forward is never skipped)."""
    return type(module) is torch.nn.Linear and called_as_is(module) and registered_global_hook() is None


def fast_project(module: torch.nn.Module, x: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """`module(x.to(its weight's dtype)).float()` (`modeling_gpn.project`), for a few rows of a plain
    nn.Linear (float32, bfloat16, torchao int8 or low-bit weight-only weight; no hooks) without autograd on the C
    kernels when `fast` (the model's `use_fast_path`): a decoded token's decoder and token projections, which
    torch's and torchao's int8 linear run far below the bandwidth limit at these sizes (a call's fixed cost
    is larger than its product).
    Anything else calls the module. (A PEFT LoRA layer merged in place whose forward is provably its base layer's
    is that base layer: `derived_weights.merged_lora_base`, asked only where the kernels may run, not under tracing,
    where dynamo refuses its read of the LoRA class's `__dict__` (under `fullgraph=True`, once the model ran eagerly).)"""
    if fast and not is_tracing():
        module = as_read(module)
    weight = getattr(module, "weight", None)
    if (
        fast
        and isinstance(weight, torch.Tensor)
        and _plain_linear(module)
        and _few_rows_on_kernels(x, *module.parameters())
    ):
        try:
            return module_rows(module, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], -1)
        except KernelRefusal:
            pass
    if isinstance(weight, torch.Tensor) and weight.is_floating_point():
        x = x.to(weight.dtype)
    return module(x).float()


def output_logits(decoded: torch.Tensor, weight: torch.Tensor, fast: bool = True) -> torch.Tensor:
    """`F.linear(decoded.to(weight.dtype), weight)`: the logits of decoded states (..., e) against the output
    matrix (vocab, e). For a few rows (up to `MAX_STEP_ROWS`; decoding) of a plain float32 or bfloat16 CPU
    matrix without autograd, on the C kernels (`memory_kernels.linear_rows`: torch's matrix-vector product
    reads the matrix at a fraction of the machine's bandwidth) when `fast` (the model's `use_fast_path`);
    anything else, and whatever the kernel refuses, through `F.linear` itself."""
    if fast and _few_rows_on_kernels(decoded, weight):
        try:
            return linear_rows(decoded.reshape(-1, decoded.shape[-1]), weight).view(*decoded.shape[:-1], -1)
        except KernelRefusal:
            pass
    return F.linear(decoded.to(weight.dtype), weight)


# --------------------------------------------------------------------------------------------------
# A decoded token in one C call
# --------------------------------------------------------------------------------------------------


def _plain_parameters(module: torch.nn.Module) -> bool:
    return all(type(p) is torch.nn.Parameter for p in module._parameters.values() if p is not None)


def decode_kernel_enabled() -> bool:
    """Whether a decoded token may run as one C call (`GPN_DECODE_KERNEL=0` turns it off, for A/B runs and
    tests: the step kernels then run it as before; `GPN_STEP_KERNELS=0` turns off both)."""
    return step_kernels_enabled() and not switched_off("GPN_DECODE_KERNEL")


def decode_lane_blocker(lm: torch.nn.Module, norm_class: type, methods: dict) -> str | None:
    """Why a decoded token of the causal LM `lm` cannot run as one C call (`fast_decode_token`), or None.

    The call computes the embedding row, the token and decoder projections, the step and the logits from
    the modules' weights without calling the modules, so every one of them must be exactly what it stands
    for: the step's modules as `GPNModel.fast_path_blocker` asks, the embedding an `nn.Embedding` (no
    `max_norm`, which renormalises rows as it looks them up), the two norms `norm_class` (the model's RMS
    norm), the projections plain `nn.Linear`s (float32, bfloat16 or torchao int8 weight-only weights), the head
    a bias-free `nn.Linear` whose weight is the embedding's (tied) or an `nn.Linear` with torchao's int8
    weight-only weight (a quantized head, which the forward calls as it is), none of them nor the base model
    hooked, no global module hook, and none of the `methods` it computes (by class: the base model's forward,
    the logits, the step's, ...; `replaced_method`) set on an instance, overridden or assigned to a class.
    Anything else runs the forward as usual, which calls every module and method."""
    model = lm.model
    embedding, head = model.embed_tokens, lm.lm_head
    fuse_proj, decode_proj = _projections(model)
    for name, module in (("lm_head", head), ("fuse_proj", fuse_proj), ("decode_proj", decode_proj)):
        if not _plain_linear(module):  # (no global hooks either)
            return f"{name} is not a plain nn.Linear without hooks"
    if type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None or not called_as_is(embedding):
        return "embed_tokens is not a plain nn.Embedding without hooks"
    if not _plain_parameters(embedding):
        return "embed_tokens has a weight that is not a plain nn.Parameter"
    tied = head.weight is embedding.weight and head.bias is None
    if not tied and int8_weight_parts(head.weight) is None and not dequantized_by_linear(head.weight):
        return "lm_head is neither the tied embedding nor a torchao weight-only head"  # (one of its own, quantized)
    for name in ("fuse_norm", "decode_norm"):
        norm = getattr(model, name)
        if type(norm) is not norm_class or not called_as_is(norm) or not _plain_parameters(norm):
            return f"{name} is not a plain {norm_class.__name__} without hooks"
    if not called_as_is(model):
        return "the base model is hooked or its forward replaced"
    for obj in (lm, model):
        method = replaced_method(obj, methods)
        if method is not None:
            return replaced_method_reason(type(obj).__name__, method)
    return model.fast_path_blocker()


def _projections(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The token and decoder projections of the base model `model` as a decoded token reads them: a PEFT LoRA layer
    merged in place whose forward is provably its base layer's as that base layer (`merged_lora_base`)."""
    return as_read(model.fuse_proj), as_read(model.decode_proj)


class DecodeLane(NamedTuple):
    """A scope's one-call decode of `rows` rows: its plan, and the modules it was built from as they were."""

    plan: DecodePlan | None  # None: the kernels refused the model's weights (remembered, so it costs one try)
    modules: WatchedModules


def _decode_lane(lm: torch.nn.Module, scope: DerivedWeights, rows: int, methods: dict) -> DecodeLane:
    """The `DecodeLane` of `rows` rows for this scope, built (after `decode_lane_blocker` found the modules plain)
    on first use, and again whenever its modules are no longer what they were."""
    model = lm.model
    # the modules as they are noted before anything is read from them (the scope's key, the plan's weights): an edit
    # another thread makes while the plan is built then differs from the note, and the next call builds anew; noted
    # after, it would match, and every later call continuing the cache would read what was there before the edit
    modules = WatchedModules(model, lm.lm_head, methods=methods, callers=(lm,))
    derived = scope.current(model)  # (dropping what older weights derived)
    lanes = derived.setdefault("decode lanes", {})
    lane = lanes.get(rows)
    if lane is None or not lane.modules.unchanged():
        plan = None
        step = _step_plan(model, derived, rows)
        if step is not None:
            fuse_proj, decode_proj = _projections(model)
            try:
                with torch.no_grad():
                    plan = DecodePlan(
                        step,
                        model.embed_tokens.weight,
                        model.config.vocab_size,
                        model.fuse_norm.weight,
                        fuse_proj,
                        model.decode_norm.weight,
                        decode_proj,
                        lm.lm_head.weight if lm.lm_head.weight is model.embed_tokens.weight else lm.lm_head,
                    )
            except KernelRefusal:
                pass
        lane = lanes[rows] = DecodeLane(plan, modules)
    return lane


def fast_decode_token(
    lm: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: GPNCache,
    norm_class: type,
    methods: dict,
) -> torch.Tensor | None:
    """The logits (B, 1, vocab) of one token a row decoded from `cache`, which it advances, in one C call
    (`memory_kernels.DecodePlan`: embedding row, token projection, step, decoder, logits), or None where this
    call is not such a step, or its modules or `methods` (by class, those it computes without calling them) are
    not as written (`decode_lane_blocker`): the caller then runs the
    forward as usual, which computes the same.

    Such a step: `input_ids` (B, 1) on the CPU, 1 <= B <= `MAX_STEP_ROWS`, no autograd, a cache holding a state
    of B rows, an attention mask whose columns are all real (or none), no autocast, nothing tracing the call (the
    forward asks that before it calls this). The ids and the mask are checked as the forward checks them (the
    same errors). What it derives lives in the scope of the forward or generate() call, or of the cache it
    continues (`derived_weights.py`), as on the fast path; within it, the modules' check is redone only when one
    of them changed (`WatchedModules`)."""
    if (
        input_ids.dim() != 2
        or input_ids.shape[1] != 1
        or not 1 <= input_ids.shape[0] <= MAX_STEP_ROWS
        or input_ids.dtype is not torch.int64
        or not input_ids.is_cpu
        or torch.is_grad_enabled()
        or autograd_mode_blocker() is not None  # (tangents, a transform's wrappers: the plain path, via the forward)
        or not getattr(cache, "has_state", False)  # (a GPNCache holding a state; anything else: the forward says)
        or autocast_dtype("cpu") is not None
    ):
        return None
    model, rows = lm.model, input_ids.shape[0]
    if not (model.use_fast_path and model.use_c_kernels and decode_kernel_enabled() and memory_kernels_available()):
        return None
    if attention_mask is not None and not _every_token_real(attention_mask, rows):
        return None  # (a padded row keeps its state: the forward's masked steps; a bad mask: the forward's error)
    # (the call writes the state's buffers in place: one call at a time, `GPNCache.claim`; released inline, no call
    # before the pop)
    claim, held = object(), cache.__dict__
    try:
        cache.claim(claim)
        if cache.carries_graph:  # (a state kept with its graph: written in place below, never the graph's tensors)
            cache.detach()
        p0, g0, M0 = cache.state_buffers()
        if p0.shape[0] != rows or p0.dtype is not torch.float32:
            return None  # (the forward says what is wrong)
        snapshot = snapshot_before_call(cache, model)  # (None: the model that advanced this state, the common case)
        with derived_weights_scope(model, kept_by=cache) as scope:
            lane = scope.entries.get("decode lanes", {}).get(rows)
            if lane is None or not lane.modules.unchanged():
                if decode_lane_blocker(lm, norm_class, methods) is not None:
                    return None
                lane = _decode_lane(lm, scope, rows, methods)
            if lane.plan is None:
                return None
            plan, derived = lane.plan, scope.entries
            key = _decoded_key(derived, plan, g0) if plan.step_plan.memory else None
            ids = input_ids.reshape(-1).contiguous()  # (a column sliced from a prompt is not contiguous)
            ids_hash = cache.step_hash(rows)  # (the cache's fingerprint, folded by the same call)
            # from here to `finish_writing` the state is advanced in place and its count and fingerprint follow: a
            # call interrupted in between (Ctrl-C) leaves the cache marked, refused from then on (`start_writing`)
            cache.start_writing()
            try:
                logits = plan(ids, StepState(p0, g0, key, M0), ids_hash)  # (the cache's state, advanced in place)
            except KernelRefusal:
                cache.finish_writing()  # (refused before writing anything)
                return None
            except IndexError:  # an id outside the vocabulary: the forward's own check says which
                cache.finish_writing()  # (refused before writing anything)
                check_input_ids(input_ids, model.config.vocab_size)
                raise
            derived["decoded key"] = (g0, version_of(g0), plan.key)
        cache.advanced_in_place(input_ids, hashed=ids_hash is not None)
        # whose state this is, for GPNCache.save; never PEFT's mixed-batch inference, whose hooks sit on adapter layers,
        # which are no plain modules (`decode_lane_blocker`): nothing to look for on the decoded token
        cache.note_model(model, look_for_mixed_adapters=False, snapshot=snapshot)
        keep_with(model, cache, scope)
        cache.finish_writing()
        object.__setattr__(model, "last_recurrence_path", "fast")
        object.__setattr__(model, "last_recurrence_backends", _DECODED_BACKENDS[plan.step_plan.memory])
        return logits.view(rows, 1, -1)
    finally:
        CLAIM_ATTRIBUTE in held and held[CLAIM_ATTRIBUTE] is claim and held.pop(CLAIM_ATTRIBUTE)


def _every_token_real(attention_mask: torch.Tensor, rows: int) -> bool:
    """Whether the mask (rows, seq) of a decoded token says every row's token is real (its last column all 1):
    one read of that column. (The forward's `check_attention_mask` runs several elementwise ops on it and asks
    again whether anything traces; what this does not pass, a padded row or a mask it refuses, goes there.)"""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dim() == 2
        and attention_mask.shape[0] == rows
        and attention_mask.shape[1] >= 1
        and attention_mask.select(1, -1).tolist().count(1) == rows
    )


_DECODED_BACKENDS = {memory: Backends(C_STEP, None, C_KERNELS if memory else None, None) for memory in (False, True)}


def _memory_half(
    Z: torch.Tensor,
    c: Columns,
    key: torch.Tensor,
    neg_decay_rate: torch.Tensor,
    memory: torch.Tensor,
    memory_out: torch.Tensor,
    eps: float,
) -> MemoryStep:
    """The memory half of a step on the C kernels (one head at a time, CPU): `memory_kernels.memory_step`,
    which checks every tensor it would read and refuses (`KernelRefusal`) what it cannot take; the torch
    ops compute that step instead."""
    try:
        return memory_step(Z, c, key, neg_decay_rate, memory, memory_out, eps)
    except KernelRefusal:
        return _memory_step_torch(Z, c, key, neg_decay_rate, memory, memory_out, eps)


def _memory_write_gradients(*arguments):
    """Gradients through the write and the reads of M' (`_memory_write_backward_torch`'s arguments and
    results) on the C kernels (one head at a time, CPU), or the torch ops where the kernel refuses them."""
    try:
        return memory_write_backward(*arguments)
    except KernelRefusal:
        return _memory_write_backward_torch(*arguments)


MEMORY_OPS = {
    TRITON: MemoryOps(triton_memory_step, triton_memory_write_backward),
    C_KERNELS: MemoryOps(_memory_half, _memory_write_gradients),
    TORCH_OPS: TORCH_MEMORY_OPS,
}
# the steps the CUDA graphs replay (on static buffers)
GRAPH_KERNELS = GraphKernels(triton_step, triton_step_backward, triton_unit_rms, triton_linear)


def step_functions(backends: Backends) -> tuple[Callable, Callable]:
    """(forward step, backward step) of `recurrence_step`'s contract that run a window as `backends` says:
    Triton's steps, or the torch-ops steps with the memory half on the chosen `MemoryOps`."""
    memory_ops = MEMORY_OPS[backends.memory or TORCH_OPS]
    step = triton_step if backends.step == TRITON else functools.partial(_step, memory_ops=memory_ops)
    if backends.step_backward == TRITON:
        return step, triton_step_backward
    return step, functools.partial(_step_backward, memory_ops=memory_ops)


# --------------------------------------------------------------------------------------------------
# Packed sequences: the state resets to zero where a sequence starts inside a row
# --------------------------------------------------------------------------------------------------


class SequenceStarts(NamedTuple):
    """Where packed sequences start in a window (`GPNModel`'s `sequence_starts`, see `packed_sequence_starts`
    in modeling_gpn.py), as the steps use it: right before step t the rows `at[t]` (B,) bool read the zero
    state, whose key pre-activation W_k rms(0) + b_k is the key bias, `key` (1, H*dk)."""

    at: dict  # step -> (B,) bool, only the steps where some row starts a sequence
    key: torch.Tensor

    @staticmethod
    def of(
        starts: torch.Tensor | None, w: FoldedWeights, s: Shapes, eps: float, device: torch.device
    ) -> SequenceStarts | None:
        """The sequence starts of a packed window, or None when `starts` is None (no packing)."""
        if starts is None:
            return None
        steps = starts.any(0).nonzero().flatten().tolist()  # (one look at the mask per window)
        zero = torch.zeros(1, s.hidden, dtype=torch.float32, device=device)
        key = key_from_grounded(zero, w, s, eps) if s.memory else zero[:, :0]
        return SequenceStarts({t: starts[:, t] for t in steps}, key)

    def reset(self, state: StepState, t: int) -> StepState:
        """`state` with the rows starting a sequence at step t set to the zero state (and its key)."""
        starting = self.at[t]
        rows = starting[:, None]
        p, g = state.p.masked_fill(rows, 0.0), state.g.masked_fill(rows, 0.0)
        if state.memory.dim() == 2:  # no memory: key and M are (B, 0)
            return StepState(p, g, state.key, state.memory)
        memory = state.memory.masked_fill(starting[:, None, None, None], 0.0)
        return StepState(p, g, torch.where(rows, self.key, state.key), memory)

    def cut(
        self, grads: StepState, t: int, record: dict, weight_grads: _WeightGrads, s: Shapes, eps: float
    ) -> StepState:
        """The backward of `reset` at step t: the gradients of the input state `grads` with the starting rows'
        zeroed (nothing flows into the state before a sequence start); their key came from the key bias, which
        gets their key gradient (the key weights get rms(0) = 0 of it), as at a truncation cut."""
        starting = self.at[t]
        if s.memory:
            weight_grads.add_key(_unit_rms(record["g"], eps), grads.key.masked_fill(~starting[:, None], 0.0))
        return StepState(*(x.masked_fill(starting.view(-1, *([1] * (x.dim() - 1))), 0.0) for x in grads))


# --------------------------------------------------------------------------------------------------
# Running a window's steps
# --------------------------------------------------------------------------------------------------


def _run_steps(
    U: torch.Tensor,
    mask: torch.Tensor | None,
    state: StepState,
    w: FoldedWeights,
    s: Shapes,
    eps: float,
    start: int,
    stop: int,
    step: Callable,
    outputs: torch.Tensor | None = None,
    gammas: torch.Tensor | None = None,
    records: list | None = None,
    memory_buffer: torch.Tensor | None = None,
    starts: SequenceStarts | None = None,
):
    """Steps start..stop-1 without autograd on `step` (the window's, `step_functions`); with `records` (a
    list) keep each step's saved values.

    `mask` is (B, T) bool or None; steps where every row is real run unmasked (no selects, no gradient
    splitting), which is every step of an unpadded batch. With `memory_buffer` (n, B, H, dk, dv) step j
    writes M' into slot j % n: n = 2 alternates two slots (the input M of a step must not be its output
    slot), n = stop - start keeps every M' of the run for its records. With `starts`, the rows starting a
    packed sequence at a step read the zero state there (`SequenceStarts.reset`)."""
    c = columns_of(s)
    masked_steps = set() if mask is None else {t for t, full in enumerate(mask.all(0).tolist()) if not full}
    for t in range(start, stop):
        saved = {} if records is not None else None
        out = None if memory_buffer is None else memory_buffer[(t - start) % memory_buffer.shape[0]]
        if starts is not None and t in starts.at:
            state = starts.reset(state, t)
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

BUFFER_POOL_ATTRIBUTE = "_gpn_buffer_pool"
# What the fast path keeps on a model between calls, all of it derived from the model's weights or sized for
# its calls: the weights kept with a cache (folded matrices, C plans holding raw pointers), the buffer pool, the
# CUDA graphs and their static buffers. A copy or a pickle of the model leaves them behind (`GPNPreTrainedModel.
# __getstate__`) and derives its own from its own weights: a copy's pointers would be the original's memory.
DERIVED_ATTRIBUTES = frozenset({KEPT_ATTRIBUTE, BUFFER_POOL_ATTRIBUTE, GRAPHS_ATTRIBUTE, SWEEPS_ATTRIBUTE})


class BufferPool:
    """Scratch buffers for the memory M that training calls hand back and reuse (on CPU).

    A training call writes every M' of its last segment into one buffer (400 MB for the small preset at
    batch 8 x 256); a fresh one each call costs a page fault on every page, several times the cost of the
    same writes into a reused buffer (benchmarks/RESULTS.md). A buffer is taken by one call and given back when that call's
    backward is done, so overlapping calls (two forwards, one backward) never share one; a call whose
    graph is dropped without backward simply never gives its buffer back. On CUDA the caching allocator
    already reuses memory, so the pool is not used there. `release()` frees what the pool holds."""

    def __init__(self):
        self.free: dict[tuple, list[torch.Tensor]] = {}

    @staticmethod
    def _key(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple:
        return tuple(shape), dtype, torch.device(device)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of this shape: a given-back one if there is one, else a new (uninitialised) one."""
        free = self.free.get(self._key(shape, dtype, device))
        if free:
            try:
                return free.pop()
            except IndexError:  # (another thread's call took the last one since: both training at once)
                pass
        return torch.empty(shape, dtype=dtype, device=device)

    def give_back(self, *buffers: torch.Tensor | None) -> None:
        """Return buffers (None skipped) for a later `take` of the same shape, dtype and device."""
        for buffer in buffers:
            if buffer is not None and buffer.device.type == "cpu":
                self.free.setdefault(self._key(buffer.shape, buffer.dtype, buffer.device), []).append(buffer)

    def release(self) -> None:
        """Drop every held buffer, freeing their memory."""
        self.free.clear()


def buffer_pool_of(model: torch.nn.Module) -> BufferPool:
    """The model's `BufferPool` (created on first use; `model._gpn_buffer_pool.release()` empties it)."""
    pool = getattr(model, BUFFER_POOL_ATTRIBUTE, None)
    if pool is None:
        pool = BufferPool()
        object.__setattr__(model, BUFFER_POOL_ATTRIBUTE, pool)
    return pool


# --------------------------------------------------------------------------------------------------
# The custom autograd function
# --------------------------------------------------------------------------------------------------


class WindowSettings(NamedTuple):
    """What `GPNRecurrenceFunction` runs a window with, besides its tensors (all chosen by the dispatcher)."""

    s: Shapes
    eps: float
    segment: int | None  # config.bptt_segment_length
    truncation: int | None  # config.bptt_truncation_length
    pool: BufferPool
    sweep: object | None  # the `cuda_graphs.TrainingSweep` running the steps on static buffers, or None
    sweep_owner: object | None  # what holds the sweep's buffers for this call (`TrainingSweep.take`)
    step: Callable  # the forward step (`step_functions`)
    step_backward: Callable  # the backward step


class GPNRecurrenceFunction(torch.autograd.Function):
    """Predicted states of a window, with a sequential state-gradient backward and batched weight gradients.

    Inputs: token inputs U (B, T, d), the initial state p0, g0, M0, the mask (B, T) bool or None, the packed
    sequences' starts (B, T) bool or None, static settings (`WindowSettings`: with the step functions the
    dispatcher chose), then the flattened `FoldedWeights`. Outputs: P (B, T, d), final p, g, M, and gamma (B, T, H)
    (gamma is a diagnostic output without gradient).
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        U: torch.Tensor,
        p0: torch.Tensor,
        g0: torch.Tensor,
        M0: torch.Tensor,
        mask: torch.Tensor | None,
        starts: SequenceStarts | None,
        settings: WindowSettings,
        *flat_weights,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run the window's steps on the chosen backends; saves what `backward` needs."""
        s, eps, segment, truncation, pool, sweep, sweep_owner, step, _ = settings
        w = _unflatten(flat_weights, s)
        B, T, d = U.shape
        ctx.input_dtype, ctx.device_type = U.dtype, U.device.type
        U = U.float()
        ctx.sweep_owner = sweep_owner
        if ctx.sweep_owner is not None:  # the steps on static buffers (CUDA graphs: `cuda_graphs.TrainingSweep`)
            assert starts is None, "packed windows never run on the training graphs (`choose_backends`)"
            sweep.load_weights(w)
            outputs, state, gammas, ctx.boundaries = sweep.forward(U, p0, g0, M0)
            ctx.settings, ctx.has_mask, ctx.hooked = settings, False, False  # (never under saved-tensor hooks)
            ctx.save_for_backward(U, g0, *flat_weights)
            ctx.mark_non_differentiable(gammas)
            return outputs, state.p, state.g, state.memory, gammas
        outputs = U.new_empty(B, T, d)
        gammas = U.new_zeros(B, T, s.heads) if s.memory else U.new_zeros(B, T, 0)
        # Under saved-tensor hooks (`save_on_cpu`, TRL's activation offloading, a non-reentrant checkpoint around
        # the model, your own) everything the backward needs goes through `save_for_backward`, which they see:
        # the boundary states are saved there, the last segment is recomputed like the others instead of keeping
        # its records, and what is derived from the weights and the starts is derived again in the backward.
        # Otherwise they are kept as attributes of ctx, which the hooks never see (memory not offloaded).
        ctx.hooked = hooked = saved_tensors_hooks_active()
        # the steps multiply by prepacked matrices where that is faster (`PackedMatrix`), packed once per call
        step_weights = _pack(w) if PackedMatrix.worthwhile(w, B) else w
        ctx.step_weights = None if hooked else step_weights
        key0 = key_from_grounded(g0, step_weights, s, eps) if s.memory else g0.new_zeros(B, 0)
        state = StepState(p0, g0, key0, M0)
        sequence_starts = SequenceStarts.of(starts, step_weights, s, eps, U.device)
        ctx.starts = None if hooked else sequence_starts
        seg = segment or T
        # M' goes into reused buffers: two alternating slots while running, one slot per step of a segment
        # whose records are kept (the last one here; backward reuses the same slots for every segment)
        alternating = pool.take((2, *M0.shape), U.dtype, U.device) if s.memory else None
        segment_memory = pool.take((min(seg, T), *M0.shape), U.dtype, U.device) if s.memory and not hooked else None
        boundaries, last_records = [], []
        for start in range(0, T, seg):
            if start > 0 and s.memory:  # the boundary must outlive the alternating slots
                state = state._replace(memory=state.memory.clone())
            boundaries.append(state)
            stop = min(start + seg, T)
            # the backward pass starts with the last segment: keep its records instead of recomputing them
            last = stop == T and not hooked
            buffer = (segment_memory[: stop - start] if last else alternating) if s.memory else None
            state = _run_steps(
                U,
                mask,
                state,
                step_weights,
                s,
                eps,
                start,
                stop,
                step,
                outputs,
                gammas if s.memory else None,
                last_records if last else None,
                buffer,
                sequence_starts,
            )
        ctx.settings = settings
        ctx.has_mask, ctx.has_starts = mask is not None, starts is not None
        ctx.boundary_count = len(boundaries)
        ctx.boundaries = None if hooked else boundaries
        ctx.last_records = None if hooked else last_records
        ctx.segment_memory = segment_memory
        ctx.save_for_backward(
            U,
            g0,
            *([mask] if mask is not None else []),
            *([starts] if hooked and starts is not None else []),
            *(x for boundary in (boundaries if hooked else ()) for x in boundary),
            *flat_weights,
        )
        ctx.mark_non_differentiable(gammas)
        # the final M sits in a slot that backward reuses: hand out a copy
        final_memory = state.memory.clone() if s.memory else state.memory
        pool.give_back(alternating)
        return outputs, state.p, state.g, final_memory, gammas

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        dP: torch.Tensor,
        dp_final: torch.Tensor,
        dg_final: torch.Tensor,
        dM_final: torch.Tensor,
        _dgamma: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        """Gradients of the inputs and flat weights, through the forward's backend."""
        # a backward called inside an autocast region would otherwise run the step matmuls in its dtype; the
        # backward runs on the forward's backend and GPU (autograd may call it from another thread)
        with autocast_off(ctx.device_type), on_device(dP if dP is not None else ctx.saved_tensors[0]):
            return GPNRecurrenceFunction._backward(ctx, dP, dp_final, dg_final, dM_final)

    @staticmethod
    def _backward(
        ctx: torch.autograd.function.FunctionCtx,
        dP: torch.Tensor,
        dp_final: torch.Tensor,
        dg_final: torch.Tensor,
        dM_final: torch.Tensor,
    ):
        if not ctx.hooked and ctx.boundaries[0] is None:  # (freed by the first backward, with the records and buffers)
            # (a spent carried cache continued where no check could see it reaches here too: the message names
            # that case's fix as well, since this backward cannot tell the two apart)
            raise RuntimeError(
                "GPN's fast recurrence frees what its forward saved while its backward runs, so it takes one "
                "backward per forward; for a second one (backward(retain_graph=True) twice, higher-order "
                "gradients) run the plain path: model.model.use_fast_path = False. If instead a forward continued "
                "a cache whose graph an earlier backward had already used, detach it between the two "
                "(cache.detach(): truncated BPTT)"
            )
        s, eps, segment, truncation, pool, sweep, _, step, step_backward = ctx.settings
        saved = ctx.saved_tensors
        if ctx.sweep_owner is not None:
            U, g0, flat_weights = saved[0], saved[1], saved[2:]
            records_kept = sweep.owner is not None and sweep.owner() is ctx.sweep_owner
            sweep.owner = weakref.ref(ctx.sweep_owner)  # the buffers are this call's until it returns
            try:
                dU, dp0, dg0, dM0, weight_grads = sweep.backward(
                    U, g0, _unflatten(flat_weights, s), ctx.boundaries, records_kept, dP, dp_final, dg_final, dM_final
                )
            finally:
                sweep.release()
            return (dU.to(ctx.input_dtype), dp0, dg0, dM0, None, None, None, *weight_grads)
        saved = list(saved)
        U, g0 = saved.pop(0), saved.pop(0)
        mask = saved.pop(0) if ctx.has_mask else None
        B, T, d = U.shape
        seg = segment or T
        if ctx.hooked:  # (everything came through the saved-tensor hooks: see the forward)
            starts = saved.pop(0) if ctx.has_starts else None
            boundaries = [StepState(*saved[4 * i : 4 * i + 4]) for i in range(ctx.boundary_count)]
            flat_weights = saved[4 * ctx.boundary_count :]
            w = _unflatten(flat_weights, s)
            step_weights = _pack(w) if PackedMatrix.worthwhile(w, B) else w
            sequence_starts = SequenceStarts.of(starts, step_weights, s, eps, U.device)
            memory = boundaries[0].memory
            segment_memory = pool.take((min(seg, T), *memory.shape), U.dtype, U.device) if s.memory else None
            last_records = None
        else:
            flat_weights = saved
            w = _unflatten(flat_weights, s)
            step_weights, ctx.step_weights = ctx.step_weights, None
            boundaries, sequence_starts, segment_memory = ctx.boundaries, ctx.starts, ctx.segment_memory
            last_records, ctx.last_records = ctx.last_records, None
        wt = transpose_weights(w, pack=PackedMatrix.worthwhile(w, B))
        first = boundaries[0]
        # (contiguous: autograd may hand in a strided gradient, and the backend chosen for the window takes
        # every step only with the contiguous gradients the steps themselves make)
        grad_or_zero = lambda g, like: g.contiguous() if g is not None else torch.zeros_like(like)
        grads = StepState(
            grad_or_zero(dp_final, first.p),
            grad_or_zero(dg_final, first.g),
            torch.zeros_like(first.key),
            grad_or_zero(dM_final, first.memory),
        )
        dU = torch.empty(B, T, d, dtype=torch.float32, device=U.device)
        weight_grads = _WeightGrads(w, B)
        c = columns_of(s)
        memory_grads = U.new_empty(2, *first.memory.shape) if s.memory else None  # alternating dL/dM slots
        for index in reversed(range(len(boundaries))):
            start = index * seg
            stop = min(start + seg, T)
            if stop == T and last_records is not None:
                records, last_records = last_records, None
            else:  # recompute the segment from its boundary, keeping what the backward steps need
                records = []
                buffer = None if segment_memory is None else segment_memory[: stop - start]
                _run_steps(
                    U,
                    mask,
                    boundaries[index],
                    step_weights,
                    s,
                    eps,
                    start,
                    stop,
                    step,
                    records=records,
                    memory_buffer=buffer,
                    starts=sequence_starts,
                )
            boundaries[index] = None
            for t in reversed(range(start, stop)):
                record = records.pop()
                if dP is not None:
                    grads = grads._replace(p=grads.p + dP[:, t])
                out = None if memory_grads is None else memory_grads[t % 2]
                grads, dU[:, t] = step_backward(record, grads, wt, s, c, eps, weight_grads, out)
                if sequence_starts is not None and t in sequence_starts.at:  # rows starting a packed sequence here
                    grads = sequence_starts.cut(grads, t, record, weight_grads, s, eps)
                if truncation and t % truncation == 0 and t > 0:
                    # the state is cut here, the weights are not: the key of step t (from g_{t-1}) still
                    # contributes to the key projection's gradient, but nothing flows into g_{t-1}
                    if s.memory:
                        weight_grads.add_key(_unit_rms(record["g"], eps), grads.key)
                    grads = StepState(*(torch.zeros_like(x) for x in grads))
        d_g0 = first_key_gradient(grads, g0, w, s, eps, weight_grads)
        pool.give_back(segment_memory)  # every record that pointed into it is gone
        ctx.segment_memory = None
        return (dU.to(ctx.input_dtype), grads.p, d_g0, grads.memory, None, None, None, *weight_grads.finish())


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast multiplies in on this device type, or None where autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (RuntimeError, TypeError, ValueError):  # a device type autocast does not know: no autocast there
        pass
    return None


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off on this device type (nothing to do where it is off already)."""
    if autocast_dtype(device_type) is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def fast_recurrence(
    model: torch.nn.Module,
    token_inputs: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    output_memory_decays: bool = False,
    sequence_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """Drop-in for `GPNModel.recurrence_plain` (same arguments, same results, same gradients).

    Returns the predicted states (B, T, d) float32, the final (p, g, M) and, if asked, gamma (B, T, H).
    Under autograd the gradient flows to `token_inputs`, the initial state and every parameter; gamma is
    returned without gradient. Under `torch.autocast` the step matrices multiply in the autocast dtype
    and everything else stays float32, as in the plain loop (see the module docstring). `sequence_starts`
    (B, T) bool: packed sequences start there, and those rows read the zero state at that step.
    Inference reuses the folded weights of the forward or generate() call it runs in (`derived_weights.py`).
    """
    device_type = token_inputs.device.type
    matmul_dtype = autocast_dtype(device_type)
    with autocast_off(device_type), on_device(token_inputs):  # (launches and captures on the inputs' GPU)
        return _fast_recurrence(model, token_inputs, state, mask, output_memory_decays, matmul_dtype, sequence_starts)


def _fast_recurrence(
    model: torch.nn.Module,
    token_inputs: torch.Tensor,
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    output_memory_decays: bool,
    matmul_dtype: torch.dtype | None,
    starts: SequenceStarts | None,
):
    config = model.config
    B, T, _ = token_inputs.shape
    s = shapes_of(model, B)
    eps = config.rms_norm_eps
    U = token_inputs.float()
    p0, g0, M0 = (x.float().contiguous() for x in state)
    if mask is not None:
        mask = mask.bool()
    if starts is not None:
        starts = starts.bool()
    # the weights derived from the parameters for this forward or generate() call (never an older one's)
    derived = derived_weights_of(model).current(model)
    if "misshapen weight" not in derived:  # (once per derivation: a replaced parameter derives afresh)
        derived["misshapen weight"] = misshapen_step_weight(model)
    if derived["misshapen weight"] is not None:
        raise ValueError(derived["misshapen weight"])
    folded = derived.setdefault("folded weights", {})
    if triton_selected(U):  # the kernels are checked against the torch ops once per device and sizes
        step_dtype = matmul_dtype or model.fuse_gate.weight.dtype
        if triton_self_check_needed(s, step_dtype, U.device):
            with torch.no_grad():
                w = cached_folded_weights(model, rows=B, matmul_dtype=matmul_dtype, variants=folded)
                triton_self_check(w, s, eps, U.device, step_dtype)
    needs_grad = torch.is_grad_enabled() and (
        token_inputs.requires_grad
        or any(x.requires_grad for x in state)
        or any(q.requires_grad for q in model.parameters())
    )
    backends = choose_backends(model, U, p0, g0, M0, mask, s, needs_grad, matmul_dtype, packed=starts is not None)
    if not needs_grad:
        plan = _step_plan(model, derived, B) if backends.step == C_STEP else None
        if backends.step == C_STEP and plan is None:  # the kernels refused the model's weights
            backends = backends._replace(step=TORCH_OPS)
        object.__setattr__(model, "last_recurrence_backends", backends)
        if plan is not None:  # the whole step in one C call, on the modules' own weights (nothing folded)
            with torch.no_grad():
                outputs = torch.empty(B, T, s.hidden, dtype=torch.float32, device=token_inputs.device)
                gammas = (
                    torch.zeros(B, T, s.heads, device=token_inputs.device)
                    if (s.memory and output_memory_decays)
                    else None
                )
                key0 = _carried_key(derived, g0) if s.memory else g0.new_zeros(B, 0)
                start = StepState(p0, g0, key0, M0)
                final = None
                if mask is None or bool(mask.all()):  # the whole window in one C call
                    try:
                        final = plan.steps(U, start, outputs, gammas)
                    except KernelRefusal:
                        pass
                if final is None:  # padded steps, a step at a time (padded rows keep their state)
                    alternating = M0.new_empty(2, *M0.shape) if (s.memory and T > 1) else None
                    final = _run_steps(
                        U, mask, start, None, s, eps, 0, T, plan.step, outputs, gammas, memory_buffer=alternating
                    )
            if s.memory:
                derived["last key"] = (final.g.clone(), final.key)
            return outputs, (final.p, final.g, final.memory), gammas
        # CUDA graphs (decoding: one replay a token)
        if backends.graphs == INFERENCE_GRAPHS:
            with torch.no_grad():
                w = cached_folded_weights(model, rows=B, variants=folded)
                return graph_window_forward(
                    model, U, (p0, g0, M0), output_memory_decays, kernels=GRAPH_KERNELS, w=w, derived=derived
                )
        step, _ = step_functions(backends)
        with torch.no_grad():
            w = cached_folded_weights(model, rows=B, matmul_dtype=matmul_dtype, variants=folded)
            outputs = torch.empty(B, T, s.hidden, dtype=torch.float32, device=token_inputs.device)
            gammas = (
                torch.zeros(B, T, s.heads, device=token_inputs.device) if (s.memory and output_memory_decays) else None
            )
            key0 = key_from_grounded(g0, w, s, eps) if s.memory else g0.new_zeros(B, 0)
            # M' alternates between two slots; a window of one token (decoding) writes a fresh tensor
            alternating = M0.new_empty(2, *M0.shape) if (s.memory and T > 1) else None
            starts = SequenceStarts.of(starts, w, s, eps, U.device)
            final = _run_steps(
                U,
                mask,
                StepState(p0, g0, key0, M0),
                w,
                s,
                eps,
                0,
                T,
                step,
                outputs,
                gammas,
                memory_buffer=alternating,
                starts=starts,
            )
        return outputs, (final.p, final.g, final.memory), gammas
    w = in_matmul_dtype(fold_weights(model), matmul_dtype)
    sweep = sweep_owner = None  # CUDA graphs for the training steps (opt-in; unmasked windows without truncation)
    if backends.graphs == TRAINING_GRAPHS:
        # (its segments as the window's when set, else `cuda_graphs.SWEEP_SEGMENT_LENGTH`: a sweep holds one
        # segment's memories, never the whole window's)
        sweep = training_sweep(model, B, config.bptt_segment_length, T, w, token_inputs.device, kernels=GRAPH_KERNELS)
        # (None where the graphs do not take these weights; no owner while another call holds the buffers)
        sweep_owner = sweep.take() if sweep is not None else None
        if sweep_owner is None:
            backends = backends._replace(graphs=None)
    object.__setattr__(model, "last_recurrence_backends", backends)
    step, step_backward = step_functions(backends)
    settings = WindowSettings(
        s,
        eps,
        config.bptt_segment_length,
        config.bptt_truncation_length,
        buffer_pool_of(model),
        sweep,
        sweep_owner,
        step,
        step_backward,
    )
    outputs, p, g, memory, gammas = GPNRecurrenceFunction.apply(
        token_inputs, p0, g0, M0, mask, starts, settings, *_flatten(w)
    )
    return outputs, (p, g, memory), (gammas if (s.memory and output_memory_decays) else None)
