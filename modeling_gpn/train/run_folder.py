"""A run's folder: its layout, files written so that a crash loses nothing, the log, and the lock.

    OUTPUT/model/                        the final save_pretrained folder
    OUTPUT/checkpoints/step-NNNNNNN/     full training states (see checkpoints.py)
    OUTPUT/log.jsonl                     one JSON object per log / eval event
    OUTPUT/loss.png                      its loss curves, drawn at the end of the run (loss_figure.py)
    OUTPUT/train_config.json             the resolved settings
    OUTPUT/.gpn-train.lock               who holds the folder while a run writes it

Every folder and JSON file is written under a temporary name in its final folder, fsynced, then renamed
(and the folder fsynced), so a crash at any instant leaves the old complete version or the new one;
`log.jsonl` is appended one fsynced record at a time. A write that fails anyway (a full disk) becomes a
`StorageError` naming the path and the newest checkpoint that is intact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import types
    from collections.abc import Callable, Iterator

    from accelerate import Accelerator

from ..atomic_files import fsync, write_file_atomically
from .errors import RunFolderInUseError, StorageError

# --------------------------------------------------------------------------------------------------
# Crash-safe files: a temporary name in the same folder, fsync, rename, fsync the folder (one file at a time:
# `modeling_gpn.atomic_files`, shared with the state file, gpn bench and gpn serve; whole folders here)
# --------------------------------------------------------------------------------------------------


def fsync_tree(folder: Path) -> None:
    """fsync every file and folder under `folder`, deepest first, then `folder` itself."""
    for path in sorted(Path(folder).rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_file() or path.is_dir():
            fsync(path)
    fsync(folder)


REPLACED_PREFIX = ".replaced-"


def install_folder(tmp: Path, final: Path) -> None:
    """Move the complete, fsynced folder `tmp` to `final`. A folder already at `final` is renamed aside
    (`.replaced-NAME`) and deleted only once the new one is in place; `recover_folders` puts it back if a
    crash falls between the two renames, so a complete folder is never lost."""
    aside = final.with_name(REPLACED_PREFIX + final.name)
    if aside.exists():  # left by a crash: stale beside a complete `final`, else the only copy (put it back)
        if final.exists():
            shutil.rmtree(aside)
        else:
            os.replace(aside, final)
    if final.exists():
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync(final.parent)
    if aside.exists():
        shutil.rmtree(aside)


def recover_folders(parent: Path) -> None:
    """After a crash: restore a folder that `install_folder` had renamed aside, and delete unfinished writes
    (`.tmp-*` folders, `.NAME.tmp-PID` files)."""
    if not parent.is_dir():
        return
    for aside in parent.glob(REPLACED_PREFIX + "*"):
        final = aside.with_name(aside.name[len(REPLACED_PREFIX) :])
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)
    for unfinished in [*parent.glob(".tmp-*"), *parent.glob(".*.tmp-*")]:
        if unfinished.is_dir():
            shutil.rmtree(unfinished, ignore_errors=True)
        else:
            unfinished.unlink(missing_ok=True)


def append_log_record(path: Path, record: dict) -> None:
    """Append one JSON line to the run log and fsync it. A failed append (a full disk) is cut back to the old
    length, so the log never keeps half a record; rewriting the whole log at every record would make logging
    quadratic in the run's length."""
    # Strict JSON: a NaN or inf (a validation without held-out windows, a diverged loss) is written as its name in
    # a string, as the non-finite events already are; json.dumps would write a bare NaN, which is no JSON (jq,
    # JavaScript's JSON.parse and other strict readers refuse the line).
    record = {
        key: str(value) if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in record.items()
    }
    line = (json.dumps(record) + "\n").encode()
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "ab") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise


