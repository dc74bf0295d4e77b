"""`gpn serve [MODEL]`: `transformers serve` for GPNs, conversations kept as states.

Every option of `transformers serve` is here under the same name, read from `Serve`'s own signature (so
they cannot drift apart), followed by the options of the state store and of the limits.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import inspect
import re
import signal
import sys
import threading
import types
import typing

from transformers.cli.serve import Serve

from ..cli.arguments import ADAPTER_FOLDER_HELP, writable_folder
from ..cli.quantization import QUANTIZERS
from . import (
    DEFAULT_MAX_CONTEXT,
    DEFAULT_MAX_QUEUED_REQUESTS,
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_STATE_DIR_BYTES,
    DEFAULT_STATE_STORE_BYTES,
)

if typing.TYPE_CHECKING:
    from ..configuration_gpn import GPNConfig

GPN_OPTIONS = (
    "state_store_bytes",
    "state_dir",
    "state_dir_bytes",
    "max_context",
    "max_queued_requests",
    "max_request_bytes",
)
# where the serving extra comes from: this repository (PyPI's `gpn` is an unrelated project)
INSTALL_SERVING = "pip install -e '.[serving]' in the gpn repository"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from `1073741824`, `512MB` (10^6), `1GiB` (2^30), `0`, ..."""
    match = _SIZE.match(str(text))
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with KB, MB, GB, TB (or KiB, MiB, ...)"
        )
    number, unit, binary = match.groups()
    power = "kmgt".index(unit.lower()) + 1 if unit else 0
    return int(float(number) * (1024 if binary else 1000) ** power)


def _size_limit(text: str) -> int | None:
    """A size limit in bytes (`parse_size`); 0: no limit (None)."""
    return parse_size(text) or None


def _size_text(size: int) -> str:
    """`1GiB` for 2^30 (how --help shows a default size)."""
    for power, unit in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if size and size % 1024**power == 0:
            return f"{size // 1024**power}{unit}"
    return str(size)


def _limit(text: str) -> int | None:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a limit is a count >= 0 (0: no limit), got {value}")
    return value or None


def _serve_parameters() -> list[tuple[str, type, object, object]]:
    """(name, type, typer info, default) of each visible option of transformers' `Serve`."""
    found = []
    for name, parameter in inspect.signature(Serve.__init__).parameters.items():
        if name == "self" or typing.get_origin(parameter.annotation) is not typing.Annotated:
            continue
        kind, info = typing.get_args(parameter.annotation)[:2]
        if getattr(info, "hidden", False):
            continue
        if isinstance(kind, types.UnionType):  # `str | None` -> str
            kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        found.append((name, kind, info, parameter.default))
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `gpn serve`: transformers serve's own, then the state store's."""
    parser.description = (
        "Serve a model behind an OpenAI-compatible API (/v1/chat/completions with streaming, /v1/completions, "
        "/v1/responses, /v1/models, /health): transformers serve, able to build a GPN, keeping each conversation's state so the "
        "next turn reads only its new tokens. Options up to --state-store-bytes are transformers serve's own."
    )
    for name, kind, info, default in _serve_parameters():
        # transformers' help names its own parameter (--model-timeout: "Ignored when force_model is set"): here it
        # is the positional MODEL
        help_text = (info.help or "").replace("%", "%%").replace("force_model is set", "MODEL is given")
        if name == "force_model":
            parser.add_argument(
                "model",
                nargs="?",
                default=None,
                help=help_text + " Without it, each request's `model` is loaded. A model folder, a Hub repo id, or "
                f"{ADAPTER_FOLDER_HELP}.",
            )
        elif kind is bool:
            parser.add_argument(
                f"--{name.replace('_', '-')}", action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        elif name == "dtype":
            parser.add_argument(
                "--dtype",
                default=default,
                help=help_text + " A torch float dtype's name (float32, bfloat16, float16), or int8 or int4: torchao's "
                "int8 / int4 weight-only quantization of every nn.Linear of the bfloat16 model but its output head, as "
                "gpn generate --dtype int8 | int4 makes it (a folder saved quantized so is served as saved; one "
                "saved otherwise quantized is refused).",
            )
        elif isinstance(kind, type) and issubclass(kind, enum.Enum):
            choices = [member.value for member in kind]
            parser.add_argument(
                f"--{name.replace('_', '-')}",
                choices=choices,
                default=getattr(default, "value", default),
                help=help_text,
            )
        else:
            parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=help_text)
    gpn = parser.add_argument_group("GPN: conversations kept as states, and limits")
    gpn.add_argument(
        "--state-store-bytes",
        type=parse_size,
        default=_size_text(DEFAULT_STATE_STORE_BYTES),
        metavar="SIZE",
        help="memory for kept states (least recently used evicted; e.g. 512MB, 2GiB); 0 turns the store off (with --state-dir: every state goes to a file)",
    )
    gpn.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="folder for state files: the states evicted from memory, and every kept state when the server stops "
        "(Ctrl-C or SIGTERM; a killed server, kill -9, loses those in memory); read back when needed and after a "
        "restart",
    )
    gpn.add_argument(
        "--state-dir-bytes",
        type=parse_size,
        default=_size_text(DEFAULT_STATE_DIR_BYTES),
        metavar="SIZE",
        help="the most the state files in --state-dir may take (those of every server on it together)",
    )
    gpn.add_argument(
        "--max-context",
        type=_limit,
        default=DEFAULT_MAX_CONTEXT,
        metavar="TOKENS",
        help="the most tokens a request's prompt and answer may take together (400 beyond; 0: no limit)",
    )
    gpn.add_argument(
        "--max-queued-requests",
        type=_limit,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        metavar="N",
        help="the most requests taken on at once, running or waiting (429 beyond; 0: no limit)",
    )
    gpn.add_argument(
        "--max-request-bytes",
        type=_size_limit,
        default=_size_text(DEFAULT_MAX_REQUEST_BYTES),
        metavar="SIZE",
        help="the largest request body taken (413 beyond, before it is read whole; 0: no limit)",
    )


def transformers_refusal() -> str | None:
    """Why this environment's transformers cannot run `gpn serve`, or None. The serving extra pins the minor
    whose serving internals `gpn serve` hooks into (5.25 moved them into a process per model that no hook reaches:
    CONTRIBUTING.md, "The transformers versions tested"), while gpn itself allows the next one: refused by version
    before an import fails on a moved name, or a later minor that kept the names serves with their meaning changed.
    The pin is read from gpn's installed metadata, its one source (none there, as in a source tree: no check)."""
    import importlib.metadata

    import transformers
    from packaging.requirements import Requirement

    try:
        requirements = [Requirement(line) for line in importlib.metadata.requires("gpn") or ()]
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        serving = requirement.marker is not None and requirement.marker.evaluate({"extra": "serving"})
        if serving and requirement.name == "transformers":
            if requirement.specifier.contains(transformers.__version__, prereleases=True):
                return None
            return (
                f"gpn serve runs on transformers{requirement.specifier} (the serving internals it hooks into), "
                f"this environment has {transformers.__version__}: {INSTALL_SERVING}"
            )
    return None


