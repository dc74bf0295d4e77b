"""The checks `gpn push` makes before anything touches the network: of the source folder (no pickles, a
config that loads as a GPNConfig, safetensors weights matching it) and of the folder to upload (self-contained
remote code, a card the Hub parses, no Hub token in any file)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..configuration_gpn import GPNConfig

from .card_metadata import validate_card
from .errors import CardError, HubPushError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# safetensors and huggingface_hub are dependencies of transformers itself, present wherever it is: GPNCache.save /
# load write and read state files with safetensors; generate() asks huggingface_hub whether the Hub is offline.
ALLOWED_CODE_IMPORTS = frozenset({"torch", "transformers", "safetensors", "huggingface_hub", "__future__"}) | frozenset(
    sys.stdlib_module_names
)


def pickle_files(folder: Path, recursive: bool) -> list[str]:
    """The pickle files (which can run code when loaded) in `folder`, or in all of it with `recursive`."""
    paths = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(str(p.relative_to(folder)) for p in paths if p.is_file() and p.name.lower().endswith(PICKLE_SUFFIXES))


def load_folder_config(model_dir: Path) -> tuple[GPNConfig, dict]:
    """The `GPNConfig` of `model_dir`, or `HubPushError` saying why it does not load."""
    from ..configuration_gpn import GPNConfig

    path = model_dir / "config.json"
    if not path.is_file():
        raise HubPushError(
            f"{model_dir} has no config.json: is it a folder written by save_pretrained / gpn train / gpn convert?"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise HubPushError(f"{path} is not valid JSON: {error}") from error
    if not isinstance(raw, dict) or raw.get("model_type") != GPNConfig.model_type:
        found = raw.get("model_type") if isinstance(raw, dict) else None
        raise HubPushError(f"{path} has model_type {found!r}; gpn push publishes GPN models (model_type 'gpn')")
    try:
        config = GPNConfig.from_pretrained(model_dir)
    except Exception as error:  # noqa: BLE001 - any failure means the config does not load
        raise HubPushError(f"{path} does not load as a GPNConfig: {error}") from error
    return config, raw


WEIGHTS_INDEX = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[Path]:
    """The top-level safetensors weights of `model_dir`: model.safetensors alone, or the shards its index names.

    A file left from an earlier save is refused: save_pretrained into a folder removes neither the index of an
    earlier sharded save nor an earlier single model.safetensors, and transformers loads model.safetensors
    whenever there is one, so a stale one beside fresh shards would be the published model."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise HubPushError(
            f"{model_dir} has no *.safetensors weights; gpn push uploads safetensors only "
            "(re-save the model with save_pretrained, which writes model.safetensors)"
        )
    present = {path.name for path in files}
    index = model_dir / WEIGHTS_INDEX
    if not index.is_file():
        named = {"model.safetensors"}
    else:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            named = {str(name) for name in weight_map.values()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise HubPushError(f"{index} is not a weights index (a JSON 'weight_map'): {error!r}") from error
    absent, stray = sorted(named - present), sorted(present - named)
    if absent or stray:
        if index.is_file():
            problems = ([f"its {WEIGHTS_INDEX} names {', '.join(absent)}, not there"] if absent else []) + (
                [f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} not in its {WEIGHTS_INDEX}"] if stray else []
            )
        else:  # no index: only model.safetensors is read, and it is not alone (or not there)
            problems = [
                f"{', '.join(stray)} {'is' if len(stray) == 1 else 'are'} there with no {WEIGHTS_INDEX} naming"
                f" {'it' if len(stray) == 1 else 'them'}" + (" and no model.safetensors" if absent else "")
            ]
        raise HubPushError(
            f"{model_dir}'s weights files do not agree ({'; '.join(problems)}): one of them is left from an earlier "
            "save (save_pretrained removes neither); delete the stale files, or save to a new folder"
        )
    return files


def check_weights(files: list[Path], config: GPNConfig) -> int:
    """Tensor names and shapes of `files` match the model `config` describes; returns the parameter count."""
    import torch
    from safetensors import safe_open

    from ..modeling_gpn import GPNForCausalLM

    with torch.device("meta"):
        model = GPNForCausalLM(config)
    tied = set(model.all_tied_weights_keys)  # lm_head.weight is the embedding: not stored
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items() if name not in tied}
    found: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    # an older folder's decoder keys lack the base model's prefix; transformers loads them as these
                    name_in_model = f"model.{name}" if name not in expected and f"model.{name}" in expected else name
                    found[name_in_model] = tuple(handle.get_slice(name).get_shape())
        except Exception as error:  # noqa: BLE001
            raise HubPushError(f"{path} is not a readable safetensors file: {error}") from error
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = [
        f"{n}: {found[n]} vs config {expected[n]}"
        for n in sorted(set(found) & set(expected))
        if found[n] != expected[n]
    ]
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if misshaped:
        problems.append(f"shapes differ: {'; '.join(misshaped)}")
    if problems:
        raise HubPushError("the weights do not match config.json: " + " | ".join(problems))
    n_params = 0
    for shape in found.values():
        count = 1
        for size in shape:
            count *= size
        n_params += count
    return n_params


def relative_imports(path: Path) -> list[tuple[int, int, str | None, list[str]]]:
    """Every relative import in the Python file at `path`, deferred ones included, as (line, level, module,
    names): `from .cache import GPNCache` is (n, 1, "cache", ["GPNCache"]), `from . import cache` (n, 1, None,
    ["cache"]). Read from the syntax tree, so no form of the statement escapes."""
    return _relative_imports_of(path.read_text(encoding="utf-8"), str(path))


