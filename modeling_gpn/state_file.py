"""The state file: a GPN's whole context, written by `GPNCache.save` and read by `GPNCache.load`.

A safetensors file (never pickle) holding p, g and M of every row in float32 and, as metadata, the number
of positions read, what identifies the model that computed the state (`state_fingerprint`: the
configuration fields that give the state its meaning, the weights' dtype, a hash of every parameter as
stored) and a checksum of the tensors and of the positions they read. Reading refuses, with a `GPNStateFileError` naming the file,
anything that could not be continued from: damaged or truncated files, files that are not GPN states,
another model's state, non-finite values. A file saved with its tokenizer named (`tokenizer_fingerprint`) is
refused to a continuation that names another: a state is the token ids it read, and another tokenizer's ids of the
same vocabulary size would be continued in silence as other words.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import safetensors.torch
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

from .atomic_files import write_file_atomically
from .configuration_gpn import GPNConfig
from .derived_weights import merged_lora_base, modules_below, parameters_key, version_of
from .peft_layers import call_keyword, cycled_parameters

STATE_FILE_FORMAT = "gpn-state"
# 2: the weights fingerprint hashes every parameter (1 hashed only the vectors, so a state loaded into the same
# model with other matrices, a merged LoRA's, unrefused), and the checksum covers the positions read.
STATE_FILE_VERSION = 2
# the largest header safetensors itself reads (its MAX_HEADER_SIZE): a longer one is no state file's
SAFETENSORS_HEADER_LIMIT = 100_000_000
# The files `from_pretrained` reads a folder's weights from unasked (transformers' SAFE_WEIGHTS_NAME,
# SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME): a state written under one of them into a model folder
# is read as its weights (model.safetensors first, before the shards an index names).
WEIGHTS_FILE_NAMES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
STATE_TENSOR_NAMES = ("predicted", "grounded", "memory")  # p, g, M: the order of the cache layer's states
# The configuration fields that give a state its meaning (what the recurrence computes and the shapes it
# keeps); training settings (BPTT, token ids, the window hint) do not change it.
STATE_CONFIG_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "embedding_size",
    "intermediate_size",
    "num_predict_layers",
    "use_memory",
    "num_memory_heads",
    "memory_key_dim",
    "memory_value_dim",
    "rms_norm_eps",
)
# `gpn generate --dtype`'s names of quantized weights -> the torchao class (torchao 0.18) its quantization makes: a
# state file names both (`weights_kind`, `dtype_name`), so that a refusal speaks the user's words
QUANTIZED_TENSORS = {"int8": "Int8Tensor", "int4": "IntxUnpackedToInt8Tensor"}
FLOAT_DTYPE_NAMES = ("float32", "bfloat16", "float16")  # `--dtype`'s names of float weights
# the fields `state_fingerprint` gives (a file of an earlier version of format 2 lacks the last two)
FINGERPRINT_FIELDS = (
    "state_config",
    "config_fingerprint",
    "weights_dtype",
    "weights_fingerprint",
    "unmerged_adapters",
    "dtype_name",
    "merged_adapters_hashed",
)


class GPNStateFileError(ValueError):
    """A GPN state file that cannot be continued from: damaged, truncated, another model's, or non-finite."""


@dataclass
class StateFile:
    """What a state file holds, checked: the state tensors (on the CPU), the positions read and the
    fingerprint of those positions as recorded ("unknown" when the cache did not know it)."""

    tensors: dict[str, torch.Tensor]
    positions_read: int
    read_fingerprint: str
    tokenizer_fingerprint: str | None = None  # None: saved without naming its tokenizer
    read_head: str | None = None  # the first call's head as recorded (`GPNCache.load` checks it); None: none


def state_shapes(config: GPNConfig) -> dict[str, tuple[int, ...]]:
    """The shape of each state tensor of one row (p, g, M; M is (0,) without memory)."""
    memory = (config.num_memory_heads, config.memory_key_dim, config.memory_value_dim) if config.use_memory else (0,)
    return {"predicted": (config.hidden_size,), "grounded": (config.hidden_size,), "memory": memory}


MAX_WRAPPERS = 4  # a PeftModel's GPNModel is 3 `base_model`s down; a cycle of wrappers ends here


def gpn_base_model(model: nn.Module) -> nn.Module:
    """The `GPNModel` under `model` (a `GPNForCausalLM` or the base model itself), or a TypeError.

    Known by its config's model type, not its class: a model loaded as the Hub's remote code has a `GPNConfig` of
    transformers' dynamic modules (sometimes two copies of it), never this package's. Wrappers are looked through
    by their `base_model`: a PEFT model (`PeftModel` -> its tuner -> the `GPNForCausalLM` -> the `GPNModel`) is
    the model a user generates with, so it is the one a state is loaded for."""
    base = model
    for _ in range(MAX_WRAPPERS):
        model_type = getattr(getattr(base, "config", None), "model_type", None)
        if model_type == GPNConfig.model_type and hasattr(base, "zero_state"):
            return base
        inner = getattr(base, "base_model", None)
        if not isinstance(inner, nn.Module) or inner is base:
            break
        base = inner
    raise TypeError(f"A GPN state belongs to a GPN model, got {type(model).__name__}")


# model -> (a glance at its parameters when hashed, their hash): a state is saved and loaded many times between two
# edits of the weights, and hashing them all (every byte of the model) once per edit is enough.
_weights_hashes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

TunerLayers = list[tuple[str, nn.Module]]  # PEFT's adapter layers below a model, by name (`_tuner_layers`)

