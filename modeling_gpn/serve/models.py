"""transformers' serving model manager, able to build a GPN.

`transformers serve` builds every model with `getattr(transformers, config.architectures[0])`, so it stops at
start-up on a GPN (`module transformers has no attribute GPNForCausalLM`): the Auto classes' registry, where
`import modeling_gpn` registers GPN, is not consulted. The model manager's module holds its own reference to
the `transformers` module; `gpn serve` points it at `TransformersWithGPN`, transformers as it is with GPN's
classes beside its own, and leaves the model manager's code (loading, dtype, device map, quantization,
the idle timeout) as transformers wrote it.
"""

from __future__ import annotations

import types

import transformers
from transformers.cli.serving import model_manager

from .. import GPNForCausalLM, GPNModel

GPN_CLASSES = {cls.__name__: cls for cls in (GPNForCausalLM, GPNModel)}


class TransformersWithGPN(types.ModuleType):
    """The `transformers` module, with GPN's model classes found by name too."""

    def __init__(self):
        super().__init__(transformers.__name__, transformers.__doc__)

    def __getattr__(self, name: str):
        if name in GPN_CLASSES:
            return GPN_CLASSES[name]
        return getattr(transformers, name)


def make_gpn_loadable() -> None:
    """Point transformers' serving model manager at `TransformersWithGPN` (idempotent; for this process)."""
    if not isinstance(model_manager.transformers, TransformersWithGPN):
        model_manager.transformers = TransformersWithGPN()
