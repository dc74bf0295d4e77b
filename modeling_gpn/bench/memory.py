"""What a process and an object hold, for the memory benchmarks in benchmarks/ and for the tests (which cannot
share a module with benchmarks/ anywhere else: benchmarks do not import tests): the kernel's figures for this
process (`status_kib`) and every byte of tensor storage an object reaches (`bytes_held`).

The standard library and torch only, and nothing else of gpn: benchmarks/prefill_memory.py loads this file by its
path, while `--code` has put another checkout's modeling_gpn in its place.
"""

from __future__ import annotations

import re
import weakref
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")


def status_kib(field: str) -> int:
    """The `field` line of `/proc/self/status` (Linux) in KiB: `VmRSS` the resident set now, `VmHWM` its peak
    (reset by writing 5 to `/proc/self/clear_refs`). A field the file has not in kB (or at all) is a `ValueError`
    naming it; where there is no such file (macOS, Windows) the `OSError` names the file."""
    match = re.search(rf"^{re.escape(field)}:\s+(\d+) kB$", STATUS.read_text(encoding="utf-8"), re.MULTILINE)
    if match is None:
        raise ValueError(f"{STATUS} has no {field!r} line in kB (VmRSS, VmHWM, VmSize, ... are)")
    return int(match.group(1))


def _slot_names(cls: type) -> list[str]:
    """The names of the `__slots__` of `cls` and of every class it derives from (a class's `__slots__` lists its
    own only; a string is one name), but `__dict__` and `__weakref__`."""
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    return [name for name in names if name not in ("__dict__", "__weakref__")]


def bytes_held(value: object) -> int:
    """Every byte of tensor storage reachable from `value` (each storage once, a view and its base counted as
    their one storage): a cache's state, the fingerprint of what it read and anything else it keeps, in its own
    attributes (`__dict__` and `__slots__`, inherited ones too), its layers', and the containers and objects they
    hold. Not through weak references, nor into an `nn.Module` (the model a cache belongs to is not part of it)."""
    seen, storages = set(), {}
    stack = [value]
    while stack:
        value = stack.pop()
        if type(value) in weakref.ProxyTypes or id(value) in seen:  # (a proxy passes isinstance as its referent)
            continue
        if isinstance(value, (str, bytes, int, float, bool, type(None), type, torch.nn.Module, weakref.ReferenceType)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr(), value.device] = storage.nbytes()
        elif isinstance(value, dict):
            stack += value.values()
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack += value
        else:
            stack += [getattr(value, name) for name in _slot_names(type(value)) if hasattr(value, name)]
            stack += getattr(value, "__dict__", {}).values()
    return sum(storages.values())
