"""What identifying a state's model costs a save or a load: `state_file.state_fingerprint`, first and again.

    python benchmarks/state_fingerprint.py --preset gpn-m-1l-130m --dtype float32 --repeats 5

A state file names its model by a SHA-256 of every parameter (format version 2; version 1 hashed only the
vectors). The first save or load of a model hashes all its bytes; later ones glance at the parameters (their
version counters and a few thousand values of each) and reuse the hash until the weights change. Prints, per
case, the median in ms: the first fingerprint of a freshly built model, the fingerprint again, and the same
bytes through hashlib's SHA-256 alone (the limit of the first: nothing hashes fewer bytes and still sees every
weight), with the model's bytes and the rate.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time

import torch

from modeling_gpn.bench import build_gpn
from modeling_gpn.cli.quantization import weight_dtype
from modeling_gpn.state_file import state_fingerprint


def timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


def sha256_each(arrays) -> None:
    for array in arrays:
        hashlib.sha256(array).digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpn-m-1l-130m", help="model preset (gpn bench's)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="weights' dtype")
    parser.add_argument("--repeats", type=int, default=5, help="models built and timed (medians of these)")
    parser.add_argument("--again", type=int, default=20, help="fingerprints again per model after the first")
    args = parser.parse_args()

    first, again, plain = [], [], []
    for _ in range(args.repeats):
        model = build_gpn(args.preset, weight_dtype(args.dtype), "cpu", 64).model
        first.append(timed(state_fingerprint, model))
        again.extend(timed(state_fingerprint, model) for _ in range(args.again))
        weights = [
            parameter.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for parameter in model.parameters()
        ]
        plain.append(timed(sha256_each, weights))
    size = sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())
    print(f"{args.preset} {args.dtype}: {size / 1e6:.1f} MB of parameters, medians of {args.repeats} models")
    for name, times in (("first fingerprint", first), ("sha256 of the bytes", plain)):
        median = statistics.median(times)
        print(f"  {name:20s} {median * 1e3:9.2f} ms  ({size / median / 1e9:.2f} GB/s of parameters)")
    print(f"  {'fingerprint again':20s} {statistics.median(again) * 1e3:9.2f} ms  (a glance: nothing hashed again)")


if __name__ == "__main__":
    main()
