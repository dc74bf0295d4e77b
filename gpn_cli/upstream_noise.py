"""Exactly two kinds of log line that upstream libraries print on every `gpn` command, and nothing else, kept off
the terminal.

Where torchao is installed (the `int8` and `test` extras), importing transformers' model classes imports it
(`transformers.quantizers.quantizer_torchao`, whatever the model's dtype), and torchao 0.18 logs

- "Failed to load .../torchao/_C_mxfp8...so: Could not load this library: ..." for each of its CUDA extensions.
  On a torch built without CUDA (or ROCm) those can never load and nothing of ours uses them (int8 weight-only
  runs on torchao's Python tensors), so the line says nothing. On a CUDA build the line is kept: there it may be
  a real fault.
- "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile ... Calling
  register_constant() on Enum subclasses is deprecated": torch's deprecation notice about torchao's own code,
  nothing a user of gpn can act on. Only the notices about torchao's enums are dropped.

Every other record of those loggers, and every other logger, is untouched. Library users (`import modeling_gpn`)
are not affected: only the `gpn` command installs the filters.
"""

from __future__ import annotations

import enum
import logging
import re
import sys

TORCHAO = "torchao"  # the package, and its logger
PYTREE_LOGGER = "torch.utils._pytree"
_EXTENSION_NOT_LOADED = re.compile(r"Failed to load \S*[/\\]torchao[/\\]_C[^/\\]*\.so: ")
_ENUM_NOTICE = "%s is an Enum subclass and is now natively supported by torch.compile"


def _torch_without_gpu_build() -> bool:
    torch = sys.modules.get("torch")  # (torchao imports torch before it logs: never imported here)
    version = getattr(torch, "version", None)
    return version is not None and getattr(version, "cuda", None) is None and getattr(version, "hip", None) is None


def keep_torchao_record(record: logging.LogRecord) -> bool:
    """False for torchao's "Failed to load .../torchao/_C*.so" on a torch without CUDA or ROCm."""
    return not (_EXTENSION_NOT_LOADED.match(record.getMessage()) and _torch_without_gpu_build())


def keep_pytree_record(record: logging.LogRecord) -> bool:
    """False for torch's deprecation notice about register_constant() on one of torchao's enums."""
    if not (isinstance(record.msg, str) and record.msg.startswith(_ENUM_NOTICE) and record.args):
        return True
    cls = record.args[0] if isinstance(record.args, tuple) else None
    from_torchao = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__module__.split(".")[0] == TORCHAO
    return not from_torchao


def quiet_known_upstream_noise() -> None:
    """Install the two filters (once: a second call adds nothing)."""
    logging.getLogger(TORCHAO).addFilter(keep_torchao_record)
    logging.getLogger(PYTREE_LOGGER).addFilter(keep_pytree_record)
