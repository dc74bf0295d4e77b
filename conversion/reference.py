"""Convert checkpoints of the reference JAX implementation (`sot` / `sot_m`) to a transformers GPN.

Two sources are understood:

- the reference trainer's `checkpoint.pkl`: a pickled dict whose `params` is the flat Flax parameter
  dict of numpy arrays (beside `step`, `data_position` and `opt_state`). The pickle is untrusted
  input and is read with `RestrictedUnpickler`, which builds only dicts, lists, tuples, numbers,
  strings and numpy arrays (optax's state classes in `opt_state` become plain tuples) and refuses
  everything else;
- a folder with `params.npz` (+ optional `config.json`), laid out like `fixtures/reference/*`.

The reference stores matrices as (in, out) for `x @ W`; `nn.Linear` weights are the transpose.

Both sources are untrusted, so memory is bounded by what the file really holds and by what the
parameters of the inferred config need, and every claim is checked before anything is allocated:

- a pickle is read by a pure-Python unpickler from the file's own bytes: no length it claims can
  allocate more than the file holds, the callables it may name are wrapped so that none amplifies
  (`bytes(10**10)`, an array of a claimed shape without its data, containers rebuilt over and over
  from one memoised list), and the bytes it builds are counted against a budget of twice the file;
- an npz is read from its zip directory and each member's `.npy` header first: every member's
  uncompressed size must match the shape its header claims, their total may exceed the file by at
  most `MAX_NPZ_EXPANSION` (a zip bomb is refused before one byte is inflated), and only the
  members the config maps, with exactly the expected shapes, are ever read;
- the config inferred from the shapes must fit in the memory this process may use
  (`available_memory`: MemAvailable and RLIMIT_AS), and no two parameters may share one array (a
  pickle can reference one array from a thousand layers, a config the file does not pay for).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import math
import pickle
import re
import shutil
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from modeling_gpn import GPNConfig, GPNForCausalLM
from modeling_gpn.atomic_files import held

if TYPE_CHECKING:
    from typing import BinaryIO

try:
    import resource  # POSIX: the address-space limit `available_memory` heeds
except ImportError:  # Windows: no such limit to heed
    resource = None


class CheckpointError(ValueError):
    """A reference checkpoint that cannot be converted; the message says why."""


# How far the uncompressed members of a params.npz may exceed the file: float weights deflate to
# ~90% of their size (and even a fresh init with zero matrices to well under 16x), a zip bomb to 0.1%.
MAX_NPZ_EXPANSION = 16
# Small files are never refused for expansion: below this many bytes nothing can hurt.
SMALL_CLAIM_BYTES = 64 << 20
# What the unpickler may build, as a multiple of the pickle's size (+ SMALL_CLAIM_BYTES).
PICKLE_BUDGET_FACTOR = 2
# Rough cost of one parameter tensor and one predict layer beyond their numbers (module objects).
TENSOR_OVERHEAD_BYTES = 4 << 10
MAX_NESTING = 16  # a Flax parameter tree is 1-3 dicts deep


def _gib(n: int | float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def available_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable (Linux; elsewhere psutil's count of the same), less
    where RLIMIT_AS is set; None if unknown."""
    limits = []
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
    except OSError:  # not Linux (macOS, Windows): psutil (accelerate's dependency) asks the system
        try:
            import psutil

            limits.append(int(psutil.virtual_memory().available))
        except Exception:  # noqa: BLE001 (no psutil, or a system it cannot ask: the check is skipped, as before)
            pass
    soft = resource.getrlimit(resource.RLIMIT_AS)[0] if resource is not None else None
    if soft is not None and soft != resource.RLIM_INFINITY:
        try:
            status = Path("/proc/self/status").read_text(encoding="utf-8")
            used = int(re.search(r"VmSize:\s+(\d+)", status).group(1)) * 1024
            limits.append(max(0, soft - used))
        except (OSError, AttributeError):
            pass
    return min(limits) if limits else None


def check_memory(need: int, what: str) -> None:
    """Raise `CheckpointError` before allocating `need` bytes for `what` if the process cannot have them."""
    available = available_memory()
    if available is not None and need > available:
        raise CheckpointError(
            f"{what} needs about {_gib(need)} of memory, but only {_gib(available)} is available to this "
            "process; refusing before allocating it (a damaged or hostile file claims more than it holds, "
            "or the model is too large for this machine)"
        )


# --------------------------------------------------------------------------------------------------
# Reading the checkpoint safely: the pickle
# --------------------------------------------------------------------------------------------------

_NUMERIC_KINDS = "biufc"
_LATIN1 = {"latin1", "latin-1", "iso-8859-1", "iso8859-1", "l1"}


def _plain_dtype(value: Any, where: str) -> np.dtype:
    """`value` as a numeric numpy dtype without fields, sub-arrays or objects, else `CheckpointError`."""
    if not isinstance(value, np.dtype):
        raise CheckpointError(f"Refusing the checkpoint: {where} has a dtype of type {type(value).__name__}")
    if (
        value.kind not in _NUMERIC_KINDS
        or value.hasobject
        or value.fields is not None
        or value.subdtype is not None
        or value.itemsize != np.dtype(value.str).itemsize
    ):
        raise CheckpointError(f"Refusing the checkpoint: {where} has dtype {value}, not a plain numeric dtype")
    return value


def _shape_size(shape: Any, where: str) -> int:
    """Number of elements of a claimed shape (a tuple of non-negative ints), else `CheckpointError`."""
    if not isinstance(shape, tuple) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise CheckpointError(f"Refusing the checkpoint: {where} claims the shape {shape!r}")
    return math.prod(shape)