def _relative_imports_of(text: str, filename: str) -> list[tuple[int, int, str | None, list[str]]]:
    tree = ast.parse(text, filename=filename)
    return [
        (node.lineno, node.level, node.module, [alias.name for alias in node.names])
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]


# What each shipped file imports, by the SHA-256 of its text: a push parses the twenty-odd files of the remote code
# twice (once written, and in the last checks before the upload), and a process that pushes again (a script, the
# tests) parses the same files each time; the parses were most of a dry run's time. Keyed by the text, a file that
# changed is parsed anew. The texts least recently checked are let go past IMPORTS_KEPT: a long-lived process that
# pushes code edited between pushes (a notebook, a training script pushing each checkpoint) would otherwise keep every
# text's imports to its end.
_IMPORTS_OF_TEXT: dict[bytes, tuple[frozenset[str], list[tuple[int, int, str | None, list[str]]]]] = {}
IMPORTS_KEPT = 256  # texts whose imports are kept (a push checks some twenty files, twice)


def _code_imports(path: Path) -> tuple[frozenset[str], list[tuple[int, int, str | None, list[str]]]]:
    """(the top-level packages, as transformers' `get_imports` finds them; the relative imports) of the file."""
    from transformers.dynamic_module_utils import get_imports

    text = path.read_text(encoding="utf-8")
    key = hashlib.sha256(text.encode("utf-8")).digest()
    found = _IMPORTS_OF_TEXT.pop(key, None)
    if found is not None:
        _IMPORTS_OF_TEXT[key] = found  # (now the most recently checked: a dict keeps its order of insertion)
        return found
    found = (frozenset(get_imports(path)), _relative_imports_of(text, str(path)))
    if path.read_text(encoding="utf-8") == text:  # (get_imports read the same text: kept for that text alone)
        _IMPORTS_OF_TEXT[key] = found
        while len(_IMPORTS_OF_TEXT) > IMPORTS_KEPT:  # (the least recently checked first)
            _IMPORTS_OF_TEXT.pop(next(iter(_IMPORTS_OF_TEXT)), None)
    return found


def _relative_import_problem(name: str, folder: Path, line: int, level: int, module: str | None, names: list[str]):
    """Why a relative import of the shipped file `name` would fail once published, or None.

    transformers' remote-code loader ships and fetches exactly the files its pattern `from .module import`
    names (`get_relative_import_files`), flat beside the modeling file: `from . import module` (which it does not
    see), a package (`.pkg.module`) or a module above the folder is missing on the Hub, though it imports here."""
    where = f"{name} line {line}"
    if level > 1:
        return f"{where} imports from {'.' * level}{module or ''}, outside the folder that ships"
    if module is None:
        return (
            f"{where}: `from . import {', '.join(names)}` is not followed by transformers' remote-code loader (it "
            "ships the files of `from .module import name` only): write `from .module import name`"
        )
    if "." in module:
        return f"{where} imports .{module}: the remote code is one flat folder of modules, not packages"
    if not (folder / f"{module}.py").is_file():
        return f"{name} imports .{module}, which is not in the folder"
    return None


def check_remote_code(folder: Path) -> list[str]:
    """Every shipped .py file imports only torch, transformers (and its own dependencies safetensors and
    huggingface_hub), the standard library and shipped files, each in a form transformers' remote-code loader
    follows (`relative_imports`); returns their names."""
    code_files = sorted(p.name for p in folder.glob("*.py"))
    problems = []
    for name in code_files:
        imported, relative = _code_imports(folder / name)
        foreign = sorted(imported - ALLOWED_CODE_IMPORTS)
        if foreign:
            hint = " (the installed package never ships: import it relatively)" if "modeling_gpn" in foreign else ""
            problems.append(f"{name} imports {', '.join(foreign)}{hint}")
        for line, level, module, names in relative:
            problem = _relative_import_problem(name, folder, line, level, module, names)
            if problem:
                problems.append(problem)
    if problems:
        raise HubPushError("the remote code is not self-contained: " + "; ".join(problems))
    return code_files


def token_values(token: str | None) -> list[str]:
    """The Hub tokens this process could use (given, or from the environment), never to be uploaded or printed."""
    values = [token, os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")]
    return [v for v in values if v and len(v) >= 8]


def check_prepared_folder(folder: str | Path, token: str | None = None) -> list[str]:
    """The last checks before an upload; returns the relative file list. Raises `HubPushError`."""
    folder = Path(folder)
    pickles = pickle_files(folder, recursive=True)
    if pickles:
        raise HubPushError(f"refusing to upload pickle files: {', '.join(pickles)}")
    files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    for required in ("config.json", "README.md", "generation_config.json", "configuration_gpn.py", "modeling_gpn.py"):
        if required not in files:
            raise HubPushError(f"the upload folder lacks {required}")
    check_remote_code(folder)
    try:
        validate_card((folder / "README.md").read_text(encoding="utf-8"))
    except CardError as error:
        raise HubPushError(str(error)) from error
    secrets = [secret.encode() for secret in token_values(token)]
    for name in files:
        if secrets and _file_contains(folder / name, secrets):
            raise HubPushError(f"{name} contains the Hub token; refusing to upload it")
    return files


def _file_contains(path: Path, needles: list[bytes], chunk_size: int = 1 << 22) -> bool:
    """Whether any of `needles` occurs in the file (streamed: weights files can be many GB)."""
    overlap = max(len(n) for n in needles) - 1
    tail = b""
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_size):
            window = tail + chunk
            if any(n in window for n in needles):
                return True
            tail = window[-overlap:] if overlap else b""
    return False
