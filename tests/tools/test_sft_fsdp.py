"""TRL's `SFTTrainer` trains a GPN under FSDP2 (`accelerate launch --use_fsdp --fsdp_version 2`, 2 processes on CPU)
as in one process: with a LoRA `peft_config` on the embedding, whose wrapped table TRL's fused head reads (the view
Accelerate's FSDP2 preparation is shown, tests/tools/test_peft_fsdp.py) under `accelerate config`'s default auto-wrap
policy, `TRANSFORMER_BASED_WRAP` without class names (the model one unit), and the plain model
with the blocks of the recurrence sharded apart on batches padded to one length. Each step's logged loss equals the
one-process run's on the same global batch. Blocks sharded apart on batches of different lengths are refused in
one line: the recurrence gathers their weights at every token, so the processes' collectives did not match (gloo
aborted after a step: "Received data size doesn't match expected size"). The same launch first runs a plain
transformers `Trainer` as DDP (what Accelerate makes of it on CPU), with its resume from a checkpoint: the same
losses and weights as one process."""

from __future__ import annotations

import json

import pytest

from .sft_fsdp_run import losses, trainer_losses
from .train_runs import finish, launch_two_processes

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")
# `accelerate config`'s default auto-wrap policy; the variants that shard blocks apart name their classes
# (tests/tools/sft_fsdp_run.py's VARIANTS, as `--fsdp_transformer_layer_cls_to_wrap` would).
DEFAULT_POLICY = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"]
PROGRAM = ("-m", "tests.tools.sft_fsdp_run")


def test_sft_trainer_trains_a_gpn_under_fsdp2_as_in_one_process(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    # The LoRA run under `accelerate config`'s default policy, named no classes: a GPN names none to keep whole
    # (`_no_split_modules`), so the model is one unit; it named GPNModel, which Accelerate 1.16 failed to shard.
    # One launch trains every variant in turn (tests/tools/sft_fsdp_run.py), the refused one last.
    # First, a plain transformers Trainer, which Accelerate runs as DDP on CPU (no test ran one under DDP before).
    variants = ("trainer-ddp", "lora", "blocks", "unpadded")
    named = [f"trainer-ddp:{tmp_path / 'ddp'}", *variants[1:]]
    launched = launch_two_processes(DEFAULT_POLICY, named, tmp_path / "launch.log", program=PROGRAM)
    alone = {variant: losses(single=True, lora_on_the_embedding=variant == "lora") for variant in ("lora", "blocks")}
    trainer_alone = trainer_losses(single=True, out=str(tmp_path / "alone"))
    output = finish(launched)  # (the references above ran meanwhile)
    results = dict(line.split(" ", 2)[1:] for line in output.splitlines() if line.startswith("RESULT "))
    assert list(results) == list(variants), output[-3000:]
    results = {variant: json.loads(outcome) for variant, outcome in results.items()}
    ddp = results["trainer-ddp"]
    assert ddp.get("model") == "DistributedDataParallel", ddp
    assert len(ddp["losses"]) == 4 and ddp["losses"][-1] < ddp["losses"][0], ddp
    # 2 processes of 2 rows each = 1 of 4, the loss the token mean over both processes' rows, resume included
    for seen, want in ((ddp["losses"], trainer_alone["losses"]), (ddp["norms"], trainer_alone["norms"])):
        assert max(abs(a - b) for a, b in zip(seen, want, strict=True)) < 1e-5, (ddp, trainer_alone)
    assert max(abs(a - b) for a, b in zip(ddp["resumed"][2:], ddp["losses"][2:], strict=True)) < 1e-6, ddp
    for variant in ("lora", "blocks"):
        sharded = results[variant]
        assert "losses" in sharded, (variant, sharded)
        assert sharded["model"].startswith("FSDP"), sharded  # really sharded (Accelerate alone: DDP on CPU)
        if variant == "lora":  # only the tied ends apart, which Accelerate always groups apart: no block, no GPNModel
            assert sharded["units"] == ["Embedding", "Linear"], sharded
        else:
            assert {"GPNMemoryWrite", "GPNPredictLayer"} <= set(sharded["units"]), sharded
        assert len(sharded["losses"]) == 3 and sharded["losses"][-1] < sharded["losses"][0], (variant, sharded)
        assert max(abs(a - b) for a, b in zip(sharded["losses"], alone[variant][0])) < 1e-5, (variant, sharded, alone)
        # The trained model in eval mode: with blocks sharded apart, the cache its forward builds read their sharded
        # weights (DTensors) and failed ("KeyError: '_local_tensor'").
        assert abs(sharded["eval_loss"] - alone[variant][3]) < 1e-5, (variant, sharded, alone)
    assert "losses" not in results["unpadded"], results["unpadded"]
    refused = results["unpadded"]["error"]
    assert "ValueError: FSDP2 shards GPNMemoryWrite apart, which the recurrence gathers at every token" in refused
    assert "Pad every batch to one length" in refused
