"""Files replaced whole or not at all: written under a temporary name beside them, fsynced, renamed over them,
and their folder fsynced.

The one way gpn replaces a file: a kept state (`state_file.py`), a training run's settings, rewritten log
and checkpoint state (`train/run_folder.py`), `gpn bench --json`'s report, `gpn study`'s report and results,
`gpn serve`'s spilled states. A crash or an interruption at any instant leaves the old content or the new one,
never a mix; an exception (Ctrl-C too) leaves no temporary file behind, a killed process (`kill -9`) its hidden one.
A path that is a device, pipe or socket is refused, not replaced. The standard library only: it ships with the model,
which saves states through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def fsync(path: str | os.PathLike) -> None:
    """fsync a file, or a folder (which makes the names in it, e.g. a rename, durable)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if Path(path).is_dir() else 0)
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """A handle (`mode` "w" or "wb") on a new file that replaces `path` when the block ends.

    The file is written under a temporary name of its own in `path`'s folder (process, thread and a random
    part: two threads replacing one path never share it), then fsynced and renamed over `path`, and the folder
    fsynced. If the block raises, the temporary file is removed and `path` is left as it was. An `OSError`
    (a full disk, a missing or read-only folder, a `path` that is a device, pipe or socket) names `path`, not the
    hidden temporary file.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"replacing() writes a new file: mode 'w' or 'wb', got {mode!r}")
    path = Path(path)
    try:
        existing = os.stat(path).st_mode  # (through a link: /dev/stdout is one, to a pipe or a terminal)
    except OSError:
        existing = None
    if existing is not None and not (stat.S_ISREG(existing) or stat.S_ISDIR(existing)):
        # The rename would put a file in place of the device, pipe or socket (root replaced /dev/full, and the
        # /dev/stdout link, with a state file), where the caller meant to write into it.
        raise OSError(errno.EINVAL, "a device, pipe or socket, not a file (replacing it would remove it)", str(path))
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}")
    created = False
    try:
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        created = True
        with open(descriptor, mode, encoding="utf-8" if mode == "w" else None) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        if error.errno is None:  # (not a system call's error: nothing to rename)
            raise
        raise type(error)(error.errno, error.strerror, str(path)) from error
    finally:
        # Only a temporary file this call created: on a read-only file system, removing one that is not there
        # fails too (EROFS, not ENOENT), and that error, naming the hidden temporary name, replaced the one above.
        if created:
            temporary.unlink(missing_ok=True)
    if hasattr(os, "O_DIRECTORY"):  # (where a folder can be opened to fsync it: not on Windows)
        fsync(path.parent)


def write_file_atomically(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace `path` with `data` (a str is written as UTF-8) through `replacing`: a crash at any instant
    leaves either its old content or the new one."""
    with replacing(path, "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
