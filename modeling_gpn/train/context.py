"""`TrainingRun`: what the phases of one training run share.

Every phase (`training.py`: prepare the data and the model, open the run folder, `loop.py`: fit and
validate, `checkpoints.py`: save and resume) is a top-level function taking this one object, so each can be
read on its own: what it reads and changes of the run is spelled `run.NAME`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..packing import document_position_ids
from .run_folder import append_log_record, storage_error

if TYPE_CHECKING:
    import torch

    from modeling_gpn.data import TokenStream, WindowDataset

    from .distributed import RunStage


@dataclass(eq=False)
class TrainingRun:
    """One run in its started Accelerator: settings, data, model, and where the run stands.

    `model` and `optimizer` are the prepared (DDP / FSDP-wrapped) ones; only this object holds them, so
    `loop.end_process_group` can free them while the process group is alive. `running` holds the losses of
    the log window not yet written (a checkpoint keeps them, so a resumed log continues exactly).
    """

    accelerator: Any
    config: dict
    stage: RunStage
    tokenizer: Any
    stream: TokenStream
    windows: WindowDataset
    micro: int  # windows per forward pass per process
    accumulation: int  # forward passes per optimizer step per process
    skip_nonfinite: bool = False
    show_progress: bool = True
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    loss_kwargs: dict = field(default_factory=dict)  # what the forward pass needs besides the inputs
    start_step: int = 0
    skipped_steps: list[int] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    last_applied: int = 0  # the last step whose update was applied (named in the non-finite messages)

    @property
    def run_dir(self) -> Path:
        """The run folder (`output_dir`)."""
        return Path(self.config["output_dir"])

    @property
    def checkpoints_dir(self) -> Path:
        """The folder of the run's checkpoints."""
        return self.run_dir / "checkpoints"

    @property
    def log_path(self) -> Path:
        """The run's log.jsonl."""
        return self.run_dir / "log.jsonl"

    @property
    def main(self) -> bool:
        """Whether this is the main process."""
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        """The number of processes."""
        return self.accelerator.num_processes

    @property
    def steps(self) -> int:
        """The number of optimizer steps of the run."""
        return self.config["steps"]

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one optimizer step: the global batch of windows, over all processes."""
        return self.config["batch_size"] * self.config["seq_len"]

    def say(self, message: str) -> None:
        """Print on the main process."""
        self.accelerator.print(message)

    def warn(self, message: str) -> None:
        """Print `message` on stderr (main process only)."""
        if self.main:
            print(message, file=sys.stderr)

    def log(self, record: dict) -> None:
        """Append `record` to log.jsonl (fsynced) and its numbers to the trackers (main process only)."""
        if self.main:
            try:
                append_log_record(self.log_path, record)
            except OSError as error:
                raise storage_error(self.run_dir, self.log_path, error) from error
            self.accelerator.log(
                {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}, step=record["step"]
            )

    def forward_kwargs(self, batch: torch.Tensor) -> dict:
        """The model's keyword arguments for token windows `batch` besides input_ids and labels: no logits when
        the model can skip them, and --reset-at-document-start's position ids."""
        if not self.config["reset_at_document_start"]:
            return self.loss_kwargs
        return {**self.loss_kwargs, "position_ids": document_position_ids(batch, self.tokenizer.eos_token_id)}
