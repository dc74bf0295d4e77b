"""A prompt of hundreds of thousands of tokens: the fast path against the plain loop as the prompt grows, and the
peak memory of generate() over it (the extremes audit, 2026-12-06).

    python benchmarks/long_prompt.py --drift --length 300000              # fast/plain x float32/bfloat16, in one process
    python benchmarks/long_prompt.py --memory --length 300000             # generate() calls, a fresh process each

`--drift` reads one random prompt (batch 1) a chunk at a time through a `GPNCache` (`--chunk` positions a forward,
`logits_to_keep=1`) on four models built alike: the fast path and the plain loop, in float32 and in bfloat16
weights. At each checkpoint it prints, for each, the largest difference of the next-token log-probabilities from
the float32 plain loop's, and the norms of the state (p, g, M) and the positions the cache counts. The model is
`--preset` with its zero-initialised gates and outputs perturbed (as the tests' `perturbed_model`), so that every
path of the step matters. The plain loop calls every module at every position: ~0.5 ms a token on this CPU.

`--memory` runs each call of `--calls` in a fresh process on the same model (float32, fast path): the peak RSS
(VmHWM, reset through `/proc/self/clear_refs` after a warm-up) above the RSS before the call, with glibc handing large
blocks straight back (`MALLOC_MMAP_THRESHOLD_`). `forward-keep-1` is generate()'s prefill alone, `generate` greedy
with 4 new tokens, `generate-chunked` the same with transformers' `prefill_chunk_size=4096`, `beams` 2 beams,
`forward-all` a forward asking every position's logits (length x vocab floats: grows by design). Memory figures
hold on a busy machine; the seconds printed do not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESETS = REPO_ROOT / "configuration"
CALLS = ("forward-keep-1", "generate", "generate-chunked", "beams", "forward-all")


def perturbed(preset: str, dtype=None, fast: bool = True):
    """`preset`'s model with its zero-initialised gates and outputs perturbed (seed 1), in `dtype`."""
    import torch

    from modeling_gpn import GPNConfig
    from modeling_gpn.bench.models import perturbed_gpn

    config = GPNConfig.from_json_file(str(PRESETS / f"{preset}.json"))
    config.eos_token_id = None  # (generate() runs its full length)
    model = perturbed_gpn(config, seed=1).to(dtype or torch.float32)
    model.model.use_fast_path = fast
    return model


def prompt(vocab_size: int, length: int):
    import torch

    return torch.randint(1, vocab_size, (1, length), generator=torch.Generator().manual_seed(0))


def drift(preset: str, length: int, chunk: int) -> None:
    import torch

    torch.set_num_threads(1)  # (2 threads on 2 shared cores spin against each other: 60x slower, same figures)
    checkpoints = sorted({c for c in (1_000, 10_000, 30_000, 100_000, 200_000, 300_000, length) if c <= length})
    runs = {"fast float32": (torch.float32, True), "plain float32": (torch.float32, False)}
    runs |= {"fast bfloat16": (torch.bfloat16, True), "plain bfloat16": (torch.bfloat16, False)}
    seen = {}
    for name, (dtype, fast) in runs.items():
        model = perturbed(preset, dtype, fast)
        ids = prompt(model.config.vocab_size, length)
        cache, read, rows = None, 0, {}
        start = time.perf_counter()
        with torch.no_grad():
            for checkpoint in checkpoints:
                while read < checkpoint:
                    n = min(chunk, checkpoint - read)
                    out = model(ids[:, read : read + n], cache=cache, use_cache=True, logits_to_keep=1)
                    cache, read = out.cache, read + n
                p, g, memory = cache.get_state()
                log_probs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                rows[checkpoint] = (
                    log_probs,
                    p.norm().item(),
                    g.norm().item(),
                    memory.norm().item(),
                    cache.get_seq_length(),
                )
        assert model.model.last_recurrence_path == ("fast" if fast else "plain"), model.model.last_recurrence_path
        seen[name] = rows
        print(f"# {name}: {time.perf_counter() - start:.0f} s", flush=True)
    print("| tokens | run | max abs Δ log p against plain float32 | ‖p‖ | ‖g‖ | ‖M‖ | positions counted |")
    print("|---|---|---|---|---|---|---|")
    for checkpoint in checkpoints:
        reference = seen["plain float32"][checkpoint][0]
        for name, rows in seen.items():
            log_probs, p, g, memory, counted = rows[checkpoint]
            difference = (log_probs - reference).abs().max().item()
            print(f"| {checkpoint:,} | {name} | {difference:.1e} | {p:.2f} | {g:.2f} | {memory:.2f} | {counted:,} |")


def memory_one(preset: str, length: int, call: str) -> dict:
    """In this (fresh) process: the call's peak RSS above the RSS before it."""
    import torch

    from modeling_gpn.bench.memory import status_kib

    torch.set_num_threads(1)
    model = perturbed(preset)
    ids = prompt(model.config.vocab_size, length)
    with torch.no_grad():  # warm-up: kernels built, weights folded, generate()'s machinery imported
        model.generate(ids[:, :16], max_new_tokens=2, do_sample=False)
        model(ids[:, :4096], logits_to_keep=1)
    Path("/proc/self/clear_refs").write_text("5", encoding="utf-8")  # reset the peak-RSS mark to the current RSS
    before = status_kib("VmRSS")
    start = time.perf_counter()
    settings = dict(max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        if call == "forward-keep-1":
            assert model(ids, use_cache=True, logits_to_keep=1).cache.get_seq_length() == length
        elif call == "forward-all":
            assert model(ids, use_cache=True).logits.shape[1] == length
        elif call == "generate":
            assert model.generate(ids, **settings).shape[1] == length + 4
        elif call == "generate-chunked":
            assert model.generate(ids, prefill_chunk_size=4096, **settings).shape[1] == length + 4
        elif call == "beams":
            assert model.generate(ids, num_beams=2, **settings).shape[1] == length + 4
    seconds = time.perf_counter() - start
    return {"call": call, "length": length, "peak_above_mib": (status_kib("VmHWM") - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--length", type=int, default=300_000)
    parser.add_argument("--chunk", type=int, default=8192, help="positions a forward reads (--drift)")
    parser.add_argument("--drift", action="store_true")
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--calls", nargs="+", choices=CALLS, default=list(CALLS))
    parser.add_argument("--one", choices=CALLS, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(memory_one(args.preset, args.length, args.one)))
        return
    if not (args.drift or args.memory):
        parser.error("give --drift, --memory or both")
    if args.memory:
        environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        print(f"| {args.preset}, {args.length:,} tokens | peak RSS above the RSS before | seconds (busy machine) |")
        print("|---|---|---|")
        for call in args.calls:
            command = [sys.executable, __file__, "--preset", args.preset, "--length", str(args.length), "--one", call]
            result = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
            record = json.loads(result.stdout.strip().splitlines()[-1])
            print(f"| `{call}` | +{record['peak_above_mib']:.1f} MiB | {record['seconds']:.1f} |", flush=True)
    if args.drift:
        drift(args.preset, args.length, args.chunk)


if __name__ == "__main__":
    main()