def run(args: argparse.Namespace) -> int:
    """Run `gpn serve` until stopped; returns the exit status."""
    import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)

    refusal = transformers_refusal()
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        from .server import GPNServe
    except ImportError as error:  # fastapi, uvicorn, openai: transformers' serving extra
        print(
            f"gpn serve needs the serving dependencies ({error}): {INSTALL_SERVING}",
            file=sys.stderr,
        )
        return 2
    from ..cli.loading import adapter_note, check_model_path
    from ..cli.quantization import require_torchao
    from .models import refuse_quantized_adapter, refuse_two_quantizations

    options = {name: getattr(args, name) for name, *_ in _serve_parameters() if name != "force_model"}
    options.update({name: getattr(args, name) for name in GPN_OPTIONS})
    try:  # checked before the model loads: a bad argument costs nothing
        require_torchao(args.dtype)  # (--dtype int8 | int4: torchao's quantization, as gpn generate's)
        refuse_two_quantizations(args.dtype, args.quantization)
        if args.model is not None:  # (as gpn eval, generate and inspect check theirs)
            # (transformers: "Repo id must be in the form ...", or its load's error)
            args.model = check_model_path(args.model)
            refuse_quantized_adapter(args.model, options.get("quantization"))
            note = adapter_note(args.model)
            if note is not None:  # (which base is served, and whose tokenizer)
                print(f"gpn serve: {note}", file=sys.stderr)
        if args.state_dir is not None:
            writable_folder(args.state_dir, "--state-dir")
            if args.state_dir_bytes < 1:  # (0 would delete every state once written, the other servers' too)
                raise ValueError(
                    f"--state-dir-bytes must be more than 0 with --state-dir, got {args.state_dir_bytes}: "
                    "leave out --state-dir to keep no state files"
                )
        if args.model is not None:
            refuse_bounds_below_one_state(args)
    except (FileNotFoundError, ValueError) as error:
        print(f"gpn serve: {error}", file=sys.stderr)
        return 2
    with _sigint_noted() as interrupted:
        try:
            GPNServe(args.model, **options)
        except KeyboardInterrupt:  # Ctrl-C: uvicorn has stopped the server (and the states are written); no traceback
            return 130
        except (OSError, ValueError) as error:
            # before serving: a MODEL that cannot be loaded, a --device or --dtype transformers refuses, ... (once
            # serving, uvicorn and the handlers answer every error themselves)
            print(f"gpn serve: cannot start: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    return 130 if interrupted else 0


def refuse_bounds_below_one_state(args: argparse.Namespace) -> None:
    """A `ValueError` where a positive --state-dir-bytes (with --state-dir) or --state-store-bytes (without it) is
    smaller than one state of the pinned model `args.model`: every conversation would be deleted once written, or
    none kept in memory, each request read whole again (the store only logged it, once, at the first state). The
    smallest state (`StateStore.smallest_files_bytes`, `smallest_entry_bytes`) is known from the model's config
    alone, read from its folder or the Hub's cache (a few ms; nothing where it cannot be read offline: the load then
    says what is wrong, and the store logs a state over the bound). A smaller memory bound with --state-dir is
    allowed: every state then goes to a file."""
    from transformers import AutoConfig

    from ..cli.loading import adapter_base
    from ..configuration_gpn import GPNConfig
    from .state_store import StateStore

    try:
        config = AutoConfig.from_pretrained(adapter_base(args.model) or args.model, local_files_only=True)
    except (OSError, ValueError):
        return
    if not isinstance(config, GPNConfig):  # (another model type: the load refuses it)
        return
    if args.state_dir is not None:
        saved = quantized_as_saved(config)
        dtype, quantized = args.dtype, saved
        if args.dtype in QUANTIZERS:  # (the bfloat16 model quantized so; a folder saved so, as saved)
            dtype, quantized = ("auto" if saved == args.dtype else "bfloat16"), args.dtype
        if dtype in (None, "auto"):
            dtype = getattr(config, "dtype", None) or "float32"
        least = StateStore.smallest_files_bytes(config, str(dtype).removeprefix("torch."), quantized)
        if args.state_dir_bytes < least:
            raise ValueError(
                f"--state-dir-bytes {args.state_dir_bytes} is smaller than one state of {args.model} (its state file "
                f"and ids take at least {least} bytes): every kept conversation would be deleted once written; give "
                f"--state-dir-bytes {least} or more"
            )
    elif 0 < args.state_store_bytes < (least := StateStore.smallest_entry_bytes(config)):
        raise ValueError(
            f"--state-store-bytes {args.state_store_bytes} is smaller than one state of {args.model} (at least {least} "
            f"bytes in memory): no conversation would be kept; give --state-store-bytes {least} or more, or 0 to keep "
            "none"
        )


def quantized_as_saved(config: GPNConfig) -> str | None:
    """How a folder saved quantized through transformers' `TorchAoConfig` quantizes its weights, as `gpn generate
    --dtype` names it, read from its config's `quantization_config`: "int8" (`Int8WeightOnlyConfig`), "int4"
    (`IntxWeightOnlyConfig` of int4 values), else None (a float model, or a quantization a state file names
    otherwise: the smallest state here is then that of the float dtype, fewer bytes than the file, and the model
    loaded is checked exactly, `StateStore.refuse_a_model_over_the_folder_bound`)."""
    quantization = getattr(config, "quantization_config", None)
    if hasattr(quantization, "to_dict"):
        quantization = quantization.to_dict()
    if not isinstance(quantization, dict) or quantization.get("quant_method") != "torchao":
        return None
    quant_type = quantization.get("quant_type")
    kind = quant_type.get("default") if isinstance(quant_type, dict) and len(quant_type) == 1 else None
    if not isinstance(kind, dict):
        return None
    data = kind.get("_data") if isinstance(kind.get("_data"), dict) else {}
    if kind.get("_type") == "Int8WeightOnlyConfig":
        return "int8"
    if kind.get("_type") == "IntxWeightOnlyConfig" and data.get("weight_dtype") == {
        "_data": "int4",
        "_type": "torch.dtype",
    }:
        return "int4"
    return None


@contextlib.contextmanager
def _sigint_noted():
    """A list that holds SIGINT once one arrived while the server ran. uvicorn catches Ctrl-C, shuts down gracefully,
    puts back the SIGINT handler it found and raises the signal again, for that handler's KeyboardInterrupt; in a
    process started with SIGINT ignored (a background job of a non-interactive shell) that handler is SIG_IGN and
    the server exits 0 after a Ctrl-C. (A server also exited 0 after SIGINT once in a CI run, not reproduced in
    eleven runs since.) With this handler as the one uvicorn puts back, the signal raises a KeyboardInterrupt and
    is noted, so the exit status is 130 either way."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # (only the main thread has signal handlers)
        yield noted
        return

    def note(signum: int, frame: types.FrameType | None):
        noted.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        signal.signal(signal.SIGINT, previous)
