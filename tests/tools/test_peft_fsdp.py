"""A GPN whose embedding carries a PEFT adapter under FSDP2 (`accelerate launch --use_fsdp --fsdp_version 2`, 2
processes on CPU). Accelerate shards a tied output embedding in one group with the input embedding, which it
recognizes by `get_output_embeddings().weight is get_input_embeddings().weight`; the view a GPN shows for a wrapped
embedding's table is no module of the model, so FSDP2 put the head and the wrapper in two groups and failed in the
first forward ("Parameter ...embed_tokens.base_layer.weight is shared with a parameter already managed by another
FSDP group"). Accelerate's preparation is shown `lm_head` instead: a LoRA or a `modules_to_save` copy of the
embedding trains as in one process. Trainable tokens (their adapter shared by the tied head and the embedding) FSDP2
cannot shard: refused in one line before training, naming them and what to use instead."""

from __future__ import annotations

import json

import pytest

from .peft_fsdp_run import losses
from .train_runs import failed_launch_output, finish, launch_two_processes

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")
FSDP2 = ["--use_fsdp", "--fsdp_version", "2"]
PROGRAM = ("-m", "tests.tools.peft_fsdp_run")


def test_an_embedding_adapter_trains_under_fsdp2_as_in_one_process_and_trainable_tokens_are_refused(tmp_path):
    pytest.importorskip("peft")
    launches = {
        adapter: launch_two_processes(FSDP2, [adapter], tmp_path / f"{adapter}.log", program=PROGRAM)
        for adapter in ("lora", "modules_to_save", "trainable_tokens")
    }
    # Accelerate ties the weights before sharding unless told not to load CPU-RAM-efficiently: refused at each step.
    launches["trainable_tokens, no tying"] = launch_two_processes(
        [*FSDP2, "--fsdp_cpu_ram_efficient_loading", "false"],
        ["trainable_tokens"],
        tmp_path / "no-tying.log",
        program=PROGRAM,
    )
    for adapter in ("lora", "modules_to_save"):
        launched = launches.pop(adapter)
        output = finish(launched)
        [line] = [line for line in output.splitlines() if line.startswith("LOSSES ")]
        sharded = json.loads(line.removeprefix("LOSSES "))
        alone = losses(adapter, single=True)
        assert len(sharded) == 3 and sharded[-1] < sharded[0], (adapter, sharded)
        assert max(abs(a - b) for a, b in zip(sharded, alone)) < 1e-5, (adapter, sharded, alone)
    for refused_launch in ("trainable_tokens", "trainable_tokens, no tying"):
        refused = failed_launch_output(launches.pop(refused_launch), timeout=300)
        assert "ValueError: FSDP2 cannot shard a GPN whose embedding carries PEFT trainable tokens" in refused
        assert "accelerator.prepare" in refused and "\nLOSSES" not in refused  # (refused while preparing)
