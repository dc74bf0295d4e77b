"""Python run in a fresh interpreter, as a user's would run: offline, with its own modules cache, and
(`BLOCK_PACKAGE` prepended to the code) without the installed `modeling_gpn`, so that what a published or
saved folder loads is its own remote code."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

# A `sys.meta_path` finder that raises ImportError for `modeling_gpn` (the editable install would otherwise
# find it), and the check that it is no longer importable.
BLOCK_PACKAGE = textwrap.dedent(
    """
    import importlib.abc, sys

    class _BlockModelingGPN(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "modeling_gpn" or name.startswith("modeling_gpn."):
                raise ImportError(f"{name} is blocked: the published folder must not need the installed package")
            return None

    sys.meta_path.insert(0, _BlockModelingGPN())
    sys.path[:] = [p for p in sys.path if p not in ("", ".")]
    try:
        import modeling_gpn  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("modeling_gpn is still importable")
    """
)


def run_python(code: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_MODULES_CACHE=str(cwd / "hf_modules"))
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


@contextlib.contextmanager
def two_at_a_time() -> Iterator[ThreadPoolExecutor]:
    """A pool that runs its jobs two at a time, for jobs that mostly wait on a fresh single-threaded process
    (a probe, a `gpn` command with one thread): the suite runs on 2 cores, and such processes launched one after
    another leave one of them idle. (Threads suffice: a job waiting on its process holds no lock.) Jobs not
    started when the block ends are cancelled; those running are waited for."""
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="two-at-a-time")
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextlib.contextmanager
def started_in_the_background(
    jobs: Mapping[str, Callable[[], object]], selected: set[str]
) -> Iterator[dict[str, Future]]:
    """The `jobs` (test name -> what runs that test's fresh processes) of the `selected` tests, started two at a
    time in the background at once: test name -> the future of the job's result (waited for when the block ends).
    For tests whose fresh processes need nothing of the tests before them, started by a module fixture at the
    module's first test: the suite's time on 2 cores, where this process's tests keep one core busy and a fresh
    process run meanwhile the other (run by its own test, a fresh process leaves this one waiting)."""
    with two_at_a_time() as pool:
        yield {name: pool.submit(job) for name, job in jobs.items() if name in selected}


# pytest-xdist's distributions that keep a module's tests in one worker (none: one process). The module fixtures above
# start the fresh processes of every selected test of their module at the module's first test: a module whose tests
# two workers shared (`--dist load`, the default of `-n`; `loadscope` splits a module's test classes) would start each
# of them in both workers.
WHOLE_MODULE_DISTRIBUTIONS = ("no", "loadfile")


def refuse_modules_split_between_workers(dist: str) -> None:
    """Raise `pytest.UsageError` for a pytest-xdist distribution (`--dist`) that may split a module's tests."""
    if dist not in WHOLE_MODULE_DISTRIBUTIONS:
        import pytest

        raise pytest.UsageError(
            f"--dist {dist} may split a test module between workers, whose module fixtures would then start the "
            "module's fresh processes twice: run the suite as the README does, python -m pytest -q -n 2 --dist loadfile"
        )


@contextlib.contextmanager
def one_started_in_the_background(
    request: object, test: str, make: Callable[[], tuple[object, Callable[[], object]]]
) -> Iterator[tuple[object, Future] | None]:
    """For a module fixture: where `test` (a name without parameters) of `request`'s module is selected, `make()`'s
    (what the test compares, the job running its fresh process), made here with the random generator left as it was
    (for the tests before that one), and the job started in the background (`two_at_a_time`): (that, the job's
    future); None where the test is not selected. The fresh process needs nothing of the tests before it
    (`started_in_the_background`'s reason)."""
    import torch  # (as the tests that use this do: this module starts no torch of its own otherwise)

    session = request.session
    if not any(item.originalname == test for item in session.items if item.module is request.module):
        yield None
        return
    with torch.random.fork_rng():
        made, job = make()
    with two_at_a_time() as pool:
        yield made, pool.submit(job)


# A bare interpreter (no torch to import: it starts in a tenth of a second) that takes an exclusive flock on the file
# or folder it is given, says so with an empty line, and holds it until its standard input closes.
FLOCK_HOLDER = (
    "import fcntl, os, sys; d = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(d, fcntl.LOCK_EX); print(flush=True)"
    "; sys.stdin.read()"
)


@contextlib.contextmanager
def another_process_holding(path: Path) -> Iterator[subprocess.Popen]:
    """Another process holding an exclusive flock on `path` (`FLOCK_HOLDER`) while the block runs: what gpn's holds
    (`atomic_files.held`) refuse, wait for or name by its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", FLOCK_HOLDER, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        holder.stdout.readline()  # (it holds the lock once it printed)
        yield holder
    finally:
        holder.stdin.close()
        holder.wait()


def process_state(pid: int) -> str:
    """The state letter of process `pid` from /proc/PID/stat ("R", "S", "T" stopped, "Z" a zombie, ...), "X" (dead)
    once it is gone. Read once: checked for existence and then read, a process can be reaped in between."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text(encoding="utf-8").rsplit(")", 1)[1].split()[0]
    return "X"