GLANCE_VALUES = 4096  # values of each stored tensor read, evenly spaced, to tell whether it changed since hashed


def state_fingerprint(model: nn.Module) -> dict[str, str]:
    """What identifies the model (a `GPNModel`) a state belongs to, as safetensors metadata (strings).

    `state_config`: the `STATE_CONFIG_FIELDS` as JSON; `config_fingerprint`: its SHA-256; `weights_dtype`;
    `weights_fingerprint`: SHA-256 of every parameter as stored (a quantized weight's data and scales, an
    unmerged adapter's matrices), in order, and of PEFT's adapter settings (`adapter_settings`): two models that
    compute different states differ in it; `unmerged_adapters`: "yes" where PEFT adapters compute beside the
    weights (`computes_unmerged_adapters`), else "no", so that a refusal can say why a PeftModel's state is not its
    merged model's; `dtype_name`: the weights as `gpn generate --dtype` names them (`dtype_name`: "int8", "" where
    no name fits), so that a refusal across dtypes names both sides in the user's words; `merged_adapters_hashed`:
    "yes" where PEFT adapters merged in place are hashed beside the weights (`merged_in_place_as_stored`), so that
    a refusal can say why such a PeftModel's state is not its merge's.
    """
    return _fingerprint(model, None)


def _fingerprint(model: nn.Module, weights_fingerprint: str | None) -> dict[str, str]:
    """`state_fingerprint` of `model`; its weights' hash given, or None to hash them (`smallest_state_file_bytes_of`
    gives one as long, unhashed)."""
    layers = _tuner_layers(model)  # (found once, read by each part that reads the adapters)
    return {
        **config_fingerprint(model.config),
        "weights_dtype": weights_kind(model),
        "weights_fingerprint": weights_hash(model, layers=layers)
        if weights_fingerprint is None
        else weights_fingerprint,
        "unmerged_adapters": "yes" if computes_unmerged_adapters(model, layers=layers) else "no",
        "dtype_name": dtype_name(model),
        "merged_adapters_hashed": "yes" if merged_in_place_as_stored(model, layers=layers) else "no",
    }


def config_fingerprint(config: GPNConfig) -> dict[str, str]:
    """The part of `state_fingerprint` the configuration alone gives: `state_config` (the `STATE_CONFIG_FIELDS` as
    JSON) and `config_fingerprint` (its SHA-256)."""
    config_json = json.dumps({name: getattr(config, name) for name in STATE_CONFIG_FIELDS}, sort_keys=True)
    return {"state_config": config_json, "config_fingerprint": hashlib.sha256(config_json.encode()).hexdigest()}


def computes_unmerged_adapters(model: nn.Module, *, layers: TunerLayers | None = None) -> bool:
    """Whether some PEFT adapter of `model` computes apart from the weights it adapts (active, not disabled, not
    merged): such a model's states are not those of its merge (`merge_and_unload()`, as `gpn generate` runs an
    adapter folder) bit for bit, since the adapter's product added beside the weights rounds otherwise than the
    merged weights, and a continuation of one from the other's state would not be the run it continues.
    (`layers`: `model`'s adapter layers, where the caller has found them.)"""
    return any(
        not settings["disabled"] and set(settings["active"]) - set(settings["merged"])
        for settings in adapter_settings(model, layers=layers).values()
    )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 of a tokenizer's vocabulary (every token and its id, added tokens included): what a state's ids
    mean. Two loads of one tokenizer (from its folder, the Hub, a saved copy) give the same; another tokenizer of
    the same vocabulary size does not."""
    vocabulary = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.sha256(json.dumps(vocabulary, ensure_ascii=False).encode()).hexdigest()


def weights_kind(model: nn.Module) -> str:
    """The weights' dtype as a state file names it: `model.dtype` ("bfloat16"), and for a model with quantized
    weights (torchao's tensor subclasses, whose `dtype` is the float one they compute in) their kinds too:
    "bfloat16, quantized (Int8Tensor)". A state of int8 weights loaded beside bf16 ones is then refused naming
    both, not as "computed with bfloat16 weights", which sent users to load the model in bf16."""
    dtype = str(model.dtype).removeprefix("torch.")
    return named_weights_kind(dtype, {type(p).__name__ for p in model.parameters() if _quantized(p)})


def named_weights_kind(dtype: str, quantized: Iterable[str]) -> str:
    """`weights_kind` of a model of float `dtype` whose quantized weights are of the classes `quantized`."""
    quantized = sorted(quantized)
    return f"{dtype}, quantized ({', '.join(quantized)})" if quantized else dtype


def dtype_name(model: nn.Module) -> str:
    """The weights as `gpn generate --dtype` (and `gpn serve --dtype`) names them: "float32", "bfloat16", "float16",
    or "int8" / "int4" where every quantized weight is of that kind (`quantized_kind`); "" where no name fits
    (another dtype, another quantization, two kinds). A refusal across dtypes names both sides so, not by torchao's
    classes alone."""
    kinds = quantized_kinds(model)
    if kinds:
        return kinds.pop() if len(kinds) == 1 and kinds <= QUANTIZED_TENSORS.keys() else ""
    dtype = str(model.dtype).removeprefix("torch.")
    return dtype if dtype in FLOAT_DTYPE_NAMES else ""


def quantized_kinds(model: nn.Module) -> set[str]:
    """The `quantized_kind`s of `model`'s quantized weights ("int8", "int4", other classes' names); empty for a float
    model: what `dtype_name` and the tools' `quantized_as` read."""
    return {quantized_kind(parameter) for parameter in model.parameters()} - {""}


