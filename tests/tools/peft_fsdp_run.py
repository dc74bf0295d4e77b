"""A PEFT adapter's training steps under `accelerate launch` (tests/tools/test_peft_fsdp.py): an Accelerator as a
user's script or a Trainer makes it, FSDP2 applied on CPU as `gpn train` does (Accelerate would make the launch DDP
there without a word), three optimizer steps of a tiny GPN whose embedding carries the named adapter, the losses
printed as one JSON line. Run alone (`--single`), it is the one-process reference.

Launched, it runs each adapter named on its command line in turn in the same 2 processes (one launch, not one per
adapter: each start of 2 processes imports torch, transformers and PEFT, seconds of the suite's time on 2 cores),
and prints one `RESULT` line per adapter: its losses, or the traceback of its refusal. An adapter suffixed
`:no-tying` runs as `--fsdp_cpu_ram_efficient_loading false` would launch it (the variable that flag sets, read
by the FSDP plugin each adapter's Accelerator makes)."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

ADAPTERS = {
    "lora": dict(target_modules=["embed_tokens", "decode_proj"], init_lora_weights=False),
    "modules_to_save": dict(target_modules=["decode_proj"], modules_to_save=["embed_tokens"]),
    "trainable_tokens": dict(target_modules=["decode_proj"], trainable_token_indices={"embed_tokens": [3, 5]}),
}


def losses(adapter: str, single: bool) -> list[float]:
    import peft
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from tests.tiny_models import perturbed_model, tiny_config

    accelerator = Accelerator(cpu=True)
    if not single:
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables
        assert accelerator.is_fsdp2
    torch.manual_seed(0)
    model = peft.get_peft_model(perturbed_model(tiny_config(), seed=1), peft.LoraConfig(r=4, **ADAPTERS[adapter]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(1, 97, (2, 12), generator=torch.Generator().manual_seed(0))  # every process: the same batch
    seen = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(float(loss))
    if not single and adapter == "lora" and os.environ.get("PEFT_SAVE_DIR"):
        saves(accelerator, model, os.environ["PEFT_SAVE_DIR"])
    return seen


def saves(accelerator, model, folder: str) -> None:
    """PeftModel.save_pretrained of the sharded adapter, as a user calls it on the main process, and as Accelerate
    documents it (the state dict gathered on every process): what each wrote, printed as a `SAVED` line."""
    from pathlib import Path

    unwrapped = accelerator.unwrap_model(model)
    outcome = {}
    if accelerator.is_main_process:
        try:
            unwrapped.save_pretrained(f"{folder}/plain")
            outcome["plain"] = sorted(path.name for path in Path(f"{folder}/plain").iterdir())
        except Exception as error:  # noqa: BLE001 (what it does is the finding)
            outcome["plain"] = f"{type(error).__name__}: {error}"
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped.save_pretrained(f"{folder}/gathered", is_main_process=accelerator.is_main_process, state_dict=state_dict)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print("SAVED " + json.dumps(outcome), flush=True)


def result(adapter: str) -> dict:
    """`{"losses": [...]}` of `adapter` sharded over the launch's processes, or `{"error": traceback}` where
    it was refused."""
    adapter, _, tying = adapter.partition(":")
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false" if tying == "no-tying" else "true"  # (the launch's default)
    try:
        return {"losses": losses(adapter, single=False)}
    except Exception:  # noqa: BLE001 (the refusals under test: reported, then the next adapter)
        return {"error": traceback.format_exc()}


if __name__ == "__main__":
    if "--single" in sys.argv:
        print("LOSSES " + json.dumps(losses(sys.argv[1], single=True)), flush=True)
        sys.exit()
    for adapter in sys.argv[1:]:
        outcome = result(adapter)
        if os.environ.get("RANK", "0") == "0":  # (one line: the processes' prints would interleave)
            print(f"RESULT {adapter} " + json.dumps(outcome), flush=True)
