"""Where the data pipeline keeps what it computed once (token shards, trained tokenizers): the cache folder,
the content key of a cached folder, and writing such a folder whole or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

from ..atomic_files import held
from .errors import DataError

try:
    import fcntl  # POSIX (Linux, macOS): the writing lock that tells a live write from a killed one
except ImportError:  # Windows: no flock. Writes stay whole-or-nothing (the rename); abandoned ones are kept
    fcntl = None


def default_cache_dir() -> Path:
    """`$GPN_CACHE` or `~/.cache/gpn`: where token shards and trained tokenizers are kept."""
    return Path(os.environ.get("GPN_CACHE", Path.home() / ".cache" / "gpn"))


def content_hash(value: object) -> str:
    """A short key for `value` (JSON-able): what names a cached folder after what it was made from."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


@contextlib.contextmanager
def writing_alone(folder: Path, what: str, tell: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold the key of the cache folder `folder` (an flock on `.NAME.lock` beside it, through `atomic_files.held`)
    while the block checks whether it is there and writes it. Without it, two runs that need the same cache (two
    gpn train runs on one corpus) would each write it, in temporary folders of their own, and the first rename would
    win: the other's minutes wasted. With it the second waits for the first, `tell` saying whom for (`what` names
    the cache), then finds the folder written. A holder killed meanwhile (`kill -9` too) releases it, and the
    waiter writes it itself. The lock file stays: it is empty, and two processes locking different files under one
    name would both win."""
    lock = folder.with_name(f".{folder.name}.lock")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.close(os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666))
    except OSError as error:
        raise cache_write_error(folder, error) from error

    def waiting(in_use: str) -> None:
        if tell is not None:
            tell(f"waiting: {in_use}; this run reads {what} once that one has written it")

    with held(lock, f"that writes {what} {folder}", wait=waiting):
        yield


def tell_on_stderr(message: str) -> None:
    """Print `message` on stderr (what a wait for another process's cache says, where nothing else is told)."""
    print(message, file=sys.stderr, flush=True)


def write_folder_atomically(folder: Path, writer: Callable[[Path], None]) -> None:
    """Run `writer(tmp_folder)` and rename the folder into place (a crash never leaves half a cache).

    A cache folder that cannot be written (no permission, a file in its path, a full disk) is a `DataError`
    naming it and how to choose another, not a traceback."""
    folder = Path(folder)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        # (no lock file without flock: Windows cannot rename or delete a file that is open)
        lock = open(tmp / f"{WRITING_LOCK}.new", "w", encoding="utf-8") if fcntl is not None else None
    except OSError as error:
        raise cache_write_error(folder, error) from error
    try:
        # held while this process writes (the kernel drops it if the process is killed); the lock file gets its
        # name only once locked, so no other run ever finds it unlocked while this one lives
        if lock is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)
            os.rename(tmp / f"{WRITING_LOCK}.new", tmp / WRITING_LOCK)
        remove_abandoned_writes(folder, tmp)
        writer(tmp)
        if lock is not None:
            (tmp / WRITING_LOCK).unlink()
        try:
            os.replace(tmp, folder)
        except OSError:  # another process finished first: keep theirs
            if not folder.exists():
                raise
    except OSError as error:
        raise cache_write_error(folder, error) from error
    finally:
        if lock is not None:
            lock.close()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


WRITING_LOCK = ".writing.lock"


def remove_abandoned_writes(folder: Path, own: Path) -> None:
    """Delete the temporary folders that killed writes of `folder` left (a run killed while tokenizing leaves one
    as large as the token cache it was writing): those whose writing lock no process holds. A live writer's lock
    is held; a folder without a lock file (being renamed into place, or left by an older version) is kept, and so
    is every one where there is no flock (Windows): a live write cannot be told from a killed one there."""
    if fcntl is None:
        return
    for other in folder.parent.glob(f".{folder.name}.tmp-*"):
        if other == own:
            continue
        try:
            with open(other / WRITING_LOCK, "r+", encoding="utf-8") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(other, ignore_errors=True)
        except OSError:  # no lock file, or its writer is alive
            continue


def cache_write_error(folder: Path, error: OSError) -> DataError:
    """The `DataError` for a cache folder that cannot be written, naming how to choose another."""
    return DataError(
        f"Cannot write the cache folder {folder.parent} ({error}): choose a writable one with --cache-dir or $GPN_CACHE"
    )
