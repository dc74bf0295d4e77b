"""Files replaced whole or not at all: written under a temporary name beside them, fsynced, renamed over them,
and their folder fsynced.

The one way gpn replaces a file: a kept state (`state_file.py`), a training run's settings, rewritten log
and checkpoint state (`train/run_folder.py`), `gpn bench --json`'s report, `gpn study`'s report and results,
`gpn serve`'s spilled states. A crash or an interruption at any instant leaves the old content or the new one,
never a mix; an exception (Ctrl-C too) leaves no temporary file behind, a killed process (`kill -9`) its hidden one.
A path that is a device, pipe or socket is refused, not replaced. `held` holds a file or folder for one process
(an flock naming its holder to the process it refuses): what gpn generate's `--save-state`, gpn eval's
`--output-dir`, gpn convert's and gpn push --dry-run's OUT take, so that two processes reading and then writing
one path never overwrite each other's work in silence; or waits for it (the key of a token cache or of a trained
BPE tokenizer: a second run reads what the first wrote instead of writing it again; `gpn serve`'s `--state-dir`,
which every server on it writes and trims in turn). The standard library only: it ships with the model, which
saves states through it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import threading
from collections.abc import Callable, Iterator
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


# --------------------------------------------------------------------------------------------------
# One process at a time on a file or folder another process may also be changing
# --------------------------------------------------------------------------------------------------


class InUseError(OSError):
    """The path is held by another process (`held`): its message names the holder where the system tells."""


def _holder(identity: os.stat_result) -> str | None:
    """Who holds the flock on the file or folder `identity` (Linux: `/proc/locks` names the pid, and that pid's
    command line its command); elsewhere, or where it cannot be read, "another process". None where `/proc/locks`
    was read whole and lists no such flock: the holder let go since its lock refused ours."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        device = f"{os.major(identity.st_dev):02x}:{os.minor(identity.st_dev):02x}:{identity.st_ino}"
        with open("/proc/locks", encoding="utf-8") as locks:
            for line in locks:
                fields = line.split()
                if fields[1] == "FLOCK" and fields[5] == device and fields[3] == "WRITE":
                    pid = int(fields[4])
                    try:
                        with open(f"/proc/{pid}/cmdline", "rb") as raw:
                            command = raw.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    except OSError:
                        command = ""
                    return f"pid {pid}" + (f": {command}" if command else "")
        return None
    return "another process"


# How often `held` takes the lock again where its holder let go between the refusal and the read of who it was
# (bounded: a file system whose flocks /proc/locks does not list as such, NFS's, reads as let go every time).
_RETRIES_AFTER_A_RELEASE = 3


def _same_file(one: os.stat_result, other: os.stat_result) -> bool:
    return (one.st_dev, one.st_ino) == (other.st_dev, other.st_ino)


@contextlib.contextmanager
def held(
    path: str | os.PathLike,
    purpose: str,
    advice: str = "wait for it to end, or choose another path",
    wait: Callable[[str], None] | None = None,
) -> Iterator[os.stat_result]:
    """Hold `path` (an existing file or folder) for this process while the block runs, or raise `InUseError` at
    once, naming the process that holds it: an exclusive `flock` on what `path` names, which the kernel drops when
    its holder ends (`kill -9` too). Two processes that each read, then replace or fill, the same path (a state
    continued and saved back, an output folder checked empty and then written) would otherwise each overwrite
    the other's work in silence. `purpose` says what the holder does ("that continues the state in it") and
    `advice` what to do, for the error. Yields the `os.stat` of what is held (where there is no flock, Windows,
    nothing is held: of what `path` names). With `wait`, a path another process holds is waited for instead: `wait`
    is told first whom for (the refusal's words, without the advice), then the block runs once that process has
    released it or ended (killed too: the kernel drops its flock, so no dead holder keeps a waiter waiting).

    A file that `replacing` renames over `path` while held is a new file: the hold stays on the old one, so a
    process that opens `path` after that rename reads the new content whole, as it should. Where the lock is
    taken after another process replaced `path`, the new file is held instead (looked up again until `path`
    names what is locked).
    """
    try:
        import fcntl
    except ImportError:  # (Windows: no flock; the callers' checks of what they read still hold)
        yield os.stat(path)
        return
    path = Path(path)
    retries = _RETRIES_AFTER_A_RELEASE
    while True:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(os.fstat(descriptor))
                if holder is None and retries > 0:
                    # (its holder let go between the refusal and the read of who it was: refused, the path was free
                    # by the time the message was written; take it now)
                    retries -= 1
                    os.close(descriptor)
                    continue
                in_use = f"{path} is in use by another process ({holder or 'another process'}) {purpose}"
                if wait is None:
                    raise InUseError(f"{in_use}: {advice}") from None
                wait(in_use)
                fcntl.flock(descriptor, fcntl.LOCK_EX)
            locked = os.fstat(descriptor)
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            if now is not None and _same_file(now, locked):
                break
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)  # (replaced or removed between the open and the lock: take what it names now)
    try:
        yield locked
    finally:
        os.close(descriptor)


def unchanged_since(path: str | os.PathLike, seen: os.stat_result | None) -> bool:
    """Whether `path` still names the file `seen` (its `os.stat` when read, e.g. from `held`) with the same size,
    modification and change time: False once another process replaced or rewrote it. True where `seen` is None."""
    if seen is None:
        return True
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return _same_file(now, seen) and (now.st_size, now.st_mtime_ns, now.st_ctime_ns) == (
        seen.st_size,
        seen.st_mtime_ns,
        seen.st_ctime_ns,
    )
