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

import operator
import sys
import threading
import weakref
from collections.abc import Callable, Mapping

import torch
from torch.utils.hooks import RemovableHandle


def parameters_key(model: torch.nn.Module) -> tuple:
    """Each parameter's storage, version (bumped by every in-place update through the parameter itself, an
    optimizer step's too), dtype and device: a guard inside a scope, never a reason to reuse across scopes
    (writes through `.data` change none of it). A tensor subclass without storage of its own (a torchao
    quantized weight) is keyed by the tensors it holds (`__tensor_flatten__`), whose storage and versions
    change when it is requantized or edited in place."""
    return tuple(_tensor_key(p) for p in _parameters(model))


def _parameters(model: torch.nn.Module) -> list:
    """`list(model.parameters())`: the same parameters in the same order, each once, from a direct walk over
    the modules' own dicts (this runs before every decoded token; the generator layers of `parameters()`
    cost more than the keys themselves)."""
    seen, found = set(), []
    for module in modules_below(model):
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                found.append(parameter)
    return found


def modules_below(*roots: torch.nn.Module) -> list:
    """The roots and every module below them, each once, in `modules()`' order."""
    seen, found, pending = set(), [], list(reversed(roots))
    while pending:
        module = pending.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append(module)
        pending.extend(child for child in reversed(module._modules.values()) if child is not None)
    return found