class _NdarrayClass:
    """Stands for `numpy.ndarray` in a pickle: only `_reconstruct` may use it (calling it would allocate
    an array of any claimed shape without the file holding its data)."""


_NDARRAY = _NdarrayClass()


def _byte_data(value: Any) -> bool:
    return isinstance(value, (bytes, bytearray, memoryview, pickle.PickleBuffer))


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickler that builds only plain containers, numbers, strings and numpy arrays, within a budget.

    It is the standard library's pure-Python unpickler (`pickle._Unpickler`, whose opcode table can be
    amended) over the file's bytes in memory: a claimed length never allocates
    more than the file holds (the C unpickler allocates a claimed `BINBYTES8` length before reading).
    Every global a reference checkpoint needs is replaced by a checked wrapper; `BUILD` accepts only
    an array's or a dtype's own state, checked against its shape. `budget` bounds the bytes built
    through those wrappers (arrays, byte strings, rebuilt containers).
    """

    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, file: BinaryIO, budget: int | None = None):
        super().__init__(file)
        self.budget = budget
        self.claimed = 0
        self._globals = self._checked_globals()
        claim = self.claim

        class OptimizerState:
            """Stands for any optax class in the pickle (optax is never imported, and `opt_state` is not converted):
            what it is built from, kept as a plain tuple."""

            def __new__(cls, *fields):  # (NEWOBJ calls cls.__new__(cls, *fields); REDUCE, cls(*fields))
                claim(64 * len(fields) + 64, "an optimizer state")
                return fields

        self._optimizer_state = OptimizerState

    # ---- budget ----------------------------------------------------------------------------------

    def claim(self, nbytes: int, what: str) -> None:
        """Count `nbytes` more built (`what` brings them); a `CheckpointError` past the file's budget."""
        self.claimed += int(nbytes)
        if self.budget is not None and self.claimed > self.budget:
            raise CheckpointError(
                f"Refusing the checkpoint: its pickle builds more than {_gib(self.budget)} ({what} brings it to "
                f"{_gib(self.claimed)}), more than a file of this size can hold; it is damaged or hostile"
            )

    # ---- globals ---------------------------------------------------------------------------------

    def find_class(self, module: str, name: str) -> Any:
        """The global `module.name` from the allowed table (or a numpy dtype class); anything else refused."""
        key = (module, name)
        if key in self._globals:
            return self._globals[key]
        if module in ("numpy", "numpy.dtypes") and name.endswith("DType") and hasattr(np.dtypes, name):
            dtype_class = getattr(np.dtypes, name)
            return lambda *args: _plain_dtype(dtype_class(*args), f"numpy.dtypes.{name}")
        if module == "optax" or module.startswith("optax."):
            # the trainer pickles its optax state as it is (Adam's moments and step counts in optax's NamedTuples:
            # ScaleByAdamState, EmptyState, MaskedState, ...): refused, no trainer checkpoint converted at all
            return self._optimizer_state
        raise CheckpointError(
            f"Refusing to load the checkpoint: its pickle contains the object {module}.{name}, which a reference "
            "checkpoint never holds (only dicts, lists, tuples, numbers, strings, numpy arrays and optax's optimizer "
            "states are accepted). The file may be corrupt or malicious."
        )

    def _checked_globals(self) -> dict[tuple[str, str], Any]:
        try:  # numpy >= 2
            from numpy._core import multiarray, numeric
        except ImportError:  # numpy 1.x
            from numpy.core import multiarray, numeric

        claim = self.claim

        def reconstruct(subtype: object, shape: object, dtype_code: object):
            # numpy pickles an array as _reconstruct(ndarray, (0,), b'b') followed by BUILD with its data
            if subtype is not _NDARRAY or _shape_size(shape, "an array") != 0 or dtype_code not in (b"b", "b"):
                raise CheckpointError(
                    f"Refusing the checkpoint: it reconstructs an array as {shape!r} without its data "
                    "(numpy writes an empty array and its data)"
                )
            return multiarray._reconstruct(np.ndarray, shape, dtype_code)

        def frombuffer(buffer: object, dtype: object, shape: object, order: object, axis_order: object = None):
            dtype = _plain_dtype(dtype, "an array")
            size = _shape_size(shape, "an array")
            if not _byte_data(buffer) or memoryview(buffer).nbytes != size * dtype.itemsize or order not in ("C", "F"):
                raise CheckpointError(f"Refusing the checkpoint: an array claims the shape {shape!r} for other data")
            claim(size * dtype.itemsize, "an array")
            return numeric._frombuffer(buffer, dtype, shape, order, axis_order)

        def scalar(dtype: object, data: object = None):
            dtype = _plain_dtype(dtype, "a number")
            if not isinstance(data, bytes) or len(data) != dtype.itemsize:
                raise CheckpointError(f"Refusing the checkpoint: a {dtype} number with {type(data).__name__} data")
            return multiarray.scalar(dtype, data)

        def dtype(obj: object, align: object = False, copy: object = False):
            if not isinstance(obj, str):
                raise CheckpointError(f"Refusing the checkpoint: a dtype built from {type(obj).__name__}")
            try:
                made = np.dtype(obj, align=bool(align), copy=True)  # never the shared singleton: BUILD mutates it
            except (TypeError, ValueError) as error:
                raise CheckpointError(f"Refusing the checkpoint: bad dtype {obj!r}: {error}") from error
            return _plain_dtype(made, "its pickle")

        def encode(text: object, encoding: object = "utf-8", errors: object = "strict"):
            # numpy's protocol-2 pickles carry array bytes as codecs.encode(str, 'latin1'): one byte per char
            if not isinstance(text, str) or not isinstance(encoding, str) or encoding.lower() not in _LATIN1:
                raise CheckpointError(f"Refusing the checkpoint: codecs.encode with {encoding!r}")
            claim(len(text), "a byte string")
            return codecs.encode(text, "latin1")

        def container(kind: type) -> Callable:
            def build(*args):
                if len(args) > 1 or (args and not isinstance(args[0], (list, tuple, set, frozenset, dict))):
                    raise CheckpointError(
                        f"Refusing the checkpoint: {kind.__name__}() of {[type(a).__name__ for a in args]}"
                    )
                claim(64 * (len(args[0]) if args else 0) + 64, f"a {kind.__name__}")
                return kind(*args)

            return build

        def byte_string(kind: type) -> Callable:
            def build(*args):
                # bytes(n) would allocate n bytes out of one number in the file
                if len(args) > 3 or (args and not isinstance(args[0], (bytes, bytearray, str, list))):
                    raise CheckpointError(
                        f"Refusing the checkpoint: {kind.__name__}() of {[type(a).__name__ for a in args]}"
                    )
                claim(len(args[0]) * (4 if isinstance(args[0], str) else 1) if args else 0, f"a {kind.__name__}")
                return kind(*args)

            return build

        def number(kind: type) -> Callable:
            def build(*args):
                if len(args) > 2 or not all(isinstance(a, (int, float, str, bytes)) for a in args):
                    raise CheckpointError(
                        f"Refusing the checkpoint: {kind.__name__}() of {[type(a).__name__ for a in args]}"
                    )
                return kind(*args)

            return build

        table: dict[tuple[str, str], Any] = {
            ("numpy", "ndarray"): _NDARRAY,
            ("numpy", "dtype"): dtype,
            ("_codecs", "encode"): encode,
            ("collections", "OrderedDict"): container(OrderedDict),
        }
        for package in ("numpy.core", "numpy._core"):
            table[(f"{package}.multiarray", "_reconstruct")] = reconstruct
            table[(f"{package}.multiarray", "scalar")] = scalar
            table[(f"{package}.numeric", "_frombuffer")] = frombuffer
        for kind in (dict, list, tuple, set, frozenset):
            table[("builtins", kind.__name__)] = container(kind)
        for kind in (bytes, bytearray):
            table[("builtins", kind.__name__)] = byte_string(kind)
        for kind in (int, float, complex, bool, str):
            table[("builtins", kind.__name__)] = number(kind)
        return table

    # ---- BUILD: only an array's or a dtype's own state ------------------------------------------

    def load_build(self) -> None:
        """BUILD: set only an array's or a dtype's own state; anything else refused."""
        state = self.stack.pop()
        target = self.stack[-1]
        if isinstance(target, np.ndarray) and target.size == 0 and isinstance(state, tuple) and len(state) in (4, 5):
            _version, shape, dtype, _fortran, data = state if len(state) == 5 else (1, *state)
            dtype = _plain_dtype(dtype, "an array")
            size = _shape_size(shape, "an array")
            if not _byte_data(data) or memoryview(data).nbytes != size * dtype.itemsize:
                raise CheckpointError(
                    f"Refusing the checkpoint: an array claims the shape {shape!r} ({dtype}) for "
                    f"{memoryview(data).nbytes if _byte_data(data) else type(data).__name__} bytes of data"
                )
            self.claim(size * dtype.itemsize, "an array")
            target.__setstate__(state)
        elif (
            isinstance(target, np.dtype)
            and isinstance(state, tuple)
            and len(state) in (8, 9)
            and state[2:8] == (None, None, None, -1, -1, 0)
        ):  # a plain numeric dtype's state: no sub-array, fields, size, alignment or flags of its own
            target.__setstate__(state)
            _plain_dtype(target, "a dtype")
        else:
            raise CheckpointError(
                f"Refusing the checkpoint: its pickle sets the state of a {type(target).__name__}, which a reference "
                "checkpoint never does"
            )

    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid: Any) -> Any:
        """Refuse persistent ids: a reference checkpoint has none."""
        raise CheckpointError("Refusing the checkpoint: its pickle refers to persistent objects")