def quantized_kind(weight: torch.Tensor) -> str:
    """The one definition of a quantized weight's `--dtype` name: "int8" where `weight` is what `--dtype int8` makes
    (torchao's `Int8WeightOnlyConfig`: that class, `Int8Tensor`, not a subclass, of int8 values with one scale per
    output row, symmetric, no activation quantization), "int4" where it is what `--dtype int4` makes
    (`IntxWeightOnlyConfig` of int4 values: `IntxUnpackedToInt8Tensor` in groups along its rows, of any size, no
    activation quantization), on any device and of any float dtype (`weights_kind` names that); any other quantized
    weight by its class name; "" for a weight not quantized. `dtype_name` and the tools' `quantized_as` both read
    it, so that a state file and `--dtype` never name one model two ways; the fast path's recognisers
    (`recurrence_step.int8_weight_parts`, `dequantized_by_linear`) only say what it can compute, a narrower set.
    Read from the weight's own attributes (named, not imported: torchao stays optional), without its
    __torch_function__."""
    if not _quantized(weight):
        return ""
    kind = type(weight)
    name = kind.__qualname__
    if not kind.__module__.startswith("torchao.") or name not in QUANTIZED_TENSORS.values():
        return name
    held = weight.__dict__
    qdata, block = held.get("qdata"), tuple(held.get("block_size") or ())
    if not (isinstance(qdata, torch.Tensor) and qdata.dtype == torch.int8 and qdata.dim() == 2 and len(block) == 2):
        return name
    rows, cols = qdata.shape
    along_rows = block[0] == 1 and 0 < block[1] <= cols and cols % block[1] == 0
    if name == QUANTIZED_TENSORS["int8"]:
        zero_point = held.get("zero_point")
        with torch._C.DisableTorchFunctionSubclass():
            symmetric = zero_point is None or (isinstance(zero_point, torch.Tensor) and not bool(zero_point.any()))
        weight_only = all(held.get(part) is None for part in ("act_quant_kwargs", "act_pre_scale", "act_quant_scale"))
        return "int8" if along_rows and block[1] == cols and symmetric and weight_only else name
    weight_only = held.get("activation_quantization") is None
    return "int4" if along_rows and held.get("target_dtype") is torch.int4 and weight_only else name


def _quantized(parameter: torch.Tensor) -> bool:
    """Whether `parameter` is a quantized weight (a tensor subclass: torchao's)."""
    return is_traceable_wrapper_subclass(parameter.detach())


