"""Tiny GPN models for fast tests: the fixtures' shapes, with every gate and output perturbed from its
initialisation so that every code path matters."""

from __future__ import annotations

import torch


def tiny_config(**overrides):
    """A small GPN+M config (the fixtures' shapes) for fast tests."""
    from modeling_gpn.bench.models import tiny_config as config_of_tiny_shapes

    return config_of_tiny_shapes(**overrides)


def perturbed_model(config, seed: int = 0):
    """A model whose zero-initialised gates and outputs are perturbed, so every code path matters."""
    from modeling_gpn.bench.models import perturbed_gpn

    return perturbed_gpn(config, seed)


def well_conditioned_model(config, seed: int):
    """`perturbed_model` with its key and query biases raised by 1, away from relu's kink. (With them near
    it, a head's relu'd query can be nearly zero and its l2 normalisation ill-conditioned: some gradients
    then move 50% under a 2^-9 change of the weights even in float32, and no bf16 comparison means anything.
    Here a 2^-9 change moves the float32 gradient by about 1%.)"""
    model = perturbed_model(config, seed=seed).train()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("read_query.bias", "memory_write.key.bias")):
                param.add_(1.0)
    return model


def state_sensitive_model(config, seed: int, tokenizer=None):
    """`perturbed_model` made to remember: its fuse gate's bias raised by 3 (the state kept about 95% a token, not
    50%) and its memory's dt_bias lowered by 3 (the memory decaying about 20 times slower), so that a greedy answer
    depends on what was read a hundred tokens back; with `tokenizer`, the output rows of the tokens that decode to
    no whole character (lone bytes of a longer UTF-8 character) shrunk, so that answers differing in their tokens
    differ in their text, not only in runs of U+FFFD. (`perturbed_model`'s text hardly depends on anything but the
    last few tokens: prompts differing only in a system message 50 to 300 tokens back got 2 or 3 distinct greedy
    answers of 8; here 7 or 8. A test comparing served answers with `generate()` on it could not tell a state
    shared, lost or read from the wrong point from the right one. Not larger weight matrices: at 3 times their
    scale the recurrence is chaotic, and float32 and float64 disagree on most answers; here they agree.)"""
    model = perturbed_model(config, seed=seed)
    with torch.no_grad():
        model.model.fuse_gate.bias.add_(3.0)
        model.model.memory_write.dt_bias.sub_(3.0)
        if tokenizer is not None:
            unprintable = [i for i in range(len(tokenizer)) if not printable(tokenizer.decode([i]))]
            model.model.embed_tokens.weight[unprintable] *= 0.2
    return model


def saved_tiny_llama(folder, tokenizer, seed: int = 0, **overrides) -> None:
    """A tiny random Llama (hidden 16, one layer, two heads) with `tokenizer`, saved to `folder` as a model folder
    `gpn generate` runs: its end of text the tokenizer's (LlamaConfig's 2 is none of the tests' tokenizers')."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **{**settings, **overrides},
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def printable(text: str) -> bool:
    """Whether `text` is whole printable characters (no control character, no U+FFFD of a lone byte)."""
    return text.isprintable() and "\ufffd" not in text


# A tiny corpus of short documents (TRL's trainers and their FSDP launch train a tokenizer and a model on it)
TINY_TEXT = [
    "the cat sat on the mat.",
    "a dog.",
    "once upon a time there was a cat and a dog.",
    "the end.",
    "the dog sat on the log.",
    "a cat and a mat.",
    "there was a time.",
    "upon the mat sat a dog.",
]


def copy_with_a_nan_weight(folder, into, value: float = float("nan")):
    """A copy of the saved GPN `folder` at `into` whose `model.fuse_gate.weight` holds one NaN, or `value` (for the
    loaders' refusal of non-finite weights; 1e5: finite, but inf in float16)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, into)
    tensors = load_file(into / "model.safetensors")
    tensors["model.fuse_gate.weight"][0, 0] = value
    save_file(tensors, into / "model.safetensors", metadata={"format": "pt"})
    return into


def saved_lora_adapter(base_folder, into, with_tokenizer: bool = False, seed: int = 7):
    """The folders a LoRA fine-tune of the GPN saved at `base_folder` leaves, and the model merged from it:
    (`into`/adapter: adapter_config.json naming `base_folder` and the adapter's weights, random so the adapter
    changes every output; the base's tokenizer beside them where `with_tokenizer`; `into`/merged: what
    `PeftModel.from_pretrained(base, adapter).merge_and_unload()` saves, with the base's tokenizer)."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter, merged = into / "adapter", into / "merged"
    torch.manual_seed(seed)
    lora = LoraConfig(r=4, target_modules=["fuse_proj", "gate", "read_query"], init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder), lora).save_pretrained(adapter)
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    PeftModel.from_pretrained(base, adapter).merge_and_unload().save_pretrained(merged)
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    tokenizer.save_pretrained(merged)
    if with_tokenizer:
        tokenizer.save_pretrained(adapter)
    return adapter, merged


# LLaMA-2's byte tokens (byte b is token 3 + b) and its "▁hello"
E9, BE, B98, HELLO = 3 + 0xE9, 3 + 0xBE, 3 + 0x98, 22172
# what a model biased so (`sequence_bias`) makes, from any start: 龘 (<0xE9><0xBE><0x98>), then <0xE9><0xBE>, a run
# that is no UTF-8 as a whole, then "▁hello", again and again; decoded: "����� hello����� hello..."
BYTE_RUNS = [E9, BE, B98, E9, BE, HELLO]
MAKES_BYTE_RUNS = [[[E9], 50.0], [[E9, BE], 100.0], [[E9, BE, B98], 150.0], [[B98, E9, BE, HELLO], 200.0]]


def byte_runs_model_dir(folder, tokenizer_folder, chat_template: str | None = None):
    """A tiny GPN folder over the LLaMA-2 tokenizer (at `tokenizer_folder`) whose generation config makes
    `BYTE_RUNS` over and over, greedy, whatever the prompt (`gpn generate` and `gpn serve` read it as they load)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    model = perturbed_model(tiny_config(vocab_size=32000, eos_token_id=2, bos_token_id=1), seed=5)
    model.generation_config.sequence_bias = MAKES_BYTE_RUNS
    model.save_pretrained(folder)
    return folder


def without_metadata(path, *names: str) -> None:
    """Rewrite the state file at `path` without the metadata fields `names`, as an earlier version of format 2
    wrote it (the checksum covers the tensors, the read fingerprint and the positions read, not these fields)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(path, "pt") as file:
        metadata, tensors = file.metadata(), {name: file.get_tensor(name) for name in file.keys()}  # noqa: SIM118
    assert set(names) <= set(metadata), (names, sorted(metadata))
    save_file(tensors, path, metadata={key: value for key, value in metadata.items() if key not in names})