def load_pickle_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a reference `checkpoint.pkl` with `RestrictedUnpickler`, within a budget of twice its size."""
    path = Path(path)
    size = _file_size(path)
    check_memory(size * (1 + PICKLE_BUDGET_FACTOR), f"Reading {path} ({_gib(size)})")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CheckpointError(f"Cannot read {path}: {error.strerror or error}") from error
    if not data:
        raise CheckpointError(f"{path} is not a readable reference checkpoint: it is empty")
    try:
        checkpoint = RestrictedUnpickler(
            io.BytesIO(data), budget=PICKLE_BUDGET_FACTOR * size + SMALL_CLAIM_BYTES
        ).load()
    except CheckpointError:
        raise
    except RecursionError as error:
        raise CheckpointError(f"{path} is not a readable reference checkpoint: nested too deeply") from error
    except Exception as error:  # truncated, not a pickle, a wrapper's own TypeError, ...
        # (another file under the name: the unpickler's complaint about a text file is "IndexError: pop from empty
        # list"; the reference writes pickles of protocol 2 or later, which begin with PROTO, 0x80)
        other_file = (
            ""
            if data.startswith(pickle.PROTO)
            else f"; it does not begin as the reference's pickles do (it begins {data[:16]!r})"
        )
        raise CheckpointError(
            f"{path} is not a readable reference checkpoint: {type(error).__name__}: {error}{other_file}"
        ) from error
    del data
    if not isinstance(checkpoint, dict) or "params" not in checkpoint:
        keys = sorted(map(str, checkpoint)) if isinstance(checkpoint, dict) else type(checkpoint).__name__
        raise CheckpointError(f"{path} holds no 'params' entry (found {keys}); is it a reference trainer checkpoint?")
    return checkpoint


def _file_size(path: Path) -> int:
    try:
        if not path.is_file():
            raise CheckpointError(f"{path} is not a regular file")
        with path.open("rb"):  # readable?
            pass
        return path.stat().st_size
    except OSError as error:
        raise CheckpointError(f"Cannot read {path}: {error.strerror or error}") from error


# --------------------------------------------------------------------------------------------------
# Reading the checkpoint safely: params.npz, read header first
# --------------------------------------------------------------------------------------------------


@dataclass
class ArrayClaim:
    """What a file says about one parameter before its data is read: shape, dtype, and how to read it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        """Bytes the claimed array's shape and dtype take."""
        return math.prod(self.shape) * self.dtype.itemsize


