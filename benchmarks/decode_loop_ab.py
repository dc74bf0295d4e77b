"""Decode ms/token through generate() and through a hand-written decode loop, before and after, in one process.

Issue 27 item 4: the cache keeps what it read as one fingerprint of fixed size updated in place (it kept one
cloned tensor per decode call, folded every 64 calls), and a hand-written decode loop must cost what
generate() costs per token. Both revisions' modeling files are imported side by side (as
benchmarks/ab_decode.py does), the new side loads the old side's weights, and every repeat runs the four
measurements in turn, the order rotated from repeat to repeat (a slow spell of a shared machine hits all
four alike):

- generate: `model.generate(prompt, ...)` greedy, batch 1, N tokens with no end token to stop it
  (`gpn bench`'s `greedy_without_end`, not `min_new_tokens`, whose logits processors cost more than a small
  GPN's step); a streamer stamps every new token, and the gaps between the later tokens are the decode times;
- loop: `model(prompt, use_cache=True)`, then `model(next_token, cache=cache, use_cache=True)` N - 1 times,
  the next token the argmax of the last logits, under `torch.no_grad()`; the gap between tokens likewise.

The figures are medians over every gap of every repeat. It also prints the bytes every tensor in the cache
adds up to after the first and after the last decoded token (the fingerprint included), what the cache's
record of what it read costs per decoded token (`cache.record_read` alone, timed in a loop), and the
machine's load average before and after (the machine is shared: say what ran beside it).

    python benchmarks/decode_loop_ab.py --old 3b78628 --new WORKTREE --preset small --prompt-length 128 \\
        --tokens 64 --repeats 7 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_decode import materialise  # noqa: E402 (the same side-by-side import of two revisions)

from modeling_gpn.bench.memory import bytes_held  # noqa: E402
from modeling_gpn.bench.timing import greedy_without_end  # noqa: E402


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Stamps:
    """A generate() streamer that stamps every put (the prompt first, then each new token)."""

    def __init__(self, device: str):
        self.device, self.times = device, []

    def put(self, value) -> None:
        synchronize(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def through_generate(model, prompt, tokens: int, device: str) -> list[float]:
    streamer = Stamps(device)
    model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        generation_config=greedy_without_end(model, tokens),
        streamer=streamer,
    )
    stamps = streamer.times[1:]  # (the first put is the prompt)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def through_loop(model, prompt, tokens: int, device: str, sizes: dict | None = None) -> list[float]:
    out = model(prompt, use_cache=True, logits_to_keep=1)
    cache = out.cache
    next_token = out.logits[:, -1].argmax(-1, keepdim=True)
    synchronize(device)
    stamps = [time.perf_counter()]
    for step in range(tokens - 1):
        out = model(next_token, cache=cache, use_cache=True)
        next_token = out.logits[:, -1].argmax(-1, keepdim=True)
        synchronize(device)
        stamps.append(time.perf_counter())
        if sizes is not None and step in (0, tokens - 2):
            sizes[step + 1] = bytes_held(cache)
    return [b - a for a, b in zip(stamps, stamps[1:])]


def record_costs(models: dict, prompt, calls: int = 2000, rounds: int = 7) -> dict[str, float]:
    """Median µs per `cache.record_read` of one decoded token (what the cache does per call to keep what it
    read), on a cache that has read the prompt: `calls` calls a round, the sides alternated round by round."""
    caches = {side: model(prompt, use_cache=True, logits_to_keep=1).cache for side, model in models.items()}
    token = prompt[:, -1:]
    per_call = {side: [] for side in models}
    for _ in range(rounds):
        for side, cache in caches.items():
            start = time.perf_counter()
            for _ in range(calls):
                cache.record_read(token, None)
            per_call[side].append((time.perf_counter() - start) / calls)
    return {side: 1e6 * statistics.median(values) for side, values in per_call.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="git revision of the 'before' side (e.g. 3b78628)")
    parser.add_argument("--new", default="WORKTREE", help="git revision of the 'after' side, or WORKTREE (default)")
    parser.add_argument("--preset", default="small", help="model preset (configuration/*.json)")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per run (generate() and the loop)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16", "int8"], help="int8: torchao weight-only"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    if args.tokens < 3:
        parser.error("--tokens must be at least 3 (the gaps after the first new token are timed)")
    torch.set_num_threads(args.threads)

    from modeling_gpn.cli.quantization import quantize_int8, weight_dtype
    from modeling_gpn.configuration import load_preset

    config_values = load_preset(args.preset).to_dict()
    dtype = weight_dtype(args.dtype)
    load_before = os.getloadavg()
    models = {}
    with tempfile.TemporaryDirectory() as folder:
        for side, revision in (("old", args.old), ("new", args.new)):
            modeling, configuration = materialise(revision, f"gpn_loop_ab_{side}", Path(folder))
            config = configuration.GPNConfig(**{k: v for k, v in config_values.items() if k != "model_type"})
            torch.manual_seed(0)
            model = modeling.GPNForCausalLM(config)
            if models:
                model.load_state_dict(next(iter(models.values())).state_dict())
            models[side] = model.to(args.device, dtype).eval()
        if args.dtype == "int8":  # (both sides quantized alike, after the new side took the old side's weights)
            models = {side: quantize_int8(model) for side, model in models.items()}

        generator = torch.Generator().manual_seed(1)
        prompt = torch.randint(1, config.vocab_size, (1, args.prompt_length), generator=generator).to(args.device)
        runs = [(side, mode) for side in models for mode in ("generate", "loop")]
        measure = {"generate": through_generate, "loop": through_loop}
        gaps = {run: [] for run in runs}
        sizes = {side: {} for side in models}
        started = time.perf_counter()
        with torch.no_grad():
            for side, model in models.items():  # warm-up (kernels, folds, allocator)
                through_generate(model, prompt, args.tokens, args.device)
                through_loop(model, prompt, args.tokens, args.device, sizes[side])
            for repeat in range(args.repeats):
                shift = repeat % len(runs)
                for side, mode in runs[shift:] + runs[:shift]:
                    gaps[side, mode] += measure[mode](models[side], prompt, args.tokens, args.device)
            record_us = record_costs(models, prompt)
        elapsed = time.perf_counter() - started
    load_after = os.getloadavg()

    median = {run: 1e3 * statistics.median(values) for run, values in gaps.items()}
    print(
        f"preset {args.preset}, {args.dtype}, {args.device}, threads {torch.get_num_threads()}, prompt "
        f"{args.prompt_length}, {args.tokens} new tokens a run, {args.repeats} repeats, old {args.old}, new {args.new}"
    )
    print(f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1 min), {elapsed:.0f} s of runs\n")
    print(
        "| code | generate() ms/token | loop ms/token | loop / generate() | cache bytes after 1 / "
        f"{args.tokens - 1} decoded |"
    )
    print("|---|---|---|---|---|")
    for side in models:
        g, loop = median[side, "generate"], median[side, "loop"]
        first, last = sizes[side][1], sizes[side][args.tokens - 1]
        print(
            f"| {side} ({args.old if side == 'old' else args.new}) | {g:.3f} | {loop:.3f} | {loop / g:.3f} | "
            f"{first:,} / {last:,} |"
        )
    print(
        f"\nthe cache's record of what it read, per decoded token: old {record_us['old']:.1f} µs, "
        f"new {record_us['new']:.1f} µs (`cache.record_read`, median of 7 alternated rounds of 2,000 calls)"
    )
    print(
        f"new / old: generate() {median['new', 'generate'] / median['old', 'generate']:.3f}, "
        f"loop {median['new', 'loop'] / median['old', 'loop']:.3f}"
    )


if __name__ == "__main__":
    main()
