"""Long decoding stays flat (issue 20): memory and ms/token while a GPN generates 100k tokens.

    python benchmarks/long_decode.py --preset small --tokens 100000 --interval 10000            # decode loop
    python benchmarks/long_decode.py --preset small --tokens 100000 --interval 10000 --generate # through generate()

Greedy decoding from a 16-token prompt, batch 1, with a randomly initialised model of `--preset`. The
decode loop calls the model on one token at a time with its `GPNCache` (what generate() does inside);
`--generate` runs transformers' `generate()` itself (without an end-of-sequence token, so it never stops
early: `bench.greedy_without_end`) and reads the clock in a streamer. Every `--interval` tokens it prints the tokens so far, the mean
ms/token over the interval, the process RSS now and its peak, and the cache's size: flat lines are the claim.
Memory figures are valid on a busy machine; the ms/token figures only on a quiet one.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from modeling_gpn.bench import greedy_without_end
from modeling_gpn.bench.memory import status_kib

REPO_ROOT = Path(__file__).resolve().parents[1]


class Report:
    """Prints one line per `interval` tokens: ms/token over the interval, RSS now and peak, cache size."""

    def __init__(self, interval: int, cache_bytes):
        self.interval, self.cache_bytes = interval, cache_bytes
        self.count, self.last = 0, time.perf_counter()
        print("| tokens | ms/token (interval) | RSS MiB | peak RSS MiB | cache |\n|---|---|---|---|---|", flush=True)

    def token(self) -> None:
        self.count += 1
        if self.count % self.interval == 0:
            now = time.perf_counter()
            ms = 1000 * (now - self.last) / self.interval
            self.last = now
            print(
                f"| {self.count:,} | {ms:.3f} | {status_kib('VmRSS') / 1024:.1f} | {status_kib('VmHWM') / 1024:.1f} | "
                f"{self.cache_bytes() / 1024:.1f} KB |",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--interval", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--generate", action="store_true", help="decode through transformers' generate()")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    from modeling_gpn import GPNConfig, GPNForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPNConfig.from_json_file(str(REPO_ROOT / "configuration" / f"{args.preset}.json"))
    model = GPNForCausalLM(config).to(args.device).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
    print(
        f"{args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters), "
        f"{'generate()' if args.generate else 'decode loop'}, batch 1, {args.threads} thread(s), {args.device}"
    )

    with torch.no_grad():
        if args.generate:
            from transformers.generation.streamers import BaseStreamer

            holder = {}

            class Streamer(BaseStreamer):
                def __init__(self):
                    self.report, self.first = None, True

                def put(self, value):
                    if self.first:  # the prompt
                        self.first = False
                        self.report = Report(
                            args.interval, lambda: holder["cache"].nbytes() if "cache" in holder else 0
                        )
                        return
                    self.report.token()

                def end(self):
                    pass

            cache = __import__("modeling_gpn").GPNCache(config)
            holder["cache"] = cache
            model.generate(
                prompt,
                cache=cache,
                generation_config=greedy_without_end(model, args.tokens),
                streamer=Streamer(),
            )
        else:
            out = model(prompt, use_cache=True, logits_to_keep=1)
            cache = out.cache
            report = Report(args.interval, cache.nbytes)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(args.tokens):
                out = model(token, cache=cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
                report.token()
    print(f"positions read: {cache.get_seq_length():,}")


if __name__ == "__main__":
    main()
