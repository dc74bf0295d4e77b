"""TRL's `SFTTrainer` trains a GPN under FSDP2 (`accelerate launch --use_fsdp --fsdp_version 2`, 2 processes on CPU)
as in one process: plain, and with a LoRA `peft_config` on the embedding, whose wrapped table TRL's fused head
reads (the view Accelerate's FSDP2 preparation is shown, tests/tools/test_peft_fsdp.py). Each step's logged loss
equals the one-process run's on the same global batch."""

from __future__ import annotations

import json

import pytest

from .sft_fsdp_run import losses
from .train_runs import finish, launch_two_processes

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")
FSDP2 = ["--use_fsdp", "--fsdp_version", "2"]
PROGRAM = ("-m", "tests.tools.sft_fsdp_run")


def test_sft_trainer_trains_a_gpn_under_fsdp2_as_in_one_process(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    launches = {
        variant: launch_two_processes(FSDP2, flags, tmp_path / f"{variant}.log", program=PROGRAM)
        for variant, flags in (("plain", []), ("lora", ["--lora"]))
    }
    for variant, launched in launches.items():
        [line] = [line for line in finish(launched).splitlines() if line.startswith("LOSSES ")]
        sharded = json.loads(line.removeprefix("LOSSES "))
        alone, _ = losses(single=True, lora_on_the_embedding=variant == "lora")
        assert sharded["model"].startswith("FSDP"), sharded  # really sharded (Accelerate alone: DDP on CPU)
        assert len(sharded["losses"]) == 3 and sharded["losses"][-1] < sharded["losses"][0], (variant, sharded)
        assert max(abs(a - b) for a, b in zip(sharded["losses"], alone)) < 1e-5, (variant, sharded, alone)
