"""Where a GPN's weights are split: FSDP2 units, and devices a `device_map` places them on.

A GPN under FSDP2 with blocks of its recurrence sharded apart: every process must run as many steps.

`fully_shard` gathers a unit's weights in that unit's forward pre-hook. A unit the recurrence calls at every token
(a `GPNPredictLayer`, the `GPNMemoryWrite`, as `--fsdp_transformer_layer_cls_to_wrap` or a size policy shards them)
is therefore gathered once per token, forward and backward: processes whose batches have different lengths (a
collator padding each batch to its longest row, padding-free batches) make different numbers of collectives, which
pair up wrongly: gloo aborts ("Received data size doesn't match expected size"), NCCL may hang. The model sharded
as one unit (no auto-wrap policy) gathers once per call and takes any lengths.

Shipped to the Hub with `modeling_gpn.py` as remote code: it imports only torch.
"""

from __future__ import annotations

import torch


def check_sharded_lengths(
    model: torch.nn.Module, seq_len: int, called_once: tuple[str, ...], device: torch.device
) -> None:
    """Refuse, on every process alike, a call whose `seq_len` differs between the processes when FSDP2 shards a
    unit inside one of `model`'s children the recurrence calls at every token (all but those named in
    `called_once`). One all-reduce of two numbers per call, and only then; nothing outside a process group."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from torch.distributed.fsdp import FSDPModule

    unit = next(
        (
            module
            for name, child in model.named_children()
            if name not in called_once
            for module in child.modules()
            if isinstance(module, FSDPModule)
        ),
        None,
    )
    if unit is None:
        return
    group = _shard_group(unit)
    lengths = torch.tensor([seq_len, -seq_len], device=device)
    torch.distributed.all_reduce(lengths, op=torch.distributed.ReduceOp.MAX, group=group)
    longest, shortest = int(lengths[0]), -int(lengths[1])
    if longest != shortest:
        name = type(unit).__name__.removeprefix("FSDP")
        raise ValueError(
            f"FSDP2 shards {name} apart, which the recurrence gathers at every token, but the processes' inputs "
            f"have different lengths ({shortest} to {longest} tokens; this one {seq_len}): their collectives would "
            "not match. Pad every batch to one length (e.g. a collator's pad_to_multiple_of = max_length), or shard "
            "the model as one unit (no auto-wrap policy)"
        )


def sharded_save_refusal(model: torch.nn.Module, state_dict: dict | None) -> str | None:
    """Why `save_pretrained` cannot write `model` (or the `state_dict` given for it), or None: weights that FSDP2
    shards (DTensors, each process holding a part), where transformers does not gather them itself.

    transformers 5.24 gathers the shards only of a model it sharded (`config.distributed_config`); under Accelerate's
    FSDP2 (`accelerator.prepare`, `gpn train`'s launches) the model's own `save_pretrained` hands its state dict's
    DTensors to safetensors, which writes the config and code, then fails on the first weight ("Attempted to access
    the data pointer on an invalid python storage"): a folder without weights. (Its parameters may be gathered
    plain tensors at that moment, after a forward of the root unit, which does not reshard: the sharding is told by
    the modules.) Gathering them here would need every process in the call, and the usual call is the main
    process's alone."""
    if not torch.distributed.is_available():  # (no FSDP2 without it)
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    if getattr(model.config, "distributed_config", None) is not None:  # (transformers' own sharding: it gathers)
        return None
    if state_dict is not None:
        name = next((name for name, tensor in state_dict.items() if isinstance(tensor, DTensor)), None)
        if name is None:
            return None
        what = f"the state_dict given holds {name} as FSDP2 shards it (a DTensor: each process holds a part of it)"
    elif any(isinstance(module, FSDPModule) for module in model.modules()):
        what = "FSDP2 shards this model's weights (DTensors: each process holds a part of each)"
    else:
        return None
    return (
        f"{what}, which save_pretrained cannot write: gather the full weights on every process and pass them, as "
        "Accelerate documents it: `state_dict = accelerator.get_state_dict(model)`, then "
        "`accelerator.unwrap_model(model).save_pretrained(folder, is_main_process=accelerator.is_main_process, "
        "save_function=accelerator.save, state_dict=state_dict)`"
    )


def placement_warning(device_map: dict | None) -> str | None:
    """What to tell the user of a GPN that `from_pretrained(device_map=...)` placed on several devices, or offloaded
    to disk (transformers then dispatches it with accelerate's hooks), or None. The recurrence runs every block
    at each token, so such a model moves its activations between devices, or reads offloaded weights again, at
    every token, on the plain loop: correct, but far slower than the model on one device. `_no_split_modules`
    cannot keep it whole (it names what Accelerate's FSDP2 policy shards apart: modeling_gpn.py)."""
    if not device_map:
        return None
    places = sorted({str(place) for place in device_map.values()})
    if len(places) < 2 and "disk" not in places:
        return None
    return (
        f"device_map placed this GPN on {', '.join(places)}: its recurrence runs every block at each token, so every "
        "token moves activations between them (or reads offloaded weights again) on the plain loop, far slower than "
        'on one device; load it on one device (device_map="cuda:0" or "cpu") unless it does not fit'
    )


def _shard_group(unit: torch.nn.Module):
    """The process group a `fully_shard` unit gathers its weights over (the mesh dimension its weights are
    sharded on), or None (the default group) when that cannot be read."""
    from torch.distributed.tensor import DTensor, Shard

    weight = next((p for p in unit.parameters() if isinstance(p, DTensor)), None)
    if weight is None:
        return None
    mesh = weight.device_mesh
    dims = [dim for dim, placement in enumerate(weight.placements) if isinstance(placement, Shard)]
    return mesh.get_group(dims[0] if dims else 0) if mesh.ndim > 1 else mesh.get_group()
