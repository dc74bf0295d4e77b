"""`gpn generate MODEL PROMPT...`: text from a model folder or Hub repo with transformers' generate()."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.95


class GenerateError(ValueError):
    """A bad argument or a model/tokenizer that cannot be used; the message says which."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub repo id")
    parser.add_argument("prompts", nargs="+", help="one or more prompts (batched with left padding)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the model's own)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (>= 1)")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=None, help=f"sampling temperature (> 0; with --sample, default {DEFAULT_TEMPERATURE})")
    parser.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (in (0, 1]; with --sample, default {DEFAULT_TOP_P})")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams (>= 1)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling (>= 0)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--trust-remote-code", action="store_true", help="load the model's own code (Hub repos)")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse arguments that generate() would reject with a traceback, or silently ignore."""
    if args.max_new_tokens < 1:
        raise GenerateError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.num_beams < 1:
        raise GenerateError(f"--num-beams must be at least 1, got {args.num_beams}")
    if args.seed < 0:
        raise GenerateError(f"--seed must be >= 0, got {args.seed}")
    if not args.sample:
        given = [name for name, value in (("--temperature", args.temperature), ("--top-p", args.top_p)) if value is not None]
        if given:  # greedy and beam decoding ignore them: say so instead of ignoring them in silence
            raise GenerateError(f"{' and '.join(given)} only apply with --sample (decoding is greedy without it)")
    if args.temperature is not None and not args.temperature > 0:
        raise GenerateError(f"--temperature must be > 0, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise GenerateError(f"--top-p must be in (0, 1], got {args.top_p}")
    for index, prompt in enumerate(args.prompts, start=1):
        if not prompt.strip():
            raise GenerateError(f"prompt {index} is empty: give some text to continue")
    try:
        device = torch.device(args.device)
    except RuntimeError as error:
        raise GenerateError(f"--device {args.device!r} is not a torch device: {error}") from error
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"--device {args.device} asks for CUDA, which this machine does not have; use --device cpu")
    looks_local = args.model.startswith((".", "/", "~")) or Path(args.model).exists() or args.model.count("/") > 1
    if looks_local:
        folder = Path(args.model).expanduser()
        if not folder.exists():
            raise GenerateError(f"model folder {args.model} does not exist")
        if not (folder / "config.json").is_file():
            raise GenerateError(f"{args.model} is not a model folder: it has no config.json")


def _load(args: argparse.Namespace):
    import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = args.tokenizer or args.model
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as error:  # noqa: BLE001 - any loader failure becomes one clear message
        raise GenerateError(f"cannot load a tokenizer from {source}: {type(error).__name__}: {error}") from error
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None and len(args.prompts) > 1:
            raise GenerateError(f"the tokenizer of {source} has neither a pad nor an EOS token to pad a batch of prompts with")
        tokenizer.pad_token = tokenizer.eos_token
    try:
        model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    except Exception as error:  # noqa: BLE001
        raise GenerateError(f"cannot load a model from {args.model}: {type(error).__name__}: {error}") from error
    return model, tokenizer


def run(args: argparse.Namespace) -> int:
    try:
        check_arguments(args)
        model, tokenizer = _load(args)
        model.to(args.device).eval()
        batch = tokenizer(args.prompts, return_tensors="pt", padding=True).to(args.device)
        if batch["input_ids"].shape[1] == 0:
            raise GenerateError("the prompts tokenize to no tokens at all")
        vocab = model.get_input_embeddings().num_embeddings
        if int(batch["input_ids"].max()) >= vocab:
            raise GenerateError(
                f"the tokenizer makes token id {int(batch['input_ids'].max())}, outside the model's vocabulary of {vocab}: "
                "is --tokenizer the model's own?"
            )
        torch.manual_seed(args.seed)
        with torch.no_grad():
            output = model.generate(
                **batch,
                max_new_tokens=args.max_new_tokens,
                do_sample=args.sample,
                temperature=(args.temperature or DEFAULT_TEMPERATURE) if args.sample else None,
                top_p=(args.top_p or DEFAULT_TOP_P) if args.sample else None,
                num_beams=args.num_beams,
                pad_token_id=tokenizer.pad_token_id,
            )
    except GenerateError as error:
        print(f"gpn generate: {error}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, RuntimeError) as error:  # generate() refusing the combination it was given
        print(f"gpn generate: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    prompt_width = batch["input_ids"].shape[1]
    for prompt, row in zip(args.prompts, output):
        print(f"{prompt}{tokenizer.decode(row[prompt_width:], skip_special_tokens=True)}")
        print("-" * 40)
    return 0