_PLAIN = (torch.nn.Parameter, torch.Tensor)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    kind = type(tensor)
    if kind in _PLAIN:
        try:
            return tensor.data_ptr(), version_of(tensor), tensor.dtype, tensor.device
        except RuntimeError:  # a parameter swapped for a torch.func transform's wrapper, which has no storage
            return _tensor_key(_unwrapped(tensor))
    flatten = getattr(kind, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.data_ptr(), version_of(tensor), tensor.dtype, tensor.device
    with torch._C.DisableTorchFunctionSubclass():  # (its attributes without the subclass's dispatch)
        inner = [_held(tensor, name) for name in flatten(tensor)[0]]
        return (kind, tensor.dtype, tensor.device, *(_tensor_key(x) if torch.is_tensor(x) else id(x) for x in inner))


def _unwrapped(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with storage under a torch.func transform's wrappers (`functional_call` inside `grad`, `vmap`,
    `jvp`: the tensor passed in), whose address and version the key reads; anything else raises as it did."""
    functorch = torch._C._functorch
    if not functorch.is_functorch_wrapped_tensor(tensor):
        tensor.data_ptr()  # (re-raise: not a wrapper)
    while functorch.is_functorch_wrapped_tensor(tensor):
        tensor = functorch.get_unwrapped(tensor)
    return tensor


def _held(tensor: torch.Tensor, name: str):
    """What a subclass holds as `name`: in its `__dict__` (torchao's weights) or in a slot (a DTensor, an FSDP2
    shard, holds `_local_tensor` and its `device_mesh`, keyed by identity: a GPN block sharded apart is still
    sharded when a cache notes the model)."""
    held = tensor.__dict__.get(name)
    return held if held is not None else object.__getattribute__(tensor, name)


_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
)


def registered_global_hook() -> str | None:
    """The kind of module hook registered for every module (`torch.nn.modules.module.register_module_*_hook`),
    or None."""
    hooks = torch.nn.modules.module
    return next((name.strip("_") for name in _GLOBAL_HOOKS if getattr(hooks, name, None)), None)


def replaced_method(obj: object, methods: Mapping[type, Mapping[str, Callable]]) -> str | None:
    """The name of a method of `obj` that a fast path computes without calling it and that would not run as
    written: set on the instance, or on its class (overridden by a subclass, or assigned to the class). `methods`:
    by class, each such method as written (a class not listed, nor a subclass of one, has none); None when every
    one runs as written."""
    kind = type(obj)
    written = methods.get(kind)
    if written is None:  # (a subclass of a listed class: its own definitions are overrides)
        written = next((methods[base] for base in kind.__mro__ if base in methods), None)
        if written is None:
            return None
    instance = obj.__dict__
    for name, function in written.items():
        if name in instance or getattr(kind, name, None) is not function:
            return name
    return None


def replaced_method_reason(owner: str, method: str) -> str:
    """What a fast path's blocker says of `owner`'s `method` that `replaced_method` found."""
    return (
        f"{owner}.{method} is replaced (set on the instance, overridden by a subclass or assigned to the class): the "
        "fast path computes the one defined here, the plain path calls it"
    )


def called_as_is(module: torch.nn.Module) -> bool:
    """No hooks on `module` and no `forward` of its own instance: calling it runs its class's forward alone."""
    return not (
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_pre_hooks
        or module._backward_hooks
        or "forward" in module.__dict__
    )


# PEFT's LoRA linear layer, known by the module and name of its class, so that nothing here imports PEFT; and the PEFT
# versions whose `Linear.forward` was read for `merged_lora_base` (0.21.2's peft/tuners/lora/layer.py; the test
# extra pins peft to 0.21). Another version, or a class of another name (a subclass, bitsandbytes' or torchao's LoRA
# layers, DoRA's embedding, `modules_to_save`'s wrapper), is a wrapper like any other: the plain path calls it.
PEFT_LORA_LINEAR = ("peft.tuners.lora.layer", "Linear")
PEFT_VERSIONS_READ = ("0.21.",)


def merged_lora_base(module: torch.nn.Module) -> torch.nn.Module | None:
    """The base layer of a PEFT LoRA linear layer whose forward is provably that base layer's, or None.

    PEFT 0.21's `lora.Linear.forward(x)` returns `self.base_layer(x)` and nothing else where its adapters are not
    disabled (disabled and merged, it first unmerges: writes the weights), no `adapter_names` are passed (PEFT's
    mixed batch passes them through forward pre-hooks) and some adapter is merged (`self.merged`), whatever the
    others, their dropout or DoRA's magnitude (a merged DoRA's is in the weight). So: exactly that class, of a PEFT
    version read, its forward the class's own (not assigned to the class or the instance), no hooks on it, adapters
    not disabled, every active adapter merged (an active one left unmerged, which PEFT 0.21 ignores while another is
    merged, keeps the plain path, as the user may mean it to compute), and the `weight` and `bias` it shows (what
    the fast path reads) the base layer's own. Whether the base layer is a plain module is asked of it as of any."""
    kind = type(module)
    if kind.__name__ != PEFT_LORA_LINEAR[1] or kind.__module__ != PEFT_LORA_LINEAR[0]:
        return None
    peft = sys.modules.get("peft")
    if peft is None or not str(getattr(peft, "__version__", "")).startswith(PEFT_VERSIONS_READ):
        return None
    forward = kind.__dict__.get("forward")
    if getattr(forward, "__module__", None) != PEFT_LORA_LINEAR[0] or getattr(forward, "__qualname__", None) != (
        "Linear.forward"
    ):
        return None
    if not called_as_is(module):
        return None
    merged = module.merged_adapters
    if module.disable_adapters or not merged or not set(module.active_adapters) <= set(merged):
        return None
    base = module._modules.get("base_layer")
    if base is None or module.weight is not base.weight or module.bias is not base.bias:
        return None
    return base


def as_read(module: torch.nn.Module | None) -> torch.nn.Module | None:
    """`module` as the fast path reads it: the base layer of a PEFT LoRA layer merged in place whose forward is
    provably that base layer's (`merged_lora_base`), else `module` itself."""
    return merged_lora_base(module) or module


# (C-level reads of a tensor's version and address, for `map`)
_version = operator.attrgetter("_version")
_data_ptr = torch.Tensor.data_ptr


def version_of(tensor: torch.Tensor) -> int | None:
    """`tensor._version`, or None for an inference tensor (made under `torch.inference_mode()`: a model built or
    loaded there, a cache filled there), which tracks no version. Its in-place writes, possible only inside
    inference mode, are then not seen by a key, as writes through `.data` are not: scopes still derive afresh."""
    try:
        return tensor._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None


def _versions(tensors: list) -> list:
    """`version_of` of each tensor (one C-level pass where none is an inference tensor: the common case)."""
    try:
        return list(map(_version, tensors))
    except RuntimeError:
        return list(map(version_of, tensors))


class WatchedModules:
    """The modules below `roots` as they are now, to tell cheaply whether they still are: the same module
    objects under the same names, none hooked nor given a `forward` (or another of its `methods`, and no
    method of `callers`, by class as `replaced_method` takes them) of its own instance, each parameter the same
    tensor with the same storage and version, and no global module hook. (A method assigned to a class is
    looked for when the plan is built, not at every check: a class is not watched.) A tensor subclass (a torchao
    quantized weight) is watched through what it holds: every attribute the same object (none added), each
    plain tensor among them with the same storage and version (one holding another subclass is keyed whole,
    `_tensor_key`). What a plan derived from them (and checked as plain when it was built) asks before every
    decoded token instead of the model's whole `parameters_key`. The guard of `parameters_key`, no more: a
    write through `.data` in place is not seen by either.

    A check runs between two token steps that stream the weights through the caches, so whatever it touches
    comes from memory: it touches as little as it can. Each module's hooks are looked at only after a hook
    was registered somewhere (every registration, a module's or a global one, takes a new
    `RemovableHandle.next_id`); the rest is a few C-level passes over flat lists, with no key tuple to build
    and no `__tensor_flatten__` (which torchao answers in Python)."""

    def __init__(
        self,
        *roots: torch.nn.Module,
        methods: Mapping[type, Mapping[str, Callable]] | None = None,
        callers: tuple = (),
    ):
        self.modules = modules_below(*roots)
        self.owners, self.names, self.objects = [], [], []  # owners[i][names[i]] is objects[i]
        self.held, self.sizes, self.subclassed, self.kinds, self.whole, tensors = [], [], [], [], [], []
        for caller in callers:
            self._watch_methods(caller, methods)
        for module in self.modules:
            self._watch(module.__dict__, "forward", None)  # (no `forward` of its own instance)
            self._watch_methods(module, methods)
            for name, child in module._modules.items():
                self._watch(module._modules, name, child)
            for name, parameter in module._parameters.items():
                self._watch(module._parameters, name, parameter)
                if parameter is None:
                    continue
                if type(parameter) in _PLAIN:
                    tensors.append(parameter)
                    continue
                self.subclassed.append(parameter)
                self.kinds.append(type(parameter))
                held = parameter.__dict__
                inner = [value for value in held.values() if isinstance(value, torch.Tensor)]
                if any(type(value) not in _PLAIN for value in inner):
                    self.whole.append((parameter, _tensor_key(parameter)))
                    continue
                self.held.append(held)
                self.sizes.append(len(held))
                for attribute, value in held.items():
                    self._watch(held, attribute, value)
                tensors += inner
        self.tensors = tensors
        self.pointers = list(map(_data_ptr, tensors))
        self.versions = _versions(tensors)
        self.hooks_seen_at = None  # (the `next_id` at the last look at every module's hooks that found none)
        self.unhooked()

    def _watch_methods(self, obj: object, methods: Mapping[type, Mapping[str, Callable]] | None) -> None:
        """Watch that none of `obj`'s methods listed in `methods` (by its class) is set on the instance."""
        kind = type(obj)
        for base in kind.__mro__ if methods else ():
            if base in methods:
                for name in methods[base].keys() - {"forward"}:  # (every module's forward is watched already)
                    self._watch(obj.__dict__, name, None)
                return

    def _watch(self, owner: dict, name: str, value: object) -> None:
        self.owners.append(owner)
        self.names.append(name)
        self.objects.append(value)

    def unhooked(self) -> bool:
        """No module hooked (its own hooks or a global one), looked at again only when a hook was registered
        since the last look."""
        registered = RemovableHandle.next_id
        if registered != self.hooks_seen_at:
            if registered_global_hook() is not None or not all(map(called_as_is, self.modules)):
                return False
            self.hooks_seen_at = registered
        return True

    def unchanged(self) -> bool:
        """Whether the watched modules are as when watched: no hook, the same parameters, versions, storage and sizes."""
        return (
            self.unhooked()
            and all(map(operator.is_, map(dict.get, self.owners, self.names), self.objects))
            and _versions(self.tensors) == self.versions
            and list(map(_data_ptr, self.tensors)) == self.pointers
            and list(map(len, self.held)) == self.sizes
            and all(map(operator.is_, map(type, self.subclassed), self.kinds))
            and (not self.whole or all(_tensor_key(parameter) == key for parameter, key in self.whole))
        )


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


_scopes = threading.local()  # per thread: {id(model): [depth, DerivedWeights, outermost caller's frame or None]}


def _open_scopes() -> dict:
    scopes = getattr(_scopes, "by_model", None)
    if scopes is None:
        scopes = _scopes.by_model = {}
    return scopes


class derived_weights_scope:  # noqa: N801 (a context manager, named as the function it was)
    """Within this block (on this thread) the fast path reuses what it derives from `model`'s parameters;
    the outermost block's end drops it. Nested blocks share the outermost one's.

    `kept_by`: the `GPNCache` a forward continues. An outermost block takes up what the previous call left
    with that same cache (`keep_with`) instead of starting empty, so a decode loop that calls the model one
    token at a time with its cache derives once, as `generate()` does, not once per token. The model keeps
    what it derived for one cache at most (the last one it filled; a weak reference, so one fold's memory,
    not one per cache alive, dropped when that cache is): continuing any other cache, or none, derives afresh. Within one cache's life
    `parameters_key` still guards (an optimizer step, `load_state_dict`, `to()`), but an edit through
    `.data` between two calls that continue the same cache is not seen: start from a new cache (a new
    prompt, a `generate()` call) after editing weights."""

    # (a class, not a generator under contextlib: one is opened around every decoded token)
    __slots__ = ("model", "kept_by", "entry")

    def __init__(self, model: torch.nn.Module, kept_by: object | None = None):
        self.model, self.kept_by = model, kept_by

    def __enter__(self) -> DerivedWeights:
        scopes = _open_scopes()
        entry = scopes.get(id(self.model))
        if entry is not None and (entry[0] == 0 or (entry[2] is not None and not _running(entry[2]))):
            # an outermost block that ended without its __exit__ running whole: a KeyboardInterrupt (Ctrl-C) lands at a
            # Python function's entry, __exit__'s too, and that left the scope open on this thread for good (every
            # later call sharing what it derived, edits through `.data` unseen even with a new cache): dropped
            entry = None
        if entry is None:
            kept = self.model.__dict__.get(KEPT_ATTRIBUTE)  # (weak reference to its cache, what was derived)
            reuse = kept is not None and self.kept_by is not None and kept[0]() is self.kept_by
            # (with the frame of the outermost block's caller, by which a nested block tells it still runs; none
            # while torch.compile traces, which cannot trace frames: an interrupt there ends the whole trace)
            caller = None if torch.compiler.is_compiling() else sys._getframe(1)
            entry = scopes[id(self.model)] = [0, kept[1] if reuse else DerivedWeights(), caller]
        entry[0] += 1
        self.entry = entry
        return entry[1]

    def __exit__(self, *exception) -> None:
        entry = self.entry
        entry[0] -= 1
        if entry[0] == 0:
            del _open_scopes()[id(self.model)]


def _running(frame: object) -> bool:
    """Whether `frame` is on this thread's stack (a nested block's outermost one is a few frames up: a short walk)."""
    current = sys._getframe(2)
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


KEPT_ATTRIBUTE = "_gpn_derived_weights_kept"


# a scope's entry: whether what it derived was read through a PEFT LoRA layer merged in place (`keep_with`)
READS_MERGED_ADAPTERS = "reads merged adapters"


def reads_merged_adapters(model: torch.nn.Module) -> bool:
    """Whether some module below `model` is a PEFT LoRA layer merged in place that the fast path reads as its base
    layer (`merged_lora_base`). A walk over every module (tens of µs): `keep_with` asks once a scope."""
    if "peft" not in sys.modules:  # (no PEFT layer without it: the walk only where PEFT is)
        return False
    return any(merged_lora_base(module) is not None for module in modules_below(model))


def keep_with(model: torch.nn.Module, cache: object, derived: DerivedWeights) -> None:
    """Leave `derived` with `model` for the next call that continues `cache` (`derived_weights_scope`), for as long
    as `cache` lives: when it is collected, `model` lets go of `derived` too (it held it for the model's life, or
    until another call replaced it: for an int4 model, its values packed again for the int4 products, or its matrices
    dequantized to bf16 where those do not take them, beside torchao's own).

    Not what was read through a PEFT LoRA layer merged in place (`reads_merged_adapters`, asked once a scope where
    something was derived): PEFT's merge and unmerge write the weights through `.data`, which no guard sees, and
    between two calls a user may unmerge, merge another adapter or merge again (W + BA - BA + BA rounds otherwise
    than W + BA), so each call derives from the weights as they are then (a generate() call still derives once)."""
    entries = derived.entries
    if entries and READS_MERGED_ADAPTERS not in entries:
        entries[READS_MERGED_ADAPTERS] = reads_merged_adapters(model)
    if entries.get(READS_MERGED_ADAPTERS):
        return
    kept = model.__dict__.get(KEPT_ATTRIBUTE)
    if kept is not None and kept[1] is derived and kept[0]() is cache:
        return  # (every decoded token of a loop: kept already)
    object.__setattr__(model, KEPT_ATTRIBUTE, (weakref.ref(cache, _forgetting(model)), derived))


def _forgetting(model: torch.nn.Module) -> Callable:
    """The callback of a kept cache's weak reference: `model` (if alive) drops what it keeps, if it still keeps it
    for that cache (a later `keep_with` for another cache is left alone)."""
    model_ref = weakref.ref(model)

    def forget(cache_ref: weakref.ref) -> None:
        owner = model_ref()
        kept = owner.__dict__.get(KEPT_ATTRIBUTE) if owner is not None else None
        if kept is not None and kept[0] is cache_ref:
            owner.__dict__.pop(KEPT_ATTRIBUTE, None)

    return forget


def drop_kept(model: torch.nn.Module) -> None:
    """Let go of what `keep_with` left with `model`, for a caller that will not continue that cache one call at a
    time (a server keeping states for later requests, each of which derives afresh): it would otherwise live as
    long as the cache (for a quantized model, its packed or dequantized copies beside the quantized weights)."""
    model.__dict__.pop(KEPT_ATTRIBUTE, None)


def derived_weights_of(model: torch.nn.Module) -> DerivedWeights:
    """The derived weights of the scope open for `model` on this thread; outside any scope a fresh, empty
    one (so a call outside a scope derives afresh and keeps nothing)."""
    entry = _open_scopes().get(id(model))
    return entry[1] if entry is not None else DerivedWeights()
