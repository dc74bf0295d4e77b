"""What ran: the one place that knows how to observe each backend of the fast path.

A test that compares a fast implementation with its reference must also show that the fast one ran;
otherwise a silent fallback (to the plain loop, to the torch ops, to unpacked matrices) compares the
reference with itself and passes. Such a test wraps the fast call in one line:

    with ran(FAST_PATH, C_KERNELS):
        fast = run_recurrence(model, True, *problem)

and fails, naming what did not run, when a named backend was not used inside the block (`not_ran=`
asserts the opposite). `observe()` gives the counts themselves.

How each backend is observed (the code's own records where it keeps them, else a counting pass-through
wrapper around the real function for the duration of the block; nothing is replaced by a fake):
- FAST_PATH / PLAIN_PATH: `GPNModel.recurrence` calls, by the path `last_recurrence_path` reports,
  cross-checked against `GPNModel.recurrence_plain` (a call labelled "fast" that ran the plain loop is
  counted as plain); a decoded token run as one C call (DECODE_CALLS) is a fast-path call too.
- DECODE_CALLS: decoded tokens run as one C call, embedding row to logits (`memory_kernels.DecodePlan`,
  calls["decode"]); each is a whole step too (C_STEP_KERNELS).
- C_KERNELS, C_KERNELS_BACKWARD: `memory_kernels.calls`, the count of calls into the compiled library (the
  memory half's forward runs in `memory_step`, or inside the whole-step kernel `step`, which counts too).
- C_STEP_KERNELS: whole no-grad steps in one C call (`memory_kernels.StepPlan.step`, calls["step"]);
  INT8_STEPS those of them on int8 weights (calls["int8 step"]), INT4_STEPS those with int4 weights read as int4
  by the int4 products (calls["int4 step"]; not those on matrices dequantized from them).
- C_PRODUCTS: products of a few rows on the C kernels outside the step (the logits, the decoder and token
  projections: `memory_kernels.linear_rows` / `module_rows`, calls["linear"]).
- PREPACKED: products by a oneDNN-prepacked matrix (`recurrence_step.PackedMatrix.mm`).
- TRITON: `triton_kernels.launches`, the count of Triton kernel launches.
- TRAINING_SWEEP: training windows run on static buffers (`cuda_graphs.TrainingSweep.forward`).
- CHUNKED_LOSS: forwards of the chunked tied cross-entropy (`chunked_loss.ChunkedTiedCrossEntropy`).
When the code moves, only this file changes.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from collections.abc import Iterator

FAST_PATH = "fast path"
PLAIN_PATH = "plain path"
C_KERNELS = "C memory kernels (forward)"
C_KERNELS_BACKWARD = "C memory kernels (backward)"
C_STEP_KERNELS = "C step kernels"
INT8_STEPS = "C steps on int8 weights"
INT4_STEPS = "C steps on int4 weights read as int4"
C_PRODUCTS = "C few-row products"
DECODE_CALLS = "decoded tokens in one C call"
PREPACKED = "prepacked matrix products"
TRITON = "Triton kernel launches"
TRAINING_SWEEP = "training sweeps on static buffers"
CHUNKED_LOSS = "chunked loss"


class Observed(Counter):
    """How often each backend ran inside an `observe()` block (filled in as the block runs)."""

    def summary(self) -> str:
        return ", ".join(f"{name}: {count}" for name, count in sorted(self.items())) or "nothing observed"


@contextlib.contextmanager
def _wrapped(owner, name: str, wrapper_of, static: bool = False) -> Iterator[None]:
    """`owner.name` replaced for the block by `wrapper_of(real)`, a pass-through that counts. Where the fast path
    computes that method without calling it (`modeling_gpn.RECURRENCE_METHODS`, `DECODED_TOKEN_METHODS`), it
    would take the wrapper for a replacement it must call and step aside: the registries are told for the block
    that the wrapper is the method as written (it computes exactly what it wraps)."""
    from modeling_gpn import modeling_gpn

    real = owner.__dict__[name]
    function = real.__func__ if isinstance(real, staticmethod) else real
    wrapper = functools.wraps(function)(wrapper_of(function))
    listed = [
        methods
        for registry in (modeling_gpn.RECURRENCE_METHODS, modeling_gpn.DECODED_TOKEN_METHODS)
        for methods in registry.values()
        if methods.get(name) is real
    ]
    setattr(owner, name, staticmethod(wrapper) if static else wrapper)
    for methods in listed:
        methods[name] = wrapper
    try:
        yield
    finally:
        setattr(owner, name, real)
        for methods in listed:
            methods[name] = real


def _counting(seen: Observed, backend: str):
    def wrapper_of(real):
        def counted(*args, **kwargs):
            seen[backend] += 1
            return real(*args, **kwargs)

        return counted

    return wrapper_of


@contextlib.contextmanager
def observe() -> Iterator[Observed]:
    """Count, while the block runs, which paths and backends ran (see the module docstring)."""
    from modeling_gpn import chunked_loss, cuda_graphs, memory_kernels, recurrence_step, triton_kernels
    from modeling_gpn.modeling_gpn import GPNModel

    seen = Observed()
    plain_runs = [0]

    def recurrence_wrapper(real):
        def recurrence(self, *args, **kwargs):
            plain_before = plain_runs[0]
            result = real(self, *args, **kwargs)
            took_plain = plain_runs[0] > plain_before
            seen[PLAIN_PATH if took_plain or self.last_recurrence_path != "fast" else FAST_PATH] += 1
            return result

        return recurrence

    def plain_wrapper(real):
        def recurrence_plain(self, *args, **kwargs):
            plain_runs[0] += 1
            return real(self, *args, **kwargs)

        return recurrence_plain

    kernel_calls, launches = Counter(memory_kernels.calls), Counter(triton_kernels.launches)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_wrapped(GPNModel, "recurrence", recurrence_wrapper))
        stack.enter_context(_wrapped(GPNModel, "recurrence_plain", plain_wrapper))
        stack.enter_context(_wrapped(recurrence_step.PackedMatrix, "mm", _counting(seen, PREPACKED)))
        stack.enter_context(_wrapped(cuda_graphs.TrainingSweep, "forward", _counting(seen, TRAINING_SWEEP)))
        stack.enter_context(
            _wrapped(chunked_loss.ChunkedTiedCrossEntropy, "forward", _counting(seen, CHUNKED_LOSS), static=True)
        )
        try:
            yield seen
        finally:
            kernels = memory_kernels.calls - kernel_calls
            seen[C_KERNELS] += kernels["memory_step"] + kernels["step"]
            seen[C_STEP_KERNELS] += kernels["step"]
            seen[INT8_STEPS] += kernels["int8 step"]
            seen[INT4_STEPS] += kernels["int4 step"]
            seen[C_PRODUCTS] += kernels["linear"]
            seen[DECODE_CALLS] += kernels["decode"]
            seen[FAST_PATH] += kernels["decode"]
            seen[C_KERNELS_BACKWARD] += kernels["memory_write_backward"]
            seen[TRITON] += sum((triton_kernels.launches - launches).values())
            for name in [name for name, count in seen.items() if count == 0]:
                del seen[name]


@contextlib.contextmanager
def ran(*backends: str, not_ran: tuple[str, ...] = ()) -> Iterator[Observed]:
    """Fail at the end of the block unless each of `backends` ran in it and none of `not_ran` did."""
    with observe() as seen:
        yield seen
    missing = [name for name in backends if not seen[name]]
    assert not missing, f"{', '.join(missing)} did not run (observed: {seen.summary()})"
    present = [name for name in not_ran if seen[name]]
    assert not present, f"{', '.join(present)} ran though it should not have (observed: {seen.summary()})"
