"""What a BOS the model never trained on costs at a prompt's start.

`gpn train` joins documents with EOS and puts no BOS in its token stream, while a tokenizer that adds one (LLaMA-2's
`<s>`) puts it before every prompt that `generate()`, `gpn generate` and `gpn serve` read. This script scores the
same snippets of a text file both ways, from the zero state: the text's own tokens alone, and the tokenizer's BOS
followed by them. Each snippet's tokens 1 .. N-1 are the targets of both (token 0 has no prediction without the
BOS), so the two mean losses compare like for like, by band of positions.

    python benchmarks/bos_effect.py runs/llama-tokenizer/model ../shared/data/tinyshakespeare/input.txt
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import modeling_gpn  # noqa: F401  (registers GPN with the Auto classes)

BANDS = ((1, 4), (5, 16), (17, None))  # 1-based positions of the text's tokens scored


def snippets(text_file: Path, count: int, seed: int) -> list[str]:
    """`count` paragraphs (blank-line separated, over 200 characters) of `text_file`, drawn with `seed`."""
    paragraphs = [p for p in text_file.read_text(encoding="utf-8").split("\n\n") if len(p) > 200]
    return random.Random(seed).sample(paragraphs, min(count, len(paragraphs)))


@torch.no_grad()
def losses(model: torch.nn.Module, ids: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """The losses of `ids[1:]` read after `prefix` (token ids) from the zero state."""
    read = torch.cat([torch.tensor(prefix, dtype=torch.long), ids])[None]
    logprobs = model(read).logits[0, len(prefix) : -1].float().log_softmax(-1)
    return -logprobs.gather(-1, ids[1:, None])[:, 0]


def main() -> None:
    """Print the mean loss by band of positions with and without the BOS."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model folder with its tokenizer")
    parser.add_argument("text", type=Path, help="a UTF-8 text file, paragraphs separated by blank lines")
    parser.add_argument("--snippets", type=int, default=200, help="paragraphs scored (default 200)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens of each paragraph scored (default 48)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.bos_token_id is None:
        parser.error(f"{args.model}'s tokenizer has no BOS token: there is nothing to compare")
    rows = {"without BOS": [], "after BOS": []}
    for text in snippets(args.text, args.snippets, args.seed):
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][: args.tokens])
        if len(ids) == args.tokens:
            rows["without BOS"].append(losses(model, ids, []))
            rows["after BOS"].append(losses(model, ids, [tokenizer.bos_token_id]))
    print(
        f"{len(rows['after BOS'])} snippets of {args.tokens} tokens; mean loss (nats) of the text's tokens by position"
    )
    for name, values in rows.items():
        mean = torch.stack(values).mean(0)
        bands = ", ".join(f"{a}-{b or args.tokens - 1}: {mean[a - 1 : b].mean():.4f}" for a, b in BANDS)
        print(f"{name:>12}: all {mean.mean():.4f}; {bands}")


if __name__ == "__main__":
    main()