def weights_hash(model: nn.Module, as_stored: bool = False, *, layers: TunerLayers | None = None) -> str:
    """SHA-256 of `model`'s parameters as stored (names, shapes, dtypes and bytes; a quantized weight's inner tensors), recomputed when a glance says they changed since last hashed:
    their names, shapes and dtypes, the version counters every in-place write bumps (an optimizer step, `copy_`,
    `load_state_dict`), and `GLANCE_VALUES` evenly spaced values of each, for what writes through `.data` without
    a bump (EMA, weight averaging, PEFT's merge), which changes values all over a matrix. A model with PEFT
    adapters gets the hash of that hash and of its `adapter_settings` (read afresh each call: cheap).

    A model whose every adapter layer is PEFT's LoRA merged in place and provably its base layer's forward
    (`computes_as_its_merge`) computes its merge's states bit for bit (the fast path reads those base layers), so it
    gets its merge's hash (`merge_and_unload()`'s: the base layers' parameters under the names they take there, no
    adapter matrices or settings), and the two take each other's states. `as_stored`: the hash as an earlier version
    of format 2 wrote it for such a model too (its adapters hashed), which a load still accepts. (`layers`:
    `model`'s adapter layers, where the caller has found them.)"""
    layers = _tuner_layers(model) if layers is None else layers
    named = model.named_parameters()
    merged_in_place = not as_stored and computes_as_its_merge(model, layers=layers)
    if merged_in_place:
        named = _as_merged(named, [name for name, _ in layers])
    stored = [part for name, parameter in named for part in stored_tensors(name, parameter.detach())]
    glance = hashlib.sha256()
    for name, tensor in stored:
        flat = tensor.reshape(-1)
        glance.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{version_of(tensor)}".encode())
        glance.update(_tensor_bytes(flat[:: max(1, flat.numel() // GLANCE_VALUES)]))
    cached = _weights_hashes.get(model)
    if cached is None or cached[0] != glance.digest():
        digest = hashlib.sha256()
        for name, tensor in stored:
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
            digest.update(_tensor_bytes(tensor))
        cached = _weights_hashes[model] = (glance.digest(), digest.hexdigest())
    adapters = adapter_settings(model, layers=layers)
    if not adapters or merged_in_place:  # a model without adapters, or as its merge: the hash of its weights alone
        return cached[1]
    return hashlib.sha256(f"{cached[1]}/{json.dumps(adapters, sort_keys=True)}".encode()).hexdigest()


def computes_as_its_merge(model: nn.Module, *, layers: TunerLayers | None = None) -> bool:
    """Whether `model` has PEFT adapter layers and each is a LoRA layer merged in place whose forward is provably its
    base layer's (`derived_weights.merged_lora_base`: PEFT 0.21's `lora.Linear`, adapters not disabled, every active
    one merged, no hooks): the model then computes, on the fast path, `merge_and_unload()`'s states bit for bit.
    (`layers`: `model`'s adapter layers, where the caller has found them.)"""
    layers = _tuner_layers(model) if layers is None else layers
    return bool(layers) and all(merged_lora_base(layer) is not None for _, layer in layers)


def merged_in_place_as_stored(model: nn.Module, *, layers: TunerLayers | None = None) -> bool:
    """Whether some PEFT adapter of `model` is merged in place while the model is not taken for its merge
    (`computes_as_its_merge`): its fingerprint then hashes the adapters beside the merged weights. (`layers`:
    `model`'s adapter layers, where the caller has found them.)"""
    layers = _tuner_layers(model) if layers is None else layers
    return any(layer.merged_adapters for _, layer in layers) and not computes_as_its_merge(model, layers=layers)


def _as_merged(named: Iterable[tuple[str, torch.Tensor]], layers: list[str]):
    """`named` parameters as `merge_and_unload()` leaves them: those of each adapter layer of `layers` (names) but
    its base layer's left out, and the base layer's under the layer's name (`x.base_layer.weight` as `x.weight`)."""
    prefixes = sorted((f"{name}." for name in layers), key=len, reverse=True)  # (the innermost layer first)
    for name, parameter in named:
        prefix = next((prefix for prefix in prefixes if name.startswith(prefix)), None)
        if prefix is None:
            yield name, parameter
        elif name.startswith(f"{prefix}base_layer."):
            yield prefix + name.removeprefix(f"{prefix}base_layer."), parameter


def weights_snapshot(model: nn.Module) -> tuple:
    """What a model's weights are now, cheaply: each parameter's storage, version, dtype and device
    (`parameters_key`), PEFT's `adapter_settings` and a glance at its adapters' matrices (`adapter_glance`). A cache
    takes one when a model first advances it, and `GPNCache.save` compares: weights edited in place, replaced, cast
    or moved, or an adapter switched or swapped, after the state was computed would otherwise give a file naming the
    edited model. Other writes through `.data` (EMA, weight averaging) change none of it, as in `parameters_key`.

    A parameter that PEFT's `ParamWrapper` (`LoraConfig(target_parameters=...)`) parametrizes for each call has its
    version moved by every forward, its values left as they were (`peft_layers.cycled_parameters`): it is read by
    its values instead (a glance, as the adapters' matrices), or every state a forward leaves would be refused.

    The token embedding is glanced at too: the head, outside the `GPNModel`, is a view of that table, so PEFT's LoRA
    on `lm_head`, merged in place, writes the merge into it through `.data`, and no adapter layer below the model
    says so: the state computed before was saved naming the merged model, which then continued it as its own."""
    key = parameters_key(model)
    cycled = cycled_parameters(model)
    if cycled:
        ids = {id(parameter) for parameter in cycled}
        key = tuple(
            (k[0], None, *k[2:]) if id(parameter) in ids else k
            for parameter, k in zip(model.parameters(), key, strict=True)
        )
        key += (_glance(cycled),)
    return key, json.dumps(adapter_settings(model), sort_keys=True), adapter_glance(model), _table_glance(model)


def _table_glance(model: nn.Module) -> str:
    """`_glance` of `model`'s token embedding table (the head's weight: `weights_snapshot`), "" where it has none."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    table = getattr(embeddings, "weight", None)
    return _glance([table]) if isinstance(table, torch.Tensor) else ""


def _tuner_layers(model: nn.Module) -> TunerLayers:
    """PEFT's adapter layers (LoRA and its kin: `BaseTunerLayer`, recognized by attribute, so nothing here imports
    PEFT) below `model`, by name."""
    if not any(
        "merged_adapters" in vars(module) or hasattr(type(module), "merged_adapters") for module in modules_below(model)
    ):
        return []  # (no adapter layer: the common case, seen without building every module's name)
    # a tuner layer's are properties; a transformers model's `active_adapters()` (its own PEFT mixin) is a method
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "merged_adapters")
        and hasattr(module, "active_adapters")
        and not callable(module.active_adapters)
    ]


def adapter_glance(model: nn.Module) -> str:
    """A SHA-256 of `GLANCE_VALUES` evenly spaced values of each PEFT adapter matrix (a tuner layer's parameters
    but its `base_layer`'s), "" without adapters: PEFT's `hotswap_adapter` writes another adapter's matrices into
    the loaded one's through `.data`, which bumps no version and leaves the settings as they were, so the
    parameters' keys alone take the swapped model for the one that computed a state. Adapters are small, and the
    values are gathered into one tensor: one copy to the host."""
    return _glance(
        parameter
        for _, layer in _tuner_layers(model)
        for name, parameter in layer.named_parameters()
        if not name.startswith("base_layer.")
    )


def _glance(parameters: Iterable[torch.Tensor]) -> str:
    """A SHA-256 of `GLANCE_VALUES` evenly spaced values of each of `parameters` (but meta ones, offloaded: accelerate's
    hooks hold their values, and tensor subclasses), gathered into one tensor (one copy to the host); "" for none."""
    held = [p.detach() for p in parameters if not p.is_meta and not is_traceable_wrapper_subclass(p.detach())]
    if not held:
        return ""
    # (inside a torch.func transform, `functional_call` in `grad` or `jvp`: its wrappers' values read as plain
    # tensors, with storage, rather than as the transform's wrapped results, which have none to read bytes from)
    with torch._C._DisableFuncTorch():
        parts = [tensor.reshape(-1)[:: max(1, tensor.numel() // GLANCE_VALUES)].to(torch.float64) for tensor in held]
        return hashlib.sha256(_tensor_bytes(torch.cat([part.to(parts[0].device) for part in parts]))).hexdigest()


def adapter_settings(model: nn.Module, *, layers: TunerLayers | None = None) -> dict[str, dict]:
    """What PEFT's adapter layers (LoRA and its kin) compute with beyond their weights, by module name: the
    active adapters, whether adapters are disabled, which are merged, and LoRA's scaling.

    The adapters' matrices are parameters, hashed with the others; but a model holding two adapters computes
    another state with the other one active (`set_adapter`), and none of them inside `disable_adapter()`, with
    the same parameters. Read by attribute (PEFT's `BaseTunerLayer`), so nothing here imports PEFT. (`layers`:
    `model`'s adapter layers, where the caller has found them.)"""
    settings = {}
    for name, module in _tuner_layers(model) if layers is None else layers:
        scaling = getattr(module, "scaling", None)
        settings[name] = {
            "active": sorted(str(adapter) for adapter in module.active_adapters),
            "disabled": bool(module.disable_adapters),
            "merged": sorted(str(adapter) for adapter in module.merged_adapters),
            "scaling": {str(k): repr(v) for k, v in scaling.items()} if isinstance(scaling, dict) else None,
        }
    return settings


def mixed_batch_adapters(model: nn.Module) -> list | None:
    """The adapter of each row (a name, or "__base__") while PEFT's mixed-batch inference runs on any module below
    `model` (a `GPNModel`), else None: a state such a call computes is no state of the model as a whole, whose
    active adapter a state file would name (`GPNCache.save` refuses it). PEFT 0.21 (`_enable_peft_forward_hooks` of
    LoRA and its kin) hands `adapter_names` to every adapted layer for the call (`peft_layers.call_keyword`)."""
    return call_keyword(model, "adapter_names")


def _tensor_bytes(tensor: torch.Tensor):
    """A plain tensor's bytes as hashlib reads them (a view of a CPU copy; nothing for an empty tensor)."""
    return tensor.to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b""


def stored_tensors(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The plain tensors that hold `tensor`: itself, or a quantized weight's (a tensor subclass) inner tensors."""
    if not is_traceable_wrapper_subclass(tensor):
        return [(name, tensor)]
    inner_names, _ = tensor.__tensor_flatten__()
    return [part for inner in inner_names for part in stored_tensors(f"{name}.{inner}", getattr(tensor, inner))]


def write_state_file(
    path: Path,
    tensors: dict[str, torch.Tensor],
    positions_read: int,
    read_fingerprint: str,
    model_fingerprint: dict[str, str],
    tokenizer_fingerprint: str | None = None,
    read_head: str | None = None,
) -> None:
    """Write `tensors` (p, g, M on the CPU) as the state, after `positions_read`, of the model that
    `model_fingerprint` (`state_fingerprint` of a `GPNModel`) names, and of the tokenizer whose
    `tokenizer_fingerprint` is given (None: the file names none). `read_head`: the head of the cache's first call
    (`cache.ReadFingerprint.head`) as JSON, or None for none; outside the checksum, so that a file holding one reads
    where heads are not known, and checked on loading instead.

    Written through `atomic_files.write_file_atomically` (a temporary name unique to this call, fsynced and
    renamed), so an interrupted save never leaves a partial file at `path`, concurrent saves to one path each
    leave a whole file (the last rename wins), and an error names `path`. A file at `path` that is no state file
    is refused, not replaced (`check_replaceable`).
    """
    check_replaceable(path)
    if tensors["predicted"].shape[0] < 1:  # (a cache whose rows were all selected away): no load would take it
        raise ValueError(f"Cannot save {path}: the state holds no rows")
    if not all(bool(torch.isfinite(tensor).all()) for tensor in tensors.values()):
        raise ValueError(f"Cannot save {path}: the state holds NaN or infinite values")
    _check_model_fingerprint(model_fingerprint, path)
    payload = state_file_payload(
        tensors, positions_read, read_fingerprint, model_fingerprint, tokenizer_fingerprint, read_head
    )
    write_file_atomically(path, payload)


def state_file_payload(
    tensors: dict[str, torch.Tensor],
    positions_read: int,
    read_fingerprint: str,
    model_fingerprint: dict[str, str],
    tokenizer_fingerprint: str | None = None,
    read_head: str | None = None,
) -> bytes:
    """The bytes of the state file `write_state_file` writes (its arguments after the path, unchecked)."""
    metadata = {
        "format": STATE_FILE_FORMAT,
        "format_version": str(STATE_FILE_VERSION),
        "positions_read": str(positions_read),
        "batch_size": str(tensors["predicted"].shape[0]),
        "read_fingerprint": read_fingerprint,
        "checksum": _state_checksum(tensors, read_fingerprint, str(positions_read)),
        **model_fingerprint,
        **({"tokenizer_fingerprint": tokenizer_fingerprint} if tokenizer_fingerprint is not None else {}),
        **({"read_head": read_head} if read_head is not None else {}),
    }
    return _in_a_fixed_order(safetensors.torch.save(tensors, metadata=metadata))


def _in_a_fixed_order(payload: bytes) -> bytes:
    """A safetensors file's bytes with its header's entries, and its metadata's, in order of their names.

    safetensors writes the header from hash maps of its own, seeded afresh for each save: the same state saved twice
    (in one process, or in two) gave files whose bytes differed, so equal states could not be told equal by their
    files' hashes, and every save rewrote a cached copy. The tensors' offsets are relative to the data after the
    header, so the header is written again, padded with spaces to a multiple of 8 bytes as safetensors pads it, and
    the data left as it is."""
    length = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + length])
    metadata = header.pop("__metadata__", None)
    ordered = {
        **({"__metadata__": dict(sorted(metadata.items()))} if metadata is not None else {}),
        **dict(sorted(header.items())),
    }
    text = json.dumps(ordered, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + payload[8 + length :]


def smallest_state_file_bytes(config: GPNConfig, dtype: str, quantized: str | None = None) -> int:
    """The fewest bytes a state file of one row of a model of `config` can take, its weights of float `dtype`
    ("bfloat16") and, where `quantized` ("int8", "int4": `QUANTIZED_TENSORS`), quantized so by torchao (as `gpn
    generate --dtype int8` quantizes a bfloat16 model, or a folder saved through `TorchAoConfig` loads): the file
    `write_state_file` writes after one position read, its dtype named as `weights_kind` and `dtype_name` name it,
    the numbers of its metadata at their fewest digits and its hashes at their length. A longer history (more
    digits, the head of the first call) adds bytes, never removes any; known from the configuration alone, before
    the model loads (`gpn serve` refuses a --state-dir-bytes below it)."""
    if quantized is not None and quantized not in QUANTIZED_TENSORS:
        raise ValueError(f"cannot size a state of {quantized!r} weights: one of {', '.join(QUANTIZED_TENSORS)}")
    fingerprint = {  # (what `state_fingerprint` gives, its weights' hash as long as a SHA-256's)
        **config_fingerprint(config),
        "weights_dtype": named_weights_kind(dtype, [QUANTIZED_TENSORS[quantized]] if quantized else []),
        "weights_fingerprint": "0" * 64,
        "unmerged_adapters": "no",
        "dtype_name": quantized or (dtype if dtype in FLOAT_DTYPE_NAMES else ""),
        "merged_adapters_hashed": "no",
    }
    return _smallest_state_file_bytes(config, fingerprint)


def smallest_state_file_bytes_of(model: nn.Module) -> int:
    """The fewest bytes a state file of one row of `model` (a `GPNModel`, as loaded) can take, whatever its weights'
    dtype or quantization: `smallest_state_file_bytes` from the fingerprint its own state files carry (its dtype
    and quantized classes as `weights_kind` names them, its adapters), the weights' hash at its length (not
    hashed: the same bytes). Exact where the configuration alone cannot tell (a quantization other than torchao's
    int8 and int4, which a state file names by its tensors' classes)."""
    return _smallest_state_file_bytes(model.config, _fingerprint(model, "0" * 64))


def _smallest_state_file_bytes(config: GPNConfig, fingerprint: dict[str, str]) -> int:
    tensors = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in state_shapes(config).items()}
    tensors = {name: tensor.unsqueeze(0) for name, tensor in tensors.items()}  # (one row)
    return len(state_file_payload(tensors, 1, json.dumps([[0, 0]]), fingerprint))


def check_replaceable(path: str | os.PathLike) -> None:
    """Refuse (`GPNStateFileError`) to save a state over a file at `path` (through a link too) that holds something
    else (`gpn generate --save-state MODEL/model.safetensors` would replace the model's weights with a state).
    A state file of any format version, an empty file (`mktemp`'s) and no file at all may be replaced; a folder,
    device or pipe is left to the write, which refuses it (`atomic_files.replacing`). Nor is a state named as a
    model's weights written into a model folder, even where no file of that name is there (`refuse_a_weights_name`)."""
    try:
        status = os.stat(path)
    except OSError:  # (nothing there, or a dangling link: the rename replaces the link, nothing is lost)
        status = None
    if status is not None and stat.S_ISREG(status.st_mode) and status.st_size > 0:
        try:
            with open(path, "rb") as file:
                length = int.from_bytes(file.read(8), "little")
                header = json.loads(file.read(min(length, status.st_size - 8, SAFETENSORS_HEADER_LIMIT)))
            held = header.get("__metadata__", {}).get("format")
        except (OSError, ValueError, AttributeError, UnicodeDecodeError):
            held = None
        if held != STATE_FILE_FORMAT:
            raise GPNStateFileError(
                f"Cannot save a state to {path}: it holds a file that is not a GPN state ({status.st_size:,} bytes), "
                "which the state would replace; name another file, or remove that one first"
            )
    refuse_a_weights_name(path)


def refuse_a_weights_name(path: str | os.PathLike) -> None:
    """Refuse (`GPNStateFileError`) a state's `path` named as a model's weights file (`WEIGHTS_FILE_NAMES`) in a
    folder holding config.json: `from_pretrained` of that folder would read the state as its weights (with
    `--save-state SHARDED/model.safetensors` beside a sharded model's shards and index too: transformers reads
    model.safetensors before an index)."""
    place = Path(path)
    if place.name in WEIGHTS_FILE_NAMES and (place.parent / "config.json").is_file():
        raise GPNStateFileError(
            f"Cannot save a state to {path}: {place.parent} is a model folder (it holds config.json), where "
            f"from_pretrained reads {place.name} as the model's weights; name another file"
        )


def _check_model_fingerprint(fingerprint: dict[str, str], path: Path) -> None:
    """Refuse to write a file whose model fingerprint is not one `state_fingerprint` gives: no load would take it."""
    names = FINGERPRINT_FIELDS
    if not isinstance(fingerprint, dict) or sorted(fingerprint) != sorted(names):
        got = sorted(fingerprint) if isinstance(fingerprint, dict) else type(fingerprint).__name__
        raise ValueError(f"Cannot save {path}: a model fingerprint has the fields {list(names)}, got {got}")
    if not all(isinstance(value, str) for value in fingerprint.values()) or (
        hashlib.sha256(fingerprint["state_config"].encode()).hexdigest() != fingerprint["config_fingerprint"]
    ):
        raise ValueError(f"Cannot save {path}: the model fingerprint is not one state_fingerprint(model) gives")


def read_state_file(path: Path, model: nn.Module) -> StateFile:
    """Read and check the state file at `path` for `model` (a `GPNModel`); see the module docstring."""
    try:
        payload = _read_state_bytes(path)
    except OSError as error:
        raise GPNStateFileError(f"Cannot read the GPN state file {path}: {error.strerror or error}") from error
    metadata = _state_file_metadata(payload, path)
    try:
        tensors = safetensors.torch.load(payload)
    except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for damaged files
        raise GPNStateFileError(f"{path} is damaged or truncated: safetensors cannot read it ({error})") from error
    if sorted(tensors) != sorted(STATE_TENSOR_NAMES):
        raise GPNStateFileError(
            f"{path} is not a GPN state file: it holds tensors {sorted(tensors)}, not {list(STATE_TENSOR_NAMES)}"
        )
    read_fingerprint = metadata.get("read_fingerprint", "unknown")
    if metadata.get("checksum") != _state_checksum(tensors, read_fingerprint, metadata.get("positions_read", "")):
        raise GPNStateFileError(f"{path} is damaged: its tensors do not match the checksum recorded when it was saved")
    _check_state_belongs_to(metadata, model, path)
    batch_size = tensors["predicted"].shape[0]
    if batch_size < 1:
        raise GPNStateFileError(f"{path} holds a state of no rows: there is nothing to continue")
    expected = {name: (batch_size, *shape) for name, shape in state_shapes(model.config).items()}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name] or tensor.dtype != torch.float32:
            raise GPNStateFileError(
                f"{path} holds {name} of shape {tuple(tensor.shape)} ({tensor.dtype}); this model's is "
                f"{expected[name]} (float32)"
            )
        if not bool(torch.isfinite(tensor).all()):
            raise GPNStateFileError(
                f"{path} holds a state with NaN or infinite values (in {name}): it cannot be continued"
            )
    try:
        positions_read = int(metadata.get("positions_read", ""))
    except ValueError:
        positions_read = -1
    if positions_read < 1:
        raise GPNStateFileError(f"{path} does not say how many positions its state has read")
    return StateFile(
        tensors, positions_read, read_fingerprint, metadata.get("tokenizer_fingerprint"), metadata.get("read_head")
    )


def _read_state_bytes(path: Path) -> bytes:
    """The bytes of the file at `path`, read only from a regular file, and past its header only when the header
    says it is a GPN state: a device (`/dev/zero`) would be read without end and a FIFO would block, and a weights
    file of many GB given by mistake would be read whole only to be refused."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO opens without waiting for a writer)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            what = "a folder" if stat.S_ISDIR(status.st_mode) else "a device, pipe or socket"
            raise GPNStateFileError(f"{path} is {what}, not a GPN state file (GPNCache.save writes a regular file)")
        file = open(descriptor, "rb")  # (closed by the `with` below)
    except BaseException:
        os.close(descriptor)
        raise
    with file:
        size = status.st_size
        head = file.read(8)
        head += file.read(min(int.from_bytes(head, "little"), max(0, size - 8)))
        _state_file_metadata(head, path)
        return head + file.read()


def _state_checksum(tensors: dict[str, torch.Tensor], read_fingerprint: str, positions_read: str) -> str:
    """SHA-256 over the state tensors' names, shapes and bytes, in `STATE_TENSOR_NAMES` order, the fingerprint
    of the positions read (a damaged one could make a continuation feed positions twice) and their number (the
    position a continuation counts from)."""
    digest = hashlib.sha256(f"{read_fingerprint}/{positions_read}".encode())
    for name in STATE_TENSOR_NAMES:
        tensor = tensors[name]
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def _state_file_metadata(payload: bytes, path: Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file's header, checked to be a GPN state file's."""
    try:
        header_length = int.from_bytes(payload[:8], "little")
        if len(payload) < 8 or header_length > len(payload) - 8:
            raise ValueError(f"the header claims {header_length} bytes but the file has {len(payload)}")
        header = json.loads(payload[8 : 8 + header_length])
        metadata = header.get("__metadata__") or {}
    except (ValueError, AttributeError, UnicodeDecodeError) as error:
        raise GPNStateFileError(f"{path} is damaged or truncated, or not a safetensors file ({error})") from error
    if not isinstance(metadata, dict) or metadata.get("format") != STATE_FILE_FORMAT:
        raise GPNStateFileError(f"{path} is not a GPN state file (written by GPNCache.save)")
    if metadata.get("format_version") != str(STATE_FILE_VERSION):
        raise GPNStateFileError(
            f"{path} is a GPN state file of format version {metadata.get('format_version')}; this code reads version "
            f"{STATE_FILE_VERSION}: compute the state again with this version and save it"
        )
    return metadata


def _check_state_belongs_to(metadata: dict[str, str], model: nn.Module, path: Path) -> None:
    """Refuse the state of another model: another configuration, weights dtype, or weights."""
    ours = state_fingerprint(model)
    if metadata.get("config_fingerprint") != ours["config_fingerprint"]:
        try:
            theirs = json.loads(metadata.get("state_config", "{}"))
        except ValueError:
            theirs = {}
        mine = json.loads(ours["state_config"])
        differences = [
            f"{name} {theirs.get(name)!r} (this model: {mine[name]!r})"
            for name in mine
            if theirs.get(name) != mine[name]
        ]
        raise GPNStateFileError(
            f"{path} holds the state of another model: {'; '.join(differences) or 'another configuration'}"
        )
    their_dtype = metadata.get("weights_dtype")
    if their_dtype != ours["weights_dtype"]:
        their_name = metadata.get("dtype_name")
        if their_name is None:  # (saved before the field was written: named as the file names it)
            raise GPNStateFileError(
                f"{path} holds a state computed with {their_dtype} weights; this model's are {ours['weights_dtype']}"
            )
        raise GPNStateFileError(
            f"{path} holds a state computed with {_named(their_name, their_dtype)} weights; this model's are "
            f"{_named(ours['dtype_name'], ours['weights_dtype'])}"
            + _continue_across_dtypes(their_name, their_dtype, ours["dtype_name"])
        )
    theirs = metadata.get("weights_fingerprint")
    if theirs != ours["weights_fingerprint"]:
        # (saved by this model before its fingerprint was its merge's: its adapters hashed. A file that says
        # "no" adapters merged and hashed as stored never holds that hash, so its refusal hashes the weights once)
        if (
            metadata.get("merged_adapters_hashed") != "no"
            and computes_as_its_merge(model)
            and theirs == weights_hash(model, as_stored=True)
        ):
            return
        note = _unmerged_adapters_note(metadata.get("unmerged_adapters"), ours["unmerged_adapters"])
        merged = (
            ""
            if note
            else _merged_in_place_note(metadata.get("merged_adapters_hashed"), ours["merged_adapters_hashed"])
        )
        raise GPNStateFileError(
            f"{path} holds the state of another model: same configuration, other weights (weights fingerprint differs"
            + (
                ")"
                if merged
                else "; with PEFT adapters: other adapter weights, another adapter active, or adapters disabled)"
            )
            + (note or merged)
        )


def _named(name: str, kind: str) -> str:
    """A side of a refusal across dtypes: the weights as `--dtype` names them (`dtype_name`), with their kind as the
    file names it (`weights_kind`) where it says more ("int8 (bfloat16, quantized (Int8Tensor))")."""
    return kind if not name or name == kind else f"{name} ({kind})"


def _continue_across_dtypes(their_name: str, their_kind: str, our_name: str) -> str:
    """How to continue a state refused across dtypes (`dtype_name`s, `weights_kind`): on the model loaded with the
    file's `--dtype`; where both sides have that name (int8 weights quantized from other float dtypes: `--dtype int8`
    quantizes the bfloat16 model, a folder saved quantized from float32 runs as saved), naming that `--dtype` would
    send the user to the model they have, so the float weights the file's were quantized from are named instead."""
    if not their_name:
        return ""
    if their_name != our_name:
        return f": continue it on the model loaded with --dtype {their_name}"
    return f": both are {their_name}, quantized from other float weights; continue it on a model whose are {their_kind}"


def _merged_in_place_note(theirs: str | None, ours: str) -> str:
    """Why a state refused for its weights cannot be continued where one model is a PeftModel whose adapters are
    merged in place but hashed beside the weights (`merged_in_place_as_stored`) and the other is not; "" otherwise,
    and for files saved before the field was written."""
    why = (
        "its adapter layers are not provably their base layers (only PEFT 0.21's lora.Linear, adapters not disabled,"
        " every active adapter merged, no hooks on it, is), so it runs PEFT's own forward on the plain loop, and its"
        " states are not the merged model's bit for bit: its fingerprint hashes the adapters beside the merged weights"
    )
    if (theirs, ours) == ("yes", "no"):
        return (
            f". It was computed by a PeftModel with adapters merged in place (merge_adapter()), and {why}; continue it"
            " with that model, or compute the state again with this one"
        )
    if (theirs, ours) == ("no", "yes"):
        return (
            f". This model is a PeftModel with adapters merged in place (merge_adapter()), and {why}; continue the"
            " state with the model that computed it (merge_and_unload() where it is this one's merge)"
        )
    return ""


def _unmerged_adapters_note(theirs: str | None, ours: str) -> str:
    """Why a state refused for its weights cannot be continued even where one model is the other's merge: one
    computed with PEFT adapters unmerged and the other not (`computes_unmerged_adapters`); "" otherwise, and for
    files saved before the field was written."""
    if theirs == "yes" and ours == "no":
        return (
            ". It was computed by a model with PEFT adapters unmerged (a PeftModel), and this one has none unmerged"
            " (gpn generate, eval and serve merge an adapter folder): even where this model is that one merged, the"
            " states differ in their last bits (the adapter's product added beside the weights rounds otherwise), so"
            " it cannot be continued exactly; save the state from the merged model (merge_and_unload()) or continue"
            " it with the PeftModel that computed it"
        )
    if theirs == "no" and ours == "yes":
        return (
            ". It was computed by a model without unmerged PEFT adapters, and this one computes with its adapters"
            " unmerged: even where that model is this one merged, the states differ in their last bits, so it cannot"
            " be continued exactly; continue it with the model that computed it, or merge this one"
            " (merge_and_unload()) where it is this one's merge"
        )
    return ""
