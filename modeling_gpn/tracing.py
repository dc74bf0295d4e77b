"""Whether a call is being traced (torch.compile, torch.export, torch.jit, torch.fx).

Under tracing the model runs its plain path (the fast path reads data pointers and calls C kernels) and
leaves out the input checks that depend on tensor values, which cannot be decided on symbolic tensors.
The model, its cache and the packed-sequence detection all ask this one question; the cache asks too whether
it is torch.export (`is_exporting`): an exported program stores the cache's state out of place.
"""

from __future__ import annotations

import torch


def is_tracing() -> bool:
    """Whether torch.compile, torch.export, torch.jit or torch.fx is tracing the current call."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    if is_exporting():
        return True
    is_fx_symbolic_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", None)
    return bool(is_fx_symbolic_tracing is not None and is_fx_symbolic_tracing())


def is_exporting() -> bool:
    """Whether torch.export (torch.onnx.export's dynamo exporter included) is tracing the current call."""
    exporting = getattr(torch.compiler, "is_exporting", None)
    return bool(exporting is not None and exporting())
