"""SIGTERM / SIGINT during training: finish the step, checkpoint, stop (exit 128 + the signal number); and a
rank whose launcher dies gets that SIGTERM."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType

PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when the thread that started it ends


def stop_when_the_launcher_dies(launched: bool) -> bool:
    """In a rank a launcher started (`launched`: torchrun, `accelerate launch`, mpirun), ask Linux for SIGTERM
    when the launcher dies, which then stops the rank as a SIGTERM does (a checkpoint at the step boundary).
    A launcher killed outright (kill -9, the OOM killer) cannot stop its ranks: they trained on, orphaned, to
    the end of the run, holding its folder, after the shell had its prompt back. Returns whether it is asked
    (only on Linux; elsewhere the ranks train on as before)."""
    if not launched or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):  # (a libc without prctl)
        return False


class StopSignals:
    """While active, SIGTERM and SIGINT (what cluster schedulers send before preemption, and Ctrl-C) only
    set `received`; the training loop checkpoints at the next step boundary and stops. A second Ctrl-C
    stops at once (KeyboardInterrupt; the last checkpoint stays as it was)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        # os.write, not print: a handler can interrupt a print to the same stream.
        os.write(
            2,
            f"\ngpn train: {signal.Signals(signum).name} received: finishing this step, then saving a "
            "checkpoint and stopping (Ctrl-C again stops at once)\n".encode(),
        )
