"""What a run trains: the model from its settings, the AdamW groups and the learning-rate schedule, the
extra inputs of `--reset-at-document-start`, the sample written at the end, and the weights' fingerprint."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .settings import read_json


def model_config_dict(config: dict) -> dict:
    """The model's config as a plain dict with `model_type` (from preset name, path, inline dict or llama file)."""
    if config["llama_config"]:
        values = read_json(Path(config["llama_config"]), "Llama config")
        values["model_type"] = "llama"
    elif isinstance(config["model"], dict):
        values = dict(config["model"])
    else:
        from modeling_gpn.configuration import preset_path

        values = read_json(preset_path(config["model"]), "model preset")
    values.pop("_comment", None)
    values.setdefault("model_type", "gpn")
    if config["model_type"]:
        values["model_type"] = config["model_type"]
    values.update(config.get("model_overrides") or {})
    return values


def check_model_overrides(config: dict) -> None:
    """Refuse `model_overrides` naming a setting the model's config class does not have (`{"hiden_size": 8}`
    trained a model of the default size in silence: a config takes and keeps any key), before the data are read."""
    overrides = config.get("model_overrides") or {}
    if not overrides:
        return
    model_type = model_config_dict(config)["model_type"]
    if model_type == "gpn":
        from modeling_gpn import GPNConfig

        known = GPNConfig().to_dict()
    else:
        from transformers import AutoConfig

        try:
            known = AutoConfig.for_model(model_type).to_dict()
        except ValueError:  # (an unknown model type: build_model names it)
            return
    unknown = sorted(key for key in overrides if key not in known)
    if unknown:
        raise ValueError(
            f"model_overrides: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not a setting of a "
            f"{model_type} model's config (a misspelt name would be kept and ignored)"
        )


def build_model(config: dict, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A freshly initialised GPNForCausalLM or LlamaForCausalLM, its vocabulary and special ids from `tokenizer`."""
    values = model_config_dict(config)
    model_type = values.pop("model_type")
    for key in ("architectures", "transformers_version", "auto_map", "torch_dtype", "dtype"):
        values.pop(key, None)
    values.update(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if model_type == "gpn":
        from modeling_gpn import GPNConfig, GPNForCausalLM

        values.update(
            max_length_hint=config["seq_len"],
            bptt_truncation_length=config["bptt_truncation"],
            bptt_segment_length=config["bptt_segment"] or None,
        )
        return GPNForCausalLM(GPNConfig(**values))
    if model_type == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        if config["bptt_truncation"]:
            raise ValueError("bptt_truncation applies to GPN models only, not to the llama baseline")
        values.setdefault("max_position_embeddings", config["seq_len"])
        return LlamaForCausalLM(LlamaConfig(**values))
    # Any other transformers causal LM by its model_type, e.g. qwen3_next with every layer
    # gated-delta linear attention: the Gated DeltaNet baseline of `gpn study`.
    from transformers import AutoConfig, AutoModelForCausalLM

    if config["bptt_truncation"]:
        raise ValueError(f"bptt_truncation applies to GPN models only, not to {model_type}")
    try:
        model_config = AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise ValueError(
            f"Unknown model_type {model_type!r}: use gpn, llama or a transformers model type ({error})"
        ) from error
    return AutoModelForCausalLM.from_config(model_config)


NO_DECAY_NAMES = ("A_log", "dt_bias")


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: weight decay on matrices only; 1-D parameters (norms, biases), A_log and dt_bias
    get none (as the reference). Each group lists its parameter names under "names"."""
    decay, no_decay = ([], []), ([], [])
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        target = no_decay if param.dim() < 2 or name.split(".")[-1] in NO_DECAY_NAMES else decay
        target[0].append(name)
        target[1].append(param)
    return [
        {"params": decay[1], "names": decay[0], "weight_decay": weight_decay},
        {"params": no_decay[1], "names": no_decay[0], "weight_decay": 0.0},
    ]


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier for optimizer step `step` (0-based): linear warmup over `warmup_steps`
    (reaching the peak at step `warmup_steps`), then cosine from the peak to `min_lr_ratio` at `total_steps`."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, config: dict) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `parameter_groups` and the warmup + cosine `LambdaLR` (stepped once per optimizer step)."""
    import torch

    groups = parameter_groups(model, config["weight_decay"])
    optimizer = torch.optim.AdamW(
        [{k: v for k, v in g.items() if k != "names"} for g in groups],
        lr=config["lr"],
        betas=(config["beta1"], config["beta2"]),
        eps=config["eps"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(step, config["warmup_steps"], config["steps"], config["min_lr_ratio"]),
    )
    return optimizer, scheduler


def generate_sample(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int, seed: int
) -> str:
    """Sample `max_new_tokens` after `prompt` (top-k 40, temperature 0.8, seeded)."""
    import torch

    model.eval()
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"].to(model.device)
    if ids.shape[1] == 0:
        ids = torch.tensor([[tokenizer.eos_token_id]], device=model.device)
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            top_k=40,
            temperature=0.8,
        )
    torch.random.set_rng_state(generator_state)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def weights_sha256(model: nn.Module) -> str:
    """A fingerprint of the weights (names and float32 values), to check that every process ended alike."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