def _npz_claims(path: Path, archive: zipfile.ZipFile) -> dict[str, ArrayClaim]:
    """name -> ArrayClaim for every member of an open npz, from its directory and `.npy` headers only."""
    file_size = path.stat().st_size
    members = archive.infolist()
    claimed_total = sum(info.file_size for info in members)
    if claimed_total > MAX_NPZ_EXPANSION * file_size + SMALL_CLAIM_BYTES:
        raise CheckpointError(
            f"Refusing {path}: its members claim {_gib(claimed_total)} uncompressed from a {file_size:,}-byte file "
            f"(more than {MAX_NPZ_EXPANSION}x): a zip bomb or a damaged archive"
        )
    claims: dict[str, ArrayClaim] = {}
    for info in members:
        if not info.filename.endswith(".npy") or info.is_dir():
            raise CheckpointError(f"Refusing {path}: member {info.filename!r} is not an .npy array")
        name = info.filename[: -len(".npy")]
        if name in claims:
            raise CheckpointError(f"Refusing {path}: parameter {name!r} appears twice")
        with archive.open(info) as member:
            try:
                version = np.lib.format.read_magic(member)
                read_header = (
                    np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                )
                shape, fortran_order, dtype = read_header(member)
                header_bytes = member.tell()
            except Exception as error:  # noqa: BLE001 - a bad header, a damaged or encrypted member, ...
                raise CheckpointError(
                    f"Refusing {path}: member {info.filename!r} has no valid .npy header: {type(error).__name__}: {error}"
                ) from error
        dtype = _plain_dtype(dtype, f"{path} member {info.filename!r}")
        data_bytes = _shape_size(tuple(shape), f"{path} member {info.filename!r}") * dtype.itemsize
        if header_bytes + data_bytes != info.file_size:
            raise CheckpointError(
                f"Refusing {path}: member {info.filename!r} claims shape {tuple(shape)} ({dtype}, {data_bytes:,} bytes) "
                f"but holds {info.file_size - header_bytes:,} bytes"
            )

        def read(
            info: zipfile.ZipInfo = info,
            shape: tuple[int, ...] = tuple(shape),
            dtype: np.dtype = dtype,
            fortran: bool = fortran_order,
            start: int = header_bytes,
            size: int = data_bytes,
        ):
            data = bytearray(size)  # size checked against the directory, the header and the config
            try:
                with archive.open(info) as member:
                    member.seek(start)
                    got = member.readinto(data)
                    member.read(1)  # reach the end: zipfile checks the CRC there
            except Exception as error:  # noqa: BLE001 - bad CRC, damaged deflate stream, ...
                raise CheckpointError(
                    f"{path}: member {info.filename!r} is damaged: {type(error).__name__}: {error}"
                ) from error
            if got != size:
                raise CheckpointError(f"{path}: member {info.filename!r} is truncated ({got:,} of {size:,} bytes)")
            return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")

        claims[name] = ArrayClaim(tuple(shape), dtype, read)
    return claims


def _read_config_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        if path.stat().st_size > 1 << 20:
            raise CheckpointError(f"{path} is {path.stat().st_size:,} bytes, too large for a config.json")
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"Cannot read {path}: {error.strerror or error}") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a {type(config).__name__}, not a JSON object of config values")
    return config


# --------------------------------------------------------------------------------------------------
# One view of either source
# --------------------------------------------------------------------------------------------------


@dataclass
class ReferenceSource:
    """An opened checkpoint: every parameter's claim, the reference config if any, and what the file holds."""

    path: Path
    claims: dict[str, ArrayClaim]
    config: dict[str, Any] | None
    archive: zipfile.ZipFile | None = None

    def close(self) -> None:
        """Close the archive the arrays are read from (if any)."""
        if self.archive is not None:
            self.archive.close()