def read_log(path: Path, warn: Callable[[str], None] | None = None) -> list[dict]:
    """The records of a run's `log.jsonl`. A torn line (a write cut by a crash or a full disk) or any line
    that is not a JSON record is skipped, with a warning naming the file and the line."""
    records = []
    lines = Path(path).read_bytes().split(b"\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                raise ValueError("not a JSON object with an integer step")
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            what = "torn (a write cut short by a crash or a full disk)" if index == last else "not a log record"
            if warn:
                warn(f"warning: {path}: line {index + 1} is {what}; skipped it ({error})")
            continue
        records.append(record)
    return records


def truncate_log(path: Path, step: int, warn: Callable[[str], None] | None = None) -> None:
    """On --resume: keep the log records up to the checkpoint's `step` (the later ones will be written
    again), skipping torn or unreadable lines with a warning naming the file; the kept records are written
    to a temporary file that then replaces the log, so a crash here loses nothing."""
    if not path.exists():
        return
    if step == 0:
        path.unlink()
        fsync(path.parent)
        return
    kept = [record for record in read_log(path, warn) if record.get("step", 0) <= step]
    write_file_atomically(path, "".join(json.dumps(record) + "\n" for record in kept))


# --------------------------------------------------------------------------------------------------
# One writer per run folder
# --------------------------------------------------------------------------------------------------


class RunFolderLock:
    """An exclusive `flock` on `OUTPUT/.gpn-train.lock`, held by the main process for the whole run.

    The kernel releases a flock when its holder ends, crash and SIGKILL included, so a lock can never be
    left held by a dead process. The file also records who holds it (pid, host, command, start time): a
    second run names the holder in its error, and a run that finds the record of a holder that ended
    without releasing (killed, crashed) says whose lock it takes over. A clean release empties the record.
    The file is never deleted: two runs locking different files under one name would both win.
    """

    FILE_NAME = ".gpn-train.lock"

    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / self.FILE_NAME
        self._fd: int | None = None

    def acquire(self, warn: Callable[[str], None] | None = None) -> RunFolderLock:
        """Take the lock, or raise RunFolderInUseError naming the holder (StorageError: the folder cannot be
        written, e.g. read-only). Returns self. Where there is no flock (Windows) nothing is locked: `warn` says so
        and the run goes on, as it would with the folder to itself."""
        import socket

        try:
            import fcntl
        except ImportError:
            fcntl = None

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:  # the first write of a run: a read-only folder or file system, no permission
            raise StorageError(
                f"Cannot write the run folder {self.path.parent} ({error}): make it writable or choose another "
                "--output-dir. Nothing was written"
            ) from error
        if fcntl is None:
            os.close(fd)
            if warn:
                warn(
                    f"gpn train: warning: this platform has no flock, so {self.path.parent} is not locked: a second "
                    "gpn train run into it would not be refused"
                )
            return self
        try:
            self._flock(fcntl, fd)
        except BlockingIOError:
            holder = self._describe(os.pread(fd, 4096, 0))
            os.close(fd)
            raise RunFolderInUseError(
                f"{self.path.parent} is in use by another gpn train run ({holder}): two runs in one folder would "
                "interleave their logs and replace each other's checkpoints and model. Wait for it to end, stop it, "
                "or choose another --output-dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        previous = os.pread(fd, 4096, 0)
        if previous.strip() and warn:
            warn(
                f"gpn train: warning: taking over the lock of {self.path.parent} from a run that ended without "
                f"releasing it ({self._describe(previous)}; it was killed or crashed)"
            )
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    # How long a lock held without a record is waited for. A flock belongs to the open file, which a process forked
    # while a run held it (`subprocess` forks, then closes the file as it executes) shares: the run's release then
    # leaves the lock held, its record emptied, for as long as that child takes to exec (milliseconds, longer on a
    # busy machine), and a run into the folder just then (a resume in the same process) was refused as in use by a
    # holder unknown. A run that has just taken the lock and not yet written its record is seen so too.
    UNRECORDED_WAIT_S = 5.0

    def _flock(self, fcntl: types.ModuleType, fd: int) -> None:
        """Take the flock on `fd` (BlockingIOError: held), waiting up to UNRECORDED_WAIT_S while it is held
        with no record of its holder."""
        deadline = time.monotonic() + self.UNRECORDED_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if os.pread(fd, 4096, 0).strip() or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    def release(self) -> None:
        """Empty the holder record, then unlock (closing the file releases the flock)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)
        self._fd = None

    @staticmethod
    def _describe(raw: bytes) -> str:
        try:
            record = json.loads(raw.decode())
            return f"pid {record['pid']} on {record['host']}, started {record['started']}: {record['command']}"
        except (ValueError, KeyError, TypeError):
            if raw.strip():
                return "holder unknown: the lock file holds no readable record"
            return (
                f"holder unknown: the lock file held no record for {RunFolderLock.UNRECORDED_WAIT_S:g} s: a run "
                "that could not write it, or a process that inherited the lock from a run that has ended (forked "
                "while it ran)"
            )


@contextlib.contextmanager
def hold_run_folder(
    accelerator: Accelerator, run_dir: Path, warn: Callable[[str], None] | None = None
) -> Iterator[RunFolderLock]:
    """Hold the run folder's lock for the block (the main process takes it; every process stops if it is taken)."""
    from accelerate.utils import broadcast_object_list

    lock, refusal = None, None
    if accelerator.is_main_process:
        try:
            lock = RunFolderLock(run_dir).acquire(warn)
        except (RunFolderInUseError, StorageError) as error:
            refusal = (type(error).__name__, str(error))
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]  # so the other processes stop too, instead of waiting
    if refusal:
        kind, message = refusal
        raise (StorageError if kind == StorageError.__name__ else RunFolderInUseError)(message)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def check_run_folder(run_dir: Path, dataset: str) -> None:
    """Refuse, before the data are tokenized, an --output-dir that is not a run's to write in: a model folder
    (`save_pretrained`'s: config.json at its top), in which the run would have put a second model and its log, and
    a folder that --dataset can read files in: the corpus folder itself or one inside it, where the run's log.jsonl,
    train_config.json and model/ would become training documents of the next run on it (of its --resume too, which
    would then refuse the changed corpus); a folder that a glob --dataset can reach into (`corpus/**/*.json`, now or
    once the run has written there); one that holds the corpus file or folder itself."""
    from ..data.corpus import CorpusSpec, glob_reaches, hidden

    if (run_dir / "config.json").is_file():
        raise FileExistsError(
            f"--output-dir {run_dir} is a model folder (it holds config.json): a run writes a folder of its own, its "
            "model in model/; name a new folder for the run"
        )
    spec = CorpusSpec(source=dataset)
    if spec.kind != "local":
        return
    corpus, inside = Path(dataset).expanduser(), run_dir.resolve()
    if corpus.is_dir():
        folder = corpus.resolve()
        if (inside == folder or folder in inside.parents) and not hidden(inside.relative_to(folder)):
            raise ValueError(
                f"--output-dir {run_dir} is inside the corpus folder --dataset {dataset}: the run's log.jsonl, "
                "train_config.json and model/ would be read as training documents by the next run on it (a --resume "
                "too); name a folder outside it (or one named .* or __*, which the corpus leaves out)"
            )
    if spec.is_glob and glob_reaches(dataset, run_dir):
        raise ValueError(
            f"--dataset {dataset} can match files inside --output-dir {run_dir}: the run's log.jsonl, "
            "train_config.json and model/ would be read as training documents by the next run on it (a --resume "
            "too); name an output folder the pattern cannot reach"
        )
    # (a corpus named inside the folder, or a link there to a file of it: as written and with links resolved)
    named, folders = {Path(os.path.abspath(corpus)), corpus.resolve()}, {Path(os.path.abspath(run_dir)), inside}
    if corpus.exists() and any(folder in path.parents for path in named for folder in folders):
        raise ValueError(
            f"--dataset {dataset} is inside --output-dir {run_dir}: the run writes its log, checkpoints and model in "
            "that folder, among the corpus; keep the corpus outside the run's folder"
        )


# --------------------------------------------------------------------------------------------------
# What a failed write leaves intact
# --------------------------------------------------------------------------------------------------


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (a `step-N` folder holding trainer_state.json), or None."""
    folders = sorted((run_dir / "checkpoints").glob("step-*")) if (run_dir / "checkpoints").exists() else []
    folders = [f for f in folders if (f / "trainer_state.json").exists()]
    return folders[-1] if folders else None


def intact(run_dir: Path) -> str:
    """What survives a failed write: the newest complete checkpoint."""
    last = latest_checkpoint(run_dir)
    if last is None:
        return "No checkpoint had been written yet, so the run has to start again."
    return f"No finished work was lost: the last checkpoint, {last}, is intact; continue from it with --resume."


def write_errors() -> tuple[type[BaseException], ...]:
    """What a failed write (a full disk, a file-size limit) raises: torch.save reports it as a RuntimeError,
    safetensors as its own SafetensorError."""
    errors: tuple[type[BaseException], ...] = (OSError, RuntimeError)
    with contextlib.suppress(ImportError):
        from safetensors import SafetensorError

        errors += (SafetensorError,)
    return errors


def storage_error(run_dir: Path, path: Path, error: BaseException) -> StorageError:
    """The StorageError for a failed write of `path`: the cause, the free space there, and what is intact."""
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(path.parent if path.parent.exists() else run_dir).free
        error = f"{error} ({free / 2**20:.1f} MiB free there)"
    return StorageError(f"Cannot write {path}: {error}. {intact(run_dir)}")
