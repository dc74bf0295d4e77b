"""`gpn generate MODEL PROMPT...`: text from a model folder or Hub repo with transformers' generate()."""

from __future__ import annotations

import argparse

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="model folder or Hub repo id")
    parser.add_argument("prompts", nargs="+", help="one or more prompts (batched with left padding)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer name or path (default: the model's own)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams")
    parser.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--trust-remote-code", action="store_true", help="load the model's own code (Hub repos)")


def run(args: argparse.Namespace) -> int:
    import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model.to(args.device).eval()
    batch = tokenizer(args.prompts, return_tensors="pt", padding=True).to(args.device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        output = model.generate(
            **batch,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.sample,
            temperature=args.temperature if args.sample else None,
            top_p=args.top_p if args.sample else None,
            num_beams=args.num_beams,
            pad_token_id=tokenizer.pad_token_id,
        )
    prompt_width = batch["input_ids"].shape[1]
    for prompt, row in zip(args.prompts, output):
        print(f"{prompt}{tokenizer.decode(row[prompt_width:], skip_special_tokens=True)}")
        print("-" * 40)
    return 0