def open_source(src: str | Path) -> ReferenceSource:
    """Open a `checkpoint.pkl`, a params.npz file or a folder holding either, reading no npz data yet."""
    src = Path(src)
    try:
        exists, is_dir = src.exists(), src.is_dir()
    except OSError as error:
        raise CheckpointError(f"Cannot read {src}: {error.strerror or error}") from error
    if not exists:
        raise CheckpointError(f"{src} does not exist")
    if is_dir:
        if (src / "params.npz").exists():
            return _open_npz(src / "params.npz", src / "config.json")
        if (src / "checkpoint.pkl").exists():
            return open_source(src / "checkpoint.pkl")
        if (src / "config.json").is_file() and any(src.glob("*.safetensors")):
            raise CheckpointError(
                f"{src} has neither params.npz nor checkpoint.pkl: it is a transformers folder (config.json and "
                "safetensors weights), which loads as it is with from_pretrained; gpn convert reads the reference's "
                "JAX checkpoints"
            )
        raise CheckpointError(f"{src} has neither params.npz nor checkpoint.pkl")
    if src.suffix == ".safetensors":
        raise CheckpointError(
            f"{src} is a safetensors file, not a reference checkpoint (a params.npz or checkpoint.pkl): a "
            "transformers folder loads as it is with from_pretrained"
        )
    if src.suffix == ".npz":
        return _open_npz(src, src.parent / "config.json")
    checkpoint = load_pickle_checkpoint(src)
    params = flatten_params(checkpoint["params"])
    _refuse_shared_arrays(src, params)
    # the trainer pickles no config; one beside it is read as beside a params.npz (ignored, its fields went unchecked)
    config = checkpoint.get("config")
    if not isinstance(config, dict):
        config = _read_config_json(src.parent / "config.json")
    claims = {
        name: ArrayClaim(array.shape, _plain_dtype(array.dtype, f"parameter {name!r}"), lambda array=array: array)
        for name, array in params.items()
    }
    return ReferenceSource(src, claims, config)


def _open_npz(npz: Path, config_json: Path) -> ReferenceSource:
    _file_size(npz)
    try:
        archive = zipfile.ZipFile(npz)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError) as error:
        raise CheckpointError(f"{npz} is not a readable npz file: {error}") from error
    except OSError as error:
        raise CheckpointError(f"Cannot read {npz}: {error.strerror or error}") from error
    try:
        claims = _npz_claims(npz, archive)
        config = _read_config_json(config_json)
    except BaseException:
        archive.close()
        raise
    return ReferenceSource(npz, claims, config, archive)


def _refuse_shared_arrays(path: Path, params: dict[str, np.ndarray]) -> None:
    """A reference checkpoint stores every parameter separately; one array behind several names would let a
    small pickle claim a model (e.g. a thousand layers) that it does not hold."""
    seen: dict[int, str] = {}
    for name, array in params.items():
        base = array
        while isinstance(base.base, np.ndarray):
            base = base.base
        owner = id(base.base) if base.base is not None else id(base)
        if array.size and owner in seen:
            raise CheckpointError(
                f"Refusing {path}: parameters {seen[owner]!r} and {name!r} are the same array; a reference "
                "checkpoint stores every parameter separately"
            )
        seen[owner] = name


