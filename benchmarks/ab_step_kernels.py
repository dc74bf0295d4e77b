"""A/B/C in one process: the fast path on torch ops (`GPN_STEP_KERNELS=0`), on the C step kernels with the
few-row products around them (`GPN_DECODE_KERNEL=0`), and with a decoded token in one C call (the default),
alternated inside every repeat with the reads that give the byte limit, so a noisy machine's spells hit
all of them alike (the figures of benchmarks/RESULTS.md while neighbours ran; gpn bench runs each
configuration in its own process, minutes apart).

    python benchmarks/ab_step_kernels.py --preset small gpn-m-1l-130m --dtype float32 bfloat16 int8 \
        --threads 1 --prompt 64 --repeats 5

Per preset and dtype, medians over the repeats: the one-token step (a forward of one token with its cache,
batch 1) over the step's byte limit, and a prompt's prefill per token (`--prompt` tokens, `logits_to_keep=1`,
as generate() asks) over a prompt token's limit (`bench.limit`). The steps and the prompts continue one
cache, so what they derive from the weights (their plans: int4 weights packed or dequantized) is derived once, as
inside one generate() call, not at every timing. `--clock cpu` (default with one thread)
times the thread's CPU time, which a descheduled thread does not accrue.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from modeling_gpn.bench import ReadProbe, build_gpn, prefill_bytes, step_and_prefill_fns, step_bytes

SIDES = {  # the settings of each side (the prefill is the same on the last two: only decoding differs)
    "torch ops": {"GPN_STEP_KERNELS": "0", "GPN_DECODE_KERNEL": "1"},
    "step kernels": {"GPN_STEP_KERNELS": "1", "GPN_DECODE_KERNEL": "0"},
    "one-call decode": {"GPN_STEP_KERNELS": "1", "GPN_DECODE_KERNEL": "1"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", nargs="+", default=["small"])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "int8"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens of the prefill timing")
    parser.add_argument("--steps", type=int, default=10, help="one-token steps per repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=["cpu", "wall"], default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if (args.clock or ("cpu" if args.threads == 1 else "wall")) == "cpu" else time.perf_counter
    print(
        f"threads {args.threads}, {'CPU' if clock is time.thread_time else 'wall'} clock, medians of {args.repeats} "
        f"repeats ({args.steps} steps each; prefill of {args.prompt} tokens)\n"
    )
    print(
        "| preset | weights | limit ms (MB, GB/s) | step ms, torch ops | step kernels | one-call decode | "
        "prompt-token limit ms (MB) | prefill ms/token, torch ops | step kernels |\n|---|---|---|---|---|---|---|---|---|"
    )
    for preset in args.preset:
        for dtype in args.dtype:
            model = build_gpn(preset, dtype, "cpu", 0).eval()
            ids = torch.randint(
                1, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)
            )
            step, prefill = step_and_prefill_fns(model, ids)  # (one cache, as in generate())
            limit, prompt_limit = ReadProbe(step_bytes(model)), ReadProbe(prefill_bytes(model))
            times = {
                key: [] for key in ("limit", "prompt limit", *[(s, k) for s in SIDES for k in ("step", "prefill")])
            }
            for _ in range(args.repeats + 1):  # (the first repeat warms up and is dropped)
                for side, settings in SIDES.items():
                    os.environ.update(settings)
                    start = clock()
                    for _ in range(args.steps):
                        step()
                    times[(side, "step")].append((clock() - start) / args.steps)
                    if side == "one-call decode":
                        continue  # (its prefill is the step kernels')
                    start = clock()
                    prefill()
                    times[(side, "prefill")].append((clock() - start) / args.prompt)
                for key, probe in (("limit", limit), ("prompt limit", prompt_limit)):
                    start = clock()
                    for _ in range(args.steps):
                        probe()
                    times[key].append((clock() - start) / args.steps)
            os.environ.update(SIDES["one-call decode"])
            ms = {key: 1e3 * statistics.median(values[1:]) for key, values in times.items() if values}
            ratio = lambda key, of: f"{ms[key]:.3f} ({ms[key] / ms[of]:.2f}x)"  # noqa: B023 (called in this iteration)
            torch_ops, kernels, one_call = SIDES
            print(
                f"| {preset} | {dtype} | {ms['limit']:.3f} ({limit.nbytes / 1e6:.1f}, {limit.nbytes / ms['limit'] / 1e6:.0f}) | "
                f"{ratio((torch_ops, 'step'), 'limit')} | {ratio((kernels, 'step'), 'limit')} | "
                f"{ratio((one_call, 'step'), 'limit')} | {ms['prompt limit']:.3f} ({prompt_limit.nbytes / 1e6:.1f}) | "
                f"{ratio((torch_ops, 'prefill'), 'prompt limit')} | {ratio((kernels, 'prefill'), 'prompt limit')} |",
                flush=True,
            )
            del model, step, prefill


if __name__ == "__main__":
    main()
