"""Checks of arguments that several `gpn` subcommands share, run before any work starts, so that a bad
argument costs no computation. Its own module below the command (as `formatting.py`), so that the
subcommands' modules can import it without importing the command."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# what the MODEL argument of gpn generate, eval and serve may also be (`cli.loading.load_causal_lm`), said once
ADAPTER_FOLDER_HELP = (
    "a PEFT adapter folder (its base, named in adapter_config.json, with the adapter merged; tokenizer: the adapter "
    "folder's own, else the base's)"
)


def writable_folder(path: str | Path, option: str) -> Path:
    """`path` as a folder that either exists and takes new files, or can be created (its nearest existing
    parent takes new files); nothing is created, so a run refused later leaves no empty folder behind.

    Raises `ValueError` naming `option` when it cannot: a file of that name (or of a parent's name), a folder
    that refuses a file (read-only, a pseudo file system). Checked by writing a scratch file, not by
    `os.access`, which says yes to root on a read-only file system.
    """
    folder = Path(path).expanduser()
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{option} {path}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write in {existing}: {error.strerror or error}") from None
    return folder


def torch_device(device: str) -> torch.device:
    """`device` as a torch device this machine has. Raises `ValueError` naming `--device` for a name torch does not
    know (`toaster`), CUDA (or mps, xpu...) on a machine without it, or a CUDA index beyond the machine's GPUs:
    otherwise each would surface as a traceback only once the model has loaded and is being moved."""
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError as error:
        raise ValueError(f"--device {device!r} is not a torch device: {error}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device} asks for CUDA, which this machine does not have; use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    # mps (Apple silicon), xpu (Intel GPUs) and the like: torch.mps, torch.xpu, ... say whether this machine has one
    elif not getattr(getattr(torch, parsed.type, None), "is_available", lambda: True)():
        raise ValueError(
            f"--device {device} asks for {parsed.type}, which this machine does not have; use --device cpu"
        )
    return parsed


def check_no_earlier_output(folder: Path, names: tuple[str, ...], option: str, what: str) -> None:
    """Refuse `folder` (given as `option`) when it holds any of `names`, an earlier run's `what` (a report, an
    evaluation), which the run would replace without notice, unless the command's --overwrite is given."""
    held = [name for name in names if (folder / name).exists()]
    if held:
        raise ValueError(
            f"{option} {folder} already holds {what} ({', '.join(held)}); choose another folder, or give --overwrite "
            "to replace it"
        )


def same_path(first: str | Path, second: str | Path) -> bool:
    """Whether `first` and `second` name one file or folder however they are spelt: through a link or a hard link,
    `./x` against `x`, a trailing slash, a leading `~`. Paths not there compare as written, resolved."""
    first, second = Path(first).expanduser(), Path(second).expanduser()
    try:
        return os.path.samefile(first, second)
    except OSError:
        return first.resolve() == second.resolve()


def refuse_output_over_inputs(output: str | Path, option: str, inputs: dict[str, list[str | Path]]) -> None:
    """Refuse (`ValueError`) an output file `output`, given as `option`, that is one of the files the same command
    reads (`inputs`: option -> the paths given to it; names that are no file, a preset's, are passed over): the
    run would replace its own input once it ends (`gpn bench --preset my.json --json my.json` replaced the
    preset with its report)."""
    for input_option, paths in inputs.items():
        for path in paths:
            if Path(path).expanduser().is_file() and same_path(path, output):
                raise ValueError(
                    f"{option} {output} is the file {input_option} {path} reads: writing it would replace that "
                    "input; name another file"
                )