def read_source(src: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """Return (flat parameter dict, reference config or None) from a `checkpoint.pkl` or a params.npz folder.

    Reads every array (the npz claims are checked first); `load_reference_model` reads only what the
    inferred config maps.
    """
    source = open_source(src)
    try:
        return {name: claim.read() for name, claim in source.claims.items()}, source.config
    finally:
        source.close()


def flatten_params(tree: Any, prefix: str = "", depth: int = 0) -> dict[str, np.ndarray]:
    """Flatten a (possibly nested, e.g. {'params': {...}}) Flax parameter tree to name -> array."""
    if depth > MAX_NESTING:
        raise CheckpointError(f"Parameter tree nested more than {MAX_NESTING} deep at {prefix!r}")
    if isinstance(tree, dict):
        if set(tree) == {"params"}:
            return flatten_params(tree["params"], prefix, depth + 1)
        flat = {}
        for key, value in tree.items():
            if not isinstance(key, str):
                raise CheckpointError(f"Parameter tree has a key {key!r} of type {type(key).__name__}, not a name")
            flat.update(
                flatten_params(value, f"{prefix}{key}/" if isinstance(value, dict) else f"{prefix}{key}", depth + 1)
            )
        return flat
    if isinstance(tree, (np.ndarray, np.generic, int, float)) and not isinstance(tree, bool):
        return {prefix.rstrip("/"): np.asarray(tree)}
    raise CheckpointError(f"Parameter {prefix!r} is a {type(tree).__name__}, not a numpy array")


# --------------------------------------------------------------------------------------------------
# Config and parameter map
# --------------------------------------------------------------------------------------------------


def infer_config(params: dict[str, Any], reference_config: dict[str, Any] | None = None) -> GPNConfig:
    """Build a `GPNConfig` from the reference config (if given) checked against the parameter shapes.

    `params` maps names to anything with a `.shape` (arrays, or the `ArrayClaim`s of a file not read yet).
    """
    try:
        return _infer_config(params, reference_config)
    except CheckpointError:
        raise
    except (ValueError, TypeError, ZeroDivisionError, IndexError) as error:  # shapes of the wrong rank, zero heads, ...
        raise CheckpointError(f"Cannot infer a valid model config from the parameter shapes: {error}") from error


def _infer_config(params: dict[str, Any], reference_config: dict[str, Any] | None) -> GPNConfig:

    def shape(*names: str) -> tuple[int, ...]:
        """Shape of the first of `names` present (several parameters reveal the same size)."""
        for name in names:
            if name in params:
                return tuple(int(n) for n in params[name].shape)
        raise CheckpointError(f"Cannot infer the model size: none of {', '.join(names)} is in the checkpoint")

    embedding_shape = shape("embedding")
    if len(embedding_shape) != 2:
        raise CheckpointError(f"embedding has shape {embedding_shape}, not (vocab_size, embedding_size)")
    vocab_size, embedding_size = embedding_shape
    hidden_size = shape("fuse_proj_k", "fg_gate_k")[-1]
    use_memory = any(name.startswith("write_") for name in params)
    layer_indices = sorted({int(m.group(1)) for name in params if (m := re.match(r"L(\d+)_", name))})
    prefix = "L0_" if use_memory else ""
    if f"{prefix}ffn_w1_k" in params:  # (d, 2f)
        intermediate_size = shape(f"{prefix}ffn_w1_k")[1] // 2
    else:  # (f, d)
        intermediate_size = shape(f"{prefix}ffn_w2_k")[0]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        embedding_size=embedding_size,
        intermediate_size=intermediate_size,
        num_predict_layers=max(len(layer_indices), 1),
        use_memory=use_memory,
        use_decoder_bias="decode_bias" in params,
    )
    if use_memory:
        heads = shape("write_A_log", "write_dt_bias", "write_W_beta_k", "write_W_a_k")[-1]
        kwargs.update(
            num_memory_heads=heads,
            memory_key_dim=shape("write_W_k_k", "L0_read_W_q_k", "write_W_k_b", "L0_read_W_q_b")[-1] // heads,
            memory_value_dim=shape("write_W_v_k", "L0_read_W_gate_k", "L0_read_out_norm_w")[-1] // heads,
        )
    if reference_config:
        names = {
            "vocab_size": "vocab_size",
            "d_state": "hidden_size",
            "d_emb": "embedding_size",
            "d_ffn": "intermediate_size",
            "n_heads": "num_memory_heads",
            "d_key": "memory_key_dim",
            "d_val": "memory_value_dim",
            "n_layers": "num_predict_layers",
            "use_decoder_bias": "use_decoder_bias",
        }
        # SoTMConfig / SoTConfig have exactly these fields: another is an option this converter does not know (a
        # variant of a later reference, a misspelt field), and ignoring it would convert another model in silence
        unknown = sorted(set(reference_config) - set(names))
        if unknown:
            raise CheckpointError(
                f"The checkpoint's config.json has fields the reference's SoTMConfig / SoTConfig does not: "
                f"{', '.join(unknown)} (gpn convert knows {', '.join(names)}); a variant it does not implement "
                "is not converted"
                + (" (is it the training config? its 'model' entry is the model's)" if "model" in unknown else "")
            )
        disagreements = [
            f"{ref_name}={reference_config[ref_name]} but the parameters say {ours}={kwargs[ours]}"
            for ref_name, ours in names.items()
            if ref_name in reference_config and ours in kwargs and reference_config[ref_name] != kwargs[ours]
        ]
        # A memory-less model has no memory sizes to compare: a config giving them (the reference's SoTMConfig)
        # describes a GPN+M whose memory parameters are all absent, not a GPN to convert without its memory.
        memory_sizes = [
            f"{name}={reference_config[name]}" for name in ("n_heads", "d_key", "d_val") if name in reference_config
        ]
        if memory_sizes and not use_memory:
            disagreements.append(
                f"{', '.join(memory_sizes)} (a model with memory) but the parameters have no memory (no write_* parameters)"
            )
        if disagreements:
            stated = {
                ours: reference_config[ref] for ref, ours in names.items() if ref in reference_config and ours in kwargs
            }
            # at most the layers the parameters have: a stray L1_ tensor is then named as unexpected, and a claimed
            # million layers is not built (even on the meta device that takes long)
            layers = stated.get("num_predict_layers")
            if isinstance(layers, int):
                stated["num_predict_layers"] = min(layers, kwargs["num_predict_layers"])
            raise CheckpointError(
                "The checkpoint's config.json disagrees with its parameters: "
                + "; ".join(disagreements)
                + _misfits(params, {**kwargs, **stated})
            )
    return GPNConfig(**kwargs)


def _misfits(params: dict[str, Any], sizes: dict[str, Any]) -> str:
    """The parameters that a model of config.json's sizes cannot take, named: a size is inferred from one
    parameter's shape, so one misshaped parameter shows as a disagreeing size, not by its own name."""
    try:
        plan_conversion(params, GPNConfig(**sizes))
    except CheckpointError as error:
        return f" (with config.json's sizes: {str(error).removeprefix('Cannot convert the checkpoint: ')})"
    except (ValueError, TypeError):  # config.json's sizes are not a valid config themselves
        pass
    return ""


