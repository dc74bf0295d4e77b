"""TRL's `SFTTrainer` training a tiny GPN under `accelerate launch` (tests/tools/test_sft_fsdp.py): FSDP2 applied
on CPU as `gpn train` does (Accelerate 1.16 would make a Trainer's FSDP launch DDP there without a word), three
steps, each step's logged loss printed as one JSON line with the units FSDP2 sharded apart. Run alone (`--single`),
it is the one-process reference, with the same global batch (4 rows: 2 per process when launched as 2).

Launched, it trains each variant named on its command line (`VARIANTS`) in turn in the same 2 processes (one launch,
not one per variant: each start of 2 processes imports torch, transformers and TRL, seconds of the suite's time on 2
cores), and prints one `RESULT` line per variant: its losses and units, or the traceback of its refusal. The variant
`trainer-ddp:FOLDER`, first, is a plain transformers `Trainer` under DDP (`trainer_losses`). The
launch names the auto-wrap policy; each variant names the classes to wrap as `--fsdp_transformer_layer_cls_to_wrap`
would (the variable that flag sets, read by the FSDP plugin each variant's trainer makes)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback


def losses(
    single: bool, lora_on_the_embedding: bool = False, pad: bool = False
) -> tuple[list[float], str, list[str], float]:
    """The logged training losses, the class of the model the trainer trained (FSDP2 renames it), the classes
    of the modules below it that FSDP2 sharded as units of their own (sorted, with repeats) and the evaluation loss
    of the trained model on one text (a forward in eval mode, which builds a cache, as a sample generated in a
    callback does); with
    `lora_on_the_embedding`, a LoRA `peft_config` on the embedding and the decoder (TRL's fused head then reads the
    wrapped table); with `pad`, every batch padded to one length (what sharding blocks apart needs)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from modeling_gpn.data import train_bpe_tokenizer
    from tests.tiny_models import TINY_TEXT as TEXT
    from tests.tiny_models import perturbed_model, tiny_config
    from tests.trainer_arguments import common_arguments

    class ShardedOnCpu(SFTTrainer):
        def create_accelerator_and_postprocess(self):
            from accelerate import PartialState
            from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

            super().create_accelerator_and_postprocess()
            if not single:  # what `gpn train` does on CPU (modeling_gpn/train/distributed.py)
                PartialState().distributed_type = DistributedType.FSDP
                self.accelerator.state.distributed_type = DistributedType.FSDP
                self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()  # the launcher's FSDP_*
                assert self.accelerator.is_fsdp2
                self.is_fsdp_enabled = True

    tokenizer = train_bpe_tokenizer(TEXT * 4, vocab_size=300)
    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = perturbed_model(config, seed=16).train()
    batch = 4 if single else 2
    peft_config = None
    if lora_on_the_embedding:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["embed_tokens", "decode_proj"])
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(
            **common_arguments(out, max_steps=3),
            max_length=32,
            per_device_train_batch_size=batch,
            pad_to_multiple_of=32 if pad else None,
        )
        trainer = ShardedOnCpu(
            model=model,
            args=args,
            train_dataset=Dataset.from_dict({"text": TEXT}),
            processing_class=tokenizer,
            peft_config=peft_config,
        )
        trainer.train()
        import torch

        trainer.model_wrapped.eval()
        text = torch.tensor([tokenizer(TEXT[2])["input_ids"][:8]])  # (one length on every process; TRL turned the
        # config's use_cache off, so it is asked for)
        with torch.no_grad():
            evaluated = trainer.model_wrapped(input_ids=text, labels=text, use_cache=True).loss.item()
    logged = [record["loss"] for record in trainer.state.log_history if "loss" in record]
    from torch.distributed.fsdp import FSDPModule

    root = trainer.model_wrapped
    # (FSDP2 renames a unit's class "FSDP" + its name.)
    units = sorted(
        type(m).__name__.removeprefix("FSDP") for m in root.modules() if m is not root and isinstance(m, FSDPModule)
    )
    return logged, type(root).__name__, units, evaluated


