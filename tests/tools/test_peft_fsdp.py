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

from .peft_fsdp_run import ADAPTERS, losses
from .train_runs import finish, launch_two_processes

pytestmark = pytest.mark.usefixtures("accelerate_on_cpu")
FSDP2 = ["--use_fsdp", "--fsdp_version", "2"]
PROGRAM = ("-m", "tests.tools.peft_fsdp_run")


def test_an_embedding_adapter_trains_under_fsdp2_as_in_one_process_and_trainable_tokens_are_refused(
    tmp_path, monkeypatch
):
    pytest.importorskip("peft")
    # the LoRA's adapter saved after its steps, by PeftModel.save_pretrained as called on the main process, and with
    # the state dict accelerator.get_state_dict gathered (peft_fsdp_run.saves)
    monkeypatch.setenv("PEFT_SAVE_DIR", str(tmp_path / "saved"))
    # One launch runs every adapter in turn (tests/tools/peft_fsdp_run.py), the refused ones last.
    # Accelerate ties the weights before sharding unless told not to load CPU-RAM-efficiently: refused at each step.
    adapters = ("lora", "modules_to_save", "trainable_tokens", "trainable_tokens:no-tying")
    launched = launch_two_processes(FSDP2, list(adapters), tmp_path / "launch.log", program=PROGRAM)
    alone = {adapter: losses(adapter, single=True) for adapter in ("lora", "modules_to_save")}  # (meanwhile)
    output = finish(launched)
    results = dict(line.split(" ", 2)[1:] for line in output.splitlines() if line.startswith("RESULT "))
    assert list(results) == list(adapters), output[-3000:]
    results = {adapter: json.loads(outcome) for adapter, outcome in results.items()}
    for adapter in ("lora", "modules_to_save"):
        assert "losses" in results[adapter], (adapter, results[adapter])
        sharded = results[adapter]["losses"]
        assert len(sharded) == 3 and sharded[-1] < sharded[0], (adapter, sharded)
        assert max(abs(a - b) for a, b in zip(sharded, alone[adapter])) < 1e-5, (adapter, sharded, alone)
    for refused_adapter in ("trainable_tokens", "trainable_tokens:no-tying"):
        assert "losses" not in results[refused_adapter], results[refused_adapter]
        refused = results[refused_adapter]["error"]
        assert "ValueError: FSDP2 cannot shard a GPN whose embedding carries PEFT trainable tokens" in refused
        assert "accelerator.prepare" in refused  # (refused while preparing)
    # PEFT's save of the sharded adapter writes its model card, then fails on the first DTensor (no adapter file, a
    # loud if unhelpful error: PeftModel.save_pretrained passes no GPN code on its way); the gathered state dict
    # writes the whole adapter, every tensor of its unsharded shape
    import peft
    from safetensors.torch import load_file

    from tests.tiny_models import perturbed_model, tiny_config

    saved = json.loads(next(line for line in output.splitlines() if line.startswith("SAVED "))[len("SAVED ") :])
    assert "invalid python storage" in saved["plain"], saved
    assert not (tmp_path / "saved" / "plain" / "adapter_model.safetensors").exists()
    fresh = peft.get_peft_model(perturbed_model(tiny_config()), peft.LoraConfig(r=4, **ADAPTERS["lora"]))
    want = {name: tuple(tensor.shape) for name, tensor in peft.get_peft_model_state_dict(fresh).items()}
    got = load_file(tmp_path / "saved" / "gathered" / "adapter_model.safetensors")
    assert {name: tuple(tensor.shape) for name, tensor in got.items()} == want