def parameter_map(config: GPNConfig) -> dict[str, tuple[str, bool]]:
    """reference name -> (transformers state-dict name, transpose?) for a model of this config."""
    mapping = {
        "embedding": ("model.embed_tokens.weight", False),
        "fuse_norm_w": ("model.fuse_norm.weight", False),
        "fuse_proj_k": ("model.fuse_proj.weight", True),
        "fg_norm_w": ("model.fuse_gate_norm.weight", False),
        "fg_gate_k": ("model.fuse_gate.weight", True),
        "fg_gate_b": ("model.fuse_gate.bias", False),
        "decode_norm_w": ("model.decode_norm.weight", False),
        "decode_proj_k": ("model.decode_proj.weight", True),
    }
    if config.use_decoder_bias:
        mapping["decode_bias"] = ("model.decode_proj.bias", False)
    layer_params = {
        "ffn_norm_w": ("ffn_norm.weight", False),
        "ffn_w1_k": ("ffn_in.weight", True),
        "ffn_w2_k": ("ffn_out.weight", True),
        "pg_norm_w": ("gate_norm.weight", False),
        "pg_gate_k": ("gate.weight", True),
        "pg_gate_b": ("gate.bias", False),
    }
    if config.use_memory:
        layer_params.update(
            {
                "read_norm_w": ("read_norm.weight", False),
                "read_W_q_k": ("read_query.weight", True),
                "read_W_q_b": ("read_query.bias", False),
                "read_W_gate_k": ("read_gate.weight", True),
                "read_out_norm_w": ("read_out_norm.weight", False),
                "read_W_o_k": ("read_out.weight", True),
            }
        )
        mapping.update(
            {
                "write_norm_w": ("model.memory_write.norm.weight", False),
                "write_W_k_k": ("model.memory_write.key.weight", True),
                "write_W_k_b": ("model.memory_write.key.bias", False),
                "write_W_v_k": ("model.memory_write.value.weight", True),
                "write_W_beta_k": ("model.memory_write.beta.weight", True),
                "write_W_a_k": ("model.memory_write.decay.weight", True),
                "write_A_log": ("model.memory_write.A_log", False),
                "write_dt_bias": ("model.memory_write.dt_bias", False),
            }
        )
        for i in range(config.num_predict_layers):
            for ref_name, (name, transpose) in layer_params.items():
                mapping[f"L{i}_{ref_name}"] = (f"model.predict_layers.{i}.{name}", transpose)
    else:  # the reference's memory-less model has one predict layer and no prefix
        for ref_name, (name, transpose) in layer_params.items():
            mapping[ref_name] = (f"model.predict_layers.0.{name}", transpose)
    return mapping


# --------------------------------------------------------------------------------------------------
# Conversion: claims checked against the config, then read one parameter at a time
# --------------------------------------------------------------------------------------------------


def _state_shapes(config: GPNConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of a model's state dict, from a model built on the meta device (nothing allocated); the tied output
    head (`lm_head.weight`, the embedding itself) is not a parameter of its own."""
    with torch.device("meta"):
        model = GPNForCausalLM(config)
    tied = set(model.all_tied_weights_keys)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in tied}


def config_parameter_bytes(config: GPNConfig) -> int:
    """Bytes of the float32 parameters of a model of this config (plus a per-tensor overhead), computed from
    one- and two-layer meta models, so a config claiming a million layers costs nothing to price."""

    def cost(layers: int) -> int:
        shapes = _state_shapes(GPNConfig(**{**config.to_dict(), "num_predict_layers": layers}))
        return sum(4 * math.prod(shape) + TENSOR_OVERHEAD_BYTES for shape in shapes.values())

    one = cost(1)
    per_layer = cost(2) - one
    return one + (config.num_predict_layers - 1) * per_layer


def plan_conversion(claims: dict[str, Any], config: GPNConfig) -> list[tuple[str, str, bool]]:
    """(reference name, state-dict name, transpose?) for every parameter, after checking every claim's shape
    and dtype against the config; one `CheckpointError` lists every problem."""
    expected = _state_shapes(config)
    mapping = parameter_map(config)
    missing = sorted(set(mapping) - set(claims))
    unexpected = sorted(set(claims) - set(mapping))
    bad = []
    plan = []
    for ref_name, (name, transpose) in mapping.items():
        if ref_name not in claims:
            continue
        stored = tuple(claims[ref_name].shape)
        want = expected[name][::-1] if transpose else expected[name]
        if stored != want:
            bad.append(f"{ref_name}: shape {stored}, expected {want}")
        elif claims[ref_name].dtype.kind != "f":
            bad.append(f"{ref_name}: dtype {claims[ref_name].dtype}, not floating point")
        else:
            plan.append((ref_name, name, transpose))
    if missing or unexpected or bad:
        parts = []
        if missing:
            parts.append(f"missing parameters: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected parameters: {', '.join(unexpected)}")
        if bad:
            parts.append(f"bad parameters: {'; '.join(bad)}")
        raise CheckpointError("Cannot convert the checkpoint: " + " | ".join(parts))
    return plan


class ConversionNotice(UserWarning):
    """Something `gpn convert` changed on the way that the folder's user should know (`gpn convert` prints it
    as one line)."""


def _convert(claims: dict[str, Any], config: GPNConfig, what: str) -> GPNForCausalLM:
    """A `GPNForCausalLM` holding the claimed parameters, read one at a time once every claim is checked."""
    plan = plan_conversion(claims, config)
    need = 2 * config_parameter_bytes(config)  # the model, and each parameter once more while it is read
    check_memory(need, f"Converting {what} ({config.num_predict_layers} layers, vocabulary {config.vocab_size:,})")
    model = GPNForCausalLM(config)
    state_dict = {}
    nonfinite = []
    # a GPN's parameters are float32 (the dtype every path computes in, and training keeps its master weights
    # in): another float dtype is converted, and said, as it changes what the folder holds
    other_dtypes = sorted({claims[ref_name].dtype.name for ref_name, _, _ in plan} - {"float32"})
    if other_dtypes:
        warnings.warn(
            f"the checkpoint's parameters are {', '.join(other_dtypes)}: converted to float32 (float16 values "
            "exactly, wider ones rounded to the nearest float32)",
            ConversionNotice,
            stacklevel=2,
        )
    for ref_name, name, transpose in plan:
        array = claims[ref_name].read()
        tensor = torch.from_numpy(np.array(array.T if transpose else array, dtype=np.float32, order="C"))
        del array
        if not torch.isfinite(tensor).all():
            nonfinite.append(ref_name)
        state_dict[name] = tensor
    if nonfinite:
        raise CheckpointError(
            f"Cannot convert the checkpoint: bad parameters: {'; '.join(f'{n}: contains NaN or inf' for n in nonfinite)} "
            "(a diverged or damaged checkpoint; convert an earlier one)"
        )
    for tied, source in model.all_tied_weights_keys.items():  # lm_head.weight is the embedding
        state_dict[tied] = state_dict[source]
    model.load_state_dict(state_dict, strict=True)
    return model.eval()


def load_reference_model(src: str | Path) -> GPNForCausalLM:
    """Read a reference checkpoint (pickle or params.npz folder) and return the converted model.

    Shapes are read first; only the parameters the inferred config maps, with the expected shapes,
    are read, after checking that the model fits in memory. Raises `CheckpointError` naming the problem.
    """
    source = open_source(src)
    try:
        config = infer_config(source.claims, source.config)
        return _convert(source.claims, config, str(src))
    finally:
        source.close()


def convert(src: str | Path, out: str | Path, tokenizer: str | None = None) -> GPNForCausalLM:
    """Convert SRC to a `save_pretrained` folder OUT (safetensors, config with auto_map, modeling files), with
    `conversion.json` naming SRC (`conversion_record`) for the card `gpn push` writes.

    OUT must be new or empty: files already there (a tokenizer of another model) would stay beside the new
    model. A `tokenizer` saved beside it must make only ids the model has (its ids below `vocab_size`). Both
    are refused, as `CheckpointError`, before anything is written; a write that fails part-way (a full disk)
    removes what it wrote.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"Cannot write the converted model to {out}: it is a file, not a folder")
    # OUT is created and held (an flock) from the check that it is empty to the end of the write: two conversions
    # into one new folder both found it empty and wrote into it, each file the last writer's, a model mixed of two
    # in silence. A second one meanwhile is refused, naming the first; OUT is removed again (while held) where
    # the conversion fails, as it would have been left unwritten.
    created = not out.exists()
    with contextlib.ExitStack() as holding:
        try:
            out.mkdir(parents=True, exist_ok=True)
            holding.enter_context(
                held(
                    out,
                    "that writes a converted model into it (gpn convert)",
                    "wait for it to end, or name another folder",
                )
            )
        except OSError as error:  # (a folder that cannot be created, or one another process holds)
            raise CheckpointError(f"Cannot write the converted model to {out}: {error.strerror or error}") from error
        if any(out.iterdir()):
            raise CheckpointError(
                f"Cannot write the converted model to {out}: the folder is not empty (its files would stay beside the "
                "new model); name a new or empty folder, or remove it first"
            )
        try:
            return _convert_into(src, out, tokenizer)
        except BaseException:
            # OUT was new or empty: what was written of it is no model (code files without weights, or weights
            # without the tokenizer), and left there it would make the next try refuse OUT as not empty
            _remove_written(out, created)
            raise