def trainer_losses(single: bool, out: str) -> dict:
    """A plain transformers `Trainer` (neither TRL nor `gpn train`) on the tiny model under the launch's processes
    as DDP (this launch names FSDP, which Accelerate 1.16 runs as DDP on CPU: the SFT variants apply FSDP2
    themselves, so this one runs first), or alone with the same global batch: 4 steps over texts of different
    lengths, each batch padded to its longest row (so the processes count different numbers of tokens), a
    checkpoint saved at step 2 in `out` (one folder for every process: the main one writes the checkpoint, all
    read it), and a second trainer resumed from it. `{"losses", "resumed", "norms", "model"}`: the logged losses of
    both runs, each trained weight's norm, and the class of the trained (wrapped) model."""
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from modeling_gpn.data import train_bpe_tokenizer
    from tests.tiny_models import TINY_TEXT as TEXT
    from tests.tiny_models import perturbed_model, tiny_config
    from tests.trainer_arguments import common_arguments

    tokenizer = train_bpe_tokenizer(TEXT * 4, vocab_size=300)
    config = tiny_config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    rows = Dataset.from_dict({"input_ids": [tokenizer(text)["input_ids"] for text in TEXT]})
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    args = TrainingArguments(
        **common_arguments(out, max_steps=4, save_strategy="steps", save_steps=2),
        per_device_train_batch_size=4 if single else 2,
    )

    def trained(resume: str | None = None) -> Trainer:
        model = perturbed_model(config, seed=17).train()
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = trained()
    resumed = trained(os.path.join(out, "checkpoint-2"))

    def logged(trainer: Trainer) -> list[float]:
        return [record["loss"] for record in trainer.state.log_history if "loss" in record]

    return {
        "losses": logged(whole),
        "resumed": logged(resumed),
        "norms": [float(p.detach().norm()) for p in whole.model.parameters()],
        "model": type(whole.model_wrapped).__name__,
    }


# name -> (the classes the policy wraps, LoRA on the embedding, every batch padded to one length)
VARIANTS = {
    "lora": (None, True, False),  # `accelerate config`'s default policy: it names no class
    "blocks": ("GPNPredictLayer,GPNMemoryWrite", False, True),
    "unpadded": ("GPNPredictLayer,GPNMemoryWrite", False, False),
}


def result(variant: str) -> dict:
    """`{"losses", "model", "units"}` of `variant` trained over the launch's processes (`losses`), or
    `{"error": traceback}` where it was refused."""
    if variant.startswith("trainer-ddp:"):  # (then the folder its processes share)
        try:
            return trainer_losses(single=False, out=variant.partition(":")[2])
        except Exception:  # noqa: BLE001 (reported, then the next variant)
            return {"error": traceback.format_exc()}
    wrapped, lora_on_the_embedding, pad = VARIANTS[variant]
    os.environ.pop("FSDP_TRANSFORMER_CLS_TO_WRAP", None)
    if wrapped:
        os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] = wrapped
    try:
        seen, trained, units, evaluated = losses(False, lora_on_the_embedding=lora_on_the_embedding, pad=pad)
    except Exception:  # noqa: BLE001 (the refusal under test: reported, then the next variant)
        return {"error": traceback.format_exc()}
    return {"losses": seen, "model": trained, "units": units, "eval_loss": evaluated}


if __name__ == "__main__":
    if "--single" in sys.argv:
        seen, trained, units, evaluated = losses(
            True, lora_on_the_embedding="--lora" in sys.argv, pad="--pad" in sys.argv
        )
        print(
            "LOSSES " + json.dumps({"losses": seen, "model": trained, "units": units, "eval_loss": evaluated}),
            flush=True,
        )
        sys.exit()
    for variant in sys.argv[1:]:
        outcome = result(variant)
        if os.environ.get("RANK", "0") == "0":  # (one line: the processes' prints would interleave)
            print(f"RESULT {variant.partition(':')[0]} " + json.dumps(outcome), flush=True)
