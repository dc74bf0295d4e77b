"""How long weights derived from a GPN's parameters may live: one forward call, or one `generate()` call.

The fast path does not call the step's modules: it multiplies by matrices derived from their parameters
(RMSNorm weights folded in, cast to autocast's dtype, prepacked for oneDNN, copied into a CUDA graph's static
buffers). Derived weights must never outlive the parameters they came from, whatever route changed them.
No key read from the parameters can promise that: writes through `.data` (PEFT's merge and unmerge, EMA and
weight averaging, many libraries' initialisation) change neither a parameter's storage nor its version
counter. So derived weights live only inside a *scope*, which no edit can be in the middle of:

- `GPNModel.forward` opens one around its recurrence (a forward folds once, however many windows, chunks or
  checks it runs);
- `GPNForCausalLM.generate` opens one around the whole generation (the prompt's forward folds, every decoded
  token reuses it: decoding pays no fold per token).

When the outermost scope of a model closes, what it derived is dropped; the next scope derives afresh from
the parameters as they are then. Inside a scope `parameters_key` still guards (an in-place update that bumps
a version, a storage or dtype change, made by a callback during generation, starts a new derivation).
Scopes are per thread and per model (two threads generating with one model derive separately).

This file ships to the Hub with the model: it imports only torch and the standard library.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch


def parameters_key(model: torch.nn.Module) -> tuple:
    """Each parameter's storage, version (bumped by every in-place update through the parameter itself, an
    optimizer step's too), dtype and device: a guard inside a scope, never a reason to reuse across scopes
    (writes through `.data` change none of it)."""
    return tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in model.parameters())


class DerivedWeights:
    """What one scope derived from one model's parameters: named entries (folded weight variants, which CUDA
    graphs got this scope's weights), all dropped together when the parameters' key changes."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.entries: dict = {}

    def current(self, model: torch.nn.Module) -> dict:
        """The entries derived from the parameters as they are now (emptied first if the key changed)."""
        key = parameters_key(model)
        if key != self.key:
            self.entries = {}
            self.key = key
        return self.entries


_scopes = threading.local()  # per thread: {id(model): [depth, DerivedWeights]}


def _open_scopes() -> dict:
    scopes = getattr(_scopes, "by_model", None)
    if scopes is None:
        scopes = _scopes.by_model = {}
    return scopes


@contextlib.contextmanager
def derived_weights_scope(model: torch.nn.Module) -> Iterator[DerivedWeights]:
    """Within this block (on this thread) the fast path reuses what it derives from `model`'s parameters;
    the outermost block's end drops it. Nested blocks share the outermost one's."""
    scopes = _open_scopes()
    entry = scopes.get(id(model))
    if entry is None:
        entry = scopes[id(model)] = [0, DerivedWeights()]
    entry[0] += 1
    try:
        yield entry[1]
    finally:
        entry[0] -= 1
        if entry[0] == 0:
            del scopes[id(model)]


def derived_weights_of(model: torch.nn.Module) -> DerivedWeights:
    """The derived weights of the scope open for `model` on this thread; outside any scope a fresh, empty
    one (so a call outside a scope derives afresh and keeps nothing)."""
    entry = _open_scopes().get(id(model))
    return entry[1] if entry is not None else DerivedWeights()
