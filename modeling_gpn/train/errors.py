"""What `gpn train` raises, each error naming the problem and what is intact.

Defined in one place, below every other module of the training package, because several phases raise the
same error (a full disk in a checkpoint, the log or the model) and `gpn train`'s command line and `gpn
study` catch them all.
"""

from __future__ import annotations

import signal
from pathlib import Path


class NonFiniteLossError(RuntimeError):
    """A step's loss or gradient norm was NaN/inf, or an update made the weights non-finite. The message names
    the step and says whether the weights were updated; nothing non-finite is ever checkpointed or saved."""


class StorageError(RuntimeError):
    """A file of the run could not be written (a full disk, a size limit); the message names the path and
    what is intact."""


class TrainingStopped(Exception):
    """SIGTERM or SIGINT stopped the run at a step boundary, after a checkpoint of that step was written."""

    def __init__(self, signum: int, step: int, steps: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after step {step} of {steps}; the training state is saved in "
            f"{checkpoint}; continue with the same command plus --resume"
        )


class RunFolderInUseError(RuntimeError):
    """Another `gpn train` holds the run folder's lock; the message names it (pid, host, command, start time)."""


class LaunchError(RuntimeError):
    """The job was launched in a way Accelerate does not run as one training (the message says how to launch)."""


class CollectiveError(RuntimeError):
    """A collective operation failed in a multi-process run (another process stopped responding or ended);
    the message names the stage the run was in."""


# The errors of a run whose message says all a user needs (the problem, what is intact): `gpn train` and `gpn study`
# print them as one line
RUN_ERRORS = (NonFiniteLossError, StorageError, RunFolderInUseError, LaunchError, CollectiveError)


class ResumeMismatchError(ValueError):
    """A resume refused because settings or the training data changed since the checkpoint (`changes` names
    each): continuing would change the data, the model or the optimisation. `gpn study` says it in its own
    terms (its models resume by themselves, and it has no --output-dir)."""

    def __init__(self, checkpoint: Path, changes: list[str]) -> None:
        self.checkpoint, self.changes = checkpoint, changes
        super().__init__(
            f"--resume: these settings differ from those of {checkpoint} and would change the data, the model "
            f"or the optimisation: {'; '.join(changes)}. Resume with the checkpoint's values, or start a new "
            "run in another --output-dir"
        )
