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
