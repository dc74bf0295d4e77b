"""What PEFT's layers do around a call that a GPN must know of: aLoRA's positions, ParamWrapper's parametrizations.

PEFT's adapters are modules a GPN calls like any other (the plain loop calls them; the fast path steps aside for
what it cannot read, `GPNModel.fast_path_blocker`). Two of PEFT 0.21's LoRA variants act on more than one call of a
module, and the step calls its modules once per position:

- aLoRA (`LoraConfig(alora_invocation_tokens=...)`) adapts only the positions from its invocation tokens on: PEFT
  hands each LoRA layer, through a forward pre-hook, each row's count of adapted positions at the end of the
  call's input (`alora_offsets`), and the layer masks its input's sequence dimension with them. A layer of the step
  sees one position (its input has none), so every adapted row was adapted at every position, before the
  invocation too (taken in silence: neither the base model's output nor the adapter's). A call whose offsets
  split its positions is refused (`refuse_split_alora_offsets`); one whose rows are adapted everywhere or nowhere
  computes what aLoRA means.
- LoRA on parameters (`LoraConfig(target_parameters=...)`, PEFT's `ParamWrapper`) registers a parametrization of
  the base layer's parameter for each call and removes it after, which bumps the parameter's version without
  changing its values: `state_file.weights_snapshot` reads those parameters by value (`cycled_parameters`).

Read by attribute and class name, so nothing here imports PEFT. This file ships to the Hub with the model: it
imports only torch and the standard library.
"""

from __future__ import annotations

import sys
import weakref

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .derived_weights import modules_below

ALORA_OFFSETS = "alora_offsets"
PEFT_PARAM_WRAPPER = ("peft.tuners.lora.layer", "ParamWrapper")


def hook_keyword(module: nn.Module, name: str) -> object | None:
    """The keyword `name` that a forward pre-hook of `module` holds (PEFT registers `functools.partial`s holding
    what it hands the layer for one call), the last one registered; None where none holds it."""
    value = None
    for hook in module._forward_pre_hooks.values():
        keywords = getattr(hook, "keywords", None)
        if isinstance(keywords, dict) and name in keywords:
            value = keywords[name]
    return value


# model -> {keyword: (`RemovableHandle.next_id` at the last walk over its modules, weak references to those whose hooks
# held the keyword then)}
_looks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def call_keyword(model: nn.Module, name: str) -> object | None:
    """The keyword `name` that PEFT hands the layers below `model` for the call now running, through forward
    pre-hooks (aLoRA's `alora_offsets`, mixed-batch inference's `adapter_names`): the first hooked module's, or None
    outside such a call.

    It is asked at every forward, decoded tokens too, and walking every module would cost a decode step more than it
    computes: the modules are walked only after some hook was registered (each registration, of any hook, takes a new
    `RemovableHandle.next_id`; PEFT registers its hooks for each call); in between only the modules found holding it
    then are looked at again (their hooks removed since: none)."""
    if "peft" not in sys.modules:  # (no PEFT hook without it)
        return None
    if torch.compiler.is_compiling():  # (a walk torch.compile traces: the weak references below it cannot guard)
        return next(
            (value for module in modules_below(model) if (value := hook_keyword(module, name)) is not None), None
        )
    registered = RemovableHandle.next_id
    looks = _looks.setdefault(model, {})
    look = looks.get(name)
    if look is None or look[0] != registered:
        hooked = [
            weakref.ref(module)
            for module in modules_below(model)
            if module._forward_pre_hooks and hook_keyword(module, name) is not None
        ]
        look = looks[name] = (registered, hooked)
    for ref in look[1]:
        module = ref()
        value = hook_keyword(module, name) if module is not None else None
        if value is not None:
            return value
    return None


def alora_offsets(model: nn.Module) -> list | None:
    """The aLoRA offsets PEFT hands the layers below `model` for the call now running (one per row: the number of
    positions at the end of the call's input to adapt, or None for none), or None outside such a call."""
    offsets = call_keyword(model, ALORA_OFFSETS)
    return None if offsets is None else list(offsets)


def refuse_split_alora_offsets(model: nn.Module, seq_len: int) -> None:
    """Refuse a call of `seq_len` positions in which PEFT's aLoRA adapts some row from a position other than the
    first (0 < offset < seq_len): the step's layers see one position at a time and cannot apply it there."""
    offsets = alora_offsets(model)
    if offsets is None:
        return
    split = [row for row, offset in enumerate(offsets) if offset is not None and 0 < int(offset) < seq_len]
    if split:
        raise ValueError(
            f"aLoRA (alora_invocation_tokens) adapts rows {split} of this call from their invocation tokens on "
            f"(the last {[offsets[row] for row in split]} of {seq_len} positions); a GPN's step calls its layers "
            "once per position, where PEFT cannot tell the positions apart, so it would adapt every position. "
            "Compute the state before the invocation without the adapter, then continue it with the adapter on: "
            "`with model.disable_adapter(): cache = model(input_ids=before, use_cache=True).cache`, then "
            "`model(input_ids=from_invocation, cache=cache)` or `model.generate(input_ids=from_invocation, "
            "cache=cache, attention_mask=...)` (the same state and logits aLoRA means)"
        )


def cycled_parameters(model: nn.Module) -> list[torch.Tensor]:
    """The parameters below `model` that a PEFT LoRA `ParamWrapper` parametrizes for each call (their version
    moves at every forward, their values do not), in module order."""
    if "peft" not in sys.modules:
        return []
    found = []
    for module in modules_below(model):
        kind = type(module)
        if (kind.__module__, kind.__name__) != PEFT_PARAM_WRAPPER:
            continue
        base = module.get_base_layer()
        parameter = base._parameters.get(module.parameter_name)
        if parameter is not None and all(parameter is not seen for seen in found):
            found.append(parameter)
    return found
