"""Peak memory (and, on a quiet machine, time) of a no-grad prefill at long prompt lengths (issue 20).

    python benchmarks/prefill_memory.py                                   # memory, this checkout, 4k/32k/131k
    python benchmarks/prefill_memory.py --code /tmp/gpn-before            # the same with another checkout's code
    python benchmarks/prefill_memory.py --speed --lengths 4096 32768      # same-process A/B: chunked vs one pass

Each memory figure comes from a fresh process: the model (`--preset`, batch 1) is built and warmed up,
the kernel's peak-RSS mark is reset (`/proc/self/clear_refs`), one forward runs under `torch.no_grad()`
with `use_cache=True, logits_to_keep=1` (what generate()'s prefill asks for), and the figure is the peak
RSS (VmHWM) minus the RSS before it: every byte the prefill held at its worst, torch's CPU allocations
included. glibc is told to hand large blocks straight back (`MALLOC_MMAP_THRESHOLD_`), so memory freed
before the prefill does not hide what it allocates. `--code DIR` imports `modeling_gpn` from DIR (e.g.
`git archive 8078de9 modeling_gpn | tar -x -C DIR`, the code before the chunked prefill).

`--speed` times the prefill with chunking on and off (`prefill_chunk_length = 0`) in one process, in turn,
`--repeats` times, and prints the medians: run it on a quiet machine (the figures are noise on a busy one).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]
PRESETS = REPO_ROOT / "configuration"


@functools.cache
def process_memory() -> ModuleType:
    """This checkout's `modeling_gpn.bench.memory` (`status_kib`), its file loaded by its path: `--code` imports
    another checkout's modeling_gpn in this process, which may have no such module and must not be imported after
    this checkout's."""
    spec = importlib.util.spec_from_file_location("gpn_bench_memory", REPO_ROOT / "modeling_gpn/bench/memory.py")
    memory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(memory)
    return memory


def build_model(preset: str, code: str | None):
    if code:
        sys.path.insert(0, code)
    import torch

    import modeling_gpn
    from modeling_gpn import GPNConfig, GPNForCausalLM

    if code:
        assert Path(modeling_gpn.__file__).resolve().is_relative_to(Path(code).resolve()), modeling_gpn.__file__
    torch.manual_seed(0)
    config = GPNConfig.from_json_file(str(PRESETS / f"{preset}.json"))
    return GPNForCausalLM(config).eval(), modeling_gpn.__file__


def measure_one(preset: str, length: int, code: str | None, threads: int) -> dict:
    """In this (fresh) process: the prefill's peak RSS above the RSS before it."""
    import torch

    torch.set_num_threads(threads)
    model, source = build_model(preset, code)
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :64], use_cache=True, logits_to_keep=1)  # warm-up: kernels built, weights folded
    status_kib = process_memory().status_kib  # (loaded before the peak-RSS mark is reset)
    Path("/proc/self/clear_refs").write_text("5", encoding="utf-8")  # reset the peak-RSS mark to the current RSS
    before = status_kib("VmRSS")
    start = time.perf_counter()
    with torch.no_grad():
        out = model(ids, use_cache=True, logits_to_keep=1)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    assert out.cache.get_seq_length() == length
    return {
        "length": length,
        "rss_before_kib": before,
        "peak_kib": peak,
        "prefill_peak_mib": (peak - before) / 1024,
        "seconds": seconds,
        "code": source,
        "cache_bytes": out.cache.nbytes(),
    }


def speed_ab(preset: str, lengths: list[int], repeats: int, threads: int) -> None:
    """Median seconds of the prefill with chunking on and off, timed in turn in one process."""
    import torch

    torch.set_num_threads(threads)
    model, _ = build_model(preset, None)
    chunk = model.prefill_chunk_length
    print(f"{preset}, batch 1, {threads} threads, chunk {chunk}; median of {repeats} (in turn)")
    for length in lengths:
        ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
        times = {"chunked": [], "one pass": []}
        with torch.no_grad():
            model(ids[:, :64], use_cache=True, logits_to_keep=1)
            for _ in range(repeats):
                for name, setting in (("chunked", chunk), ("one pass", 0)):
                    model.prefill_chunk_length = setting
                    start = time.perf_counter()
                    model(ids, use_cache=True, logits_to_keep=1)
                    times[name].append(time.perf_counter() - start)
        model.prefill_chunk_length = chunk
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"{length:>8} tokens: chunked {length / medians['chunked']:,.0f} tok/s, one pass "
            f"{length / medians['one pass']:,.0f} tok/s, ratio {medians['one pass'] / medians['chunked']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--code", default=None, help="import modeling_gpn from this folder (another checkout)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--speed", action="store_true", help="time chunked vs one pass instead (quiet machine)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="append each memory result to this JSON-lines file")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.speed:
        speed_ab(args.preset, args.lengths, args.repeats, args.threads)
        return
    if args.one is not None:
        print(json.dumps(measure_one(args.preset, args.one, args.code, args.threads)))
        return
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    for length in args.lengths:
        command = [
            sys.executable,
            __file__,
            "--preset",
            args.preset,
            "--one",
            str(length),
            "--threads",
            str(args.threads),
        ]
        if args.code:
            command += ["--code", args.code]
        result = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
        record = json.loads(result.stdout.strip().splitlines()[-1])
        print(
            f"{args.preset} prefill of {length:>7} tokens: peak +{record['prefill_peak_mib']:.1f} MiB "
            f"(RSS before {record['rss_before_kib'] / 1024:.0f} MiB, {record['seconds']:.0f} s) [{record['code']}]",
            flush=True,
        )
        if args.json:
            with open(args.json, "a", encoding="utf-8") as file:
                file.write(json.dumps({"preset": args.preset, **record}) + "\n")


if __name__ == "__main__":
    main()