def _convert_into(src: str | Path, out: Path, tokenizer: str | None) -> GPNForCausalLM:
    """`convert`'s work, into the held, empty folder `out`."""
    loaded_tokenizer = _load_tokenizer(tokenizer) if tokenizer else None  # a bad name costs no conversion
    model = load_reference_model(src)
    if loaded_tokenizer is not None:
        ids = max(loaded_tokenizer.get_vocab().values()) + 1
        if ids > model.config.vocab_size:
            raise CheckpointError(
                f"The tokenizer {tokenizer!r} has {ids:,} token ids, more than the model's vocab_size of "
                f"{model.config.vocab_size:,}: save the tokenizer the checkpoint was trained with"
            )
        # The ids that begin, end and pad a text are the tokenizer's, as `gpn train` sets them: the config's
        # defaults are LLaMA-2's (1, 2), which another tokenizer gives to ordinary tokens, so generate() stopped
        # at one of those and never at the tokenizer's own end of text.
        bos, eos, pad = loaded_tokenizer.bos_token_id, loaded_tokenizer.eos_token_id, loaded_tokenizer.pad_token_id
        model.config.update({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad})
        model.generation_config.update(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos if pad is None else pad)
    try:
        model.save_pretrained(out)
        if loaded_tokenizer is not None:
            loaded_tokenizer.save_pretrained(out)
        # what the weights came from, for the card `gpn push` writes (modeling_gpn.hub's CONVERSION_RECORD); names,
        # not the local path, which says nothing to a reader of the card and may be private
        (out / "conversion.json").write_text(json.dumps(conversion_record(src), indent=2) + "\n", encoding="utf-8")
    except OSError as error:
        raise CheckpointError(f"Cannot write the converted model to {out}: {error.strerror or error}") from error
    return model


def conversion_record(src: str | Path) -> dict[str, str]:
    """What `convert` records of SRC beside the model: its name (a folder's, or a file's with its folder's) and
    its format."""
    src = Path(src).resolve()
    if src.is_dir():
        kind = "params.npz" if (src / "params.npz").exists() else "checkpoint.pkl"
        return {"converted_with": "gpn convert", "source": src.name, "format": kind}
    kind = "params.npz" if src.suffix == ".npz" else "checkpoint.pkl"
    return {"converted_with": "gpn convert", "source": f"{src.parent.name}/{src.name}", "format": kind}


def _remove_written(out: Path, created: bool) -> None:
    """Remove what a failed write put into OUT, which was new (`created`) or empty."""
    if created:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in out.iterdir() if out.is_dir() else ():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _load_tokenizer(name: str):
    """The tokenizer `name` (a Hub id or a folder), any failure as one `CheckpointError` naming it."""
    from modeling_gpn.data import DataError, load_tokenizer

    try:
        return load_tokenizer(name, require_eos=False)
    except DataError as error:
        raise CheckpointError(str(error)) from error
