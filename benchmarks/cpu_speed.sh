#!/usr/bin/env bash
# The CPU figures of benchmarks/RESULTS.md (issue "Speed"), one `gpn bench` run after another.
# Usage: bash benchmarks/cpu_speed.sh [OUT_DIR]   (about 15 minutes on 2 cores; run nothing else meanwhile)
set -euo pipefail
out=${1:-bench-out}
mkdir -p "$out"
run() { local name=$1; shift; echo "== $name: gpn bench $*"; gpn bench "$@" --json "$out/$name.json" 2>&1 | tee "$out/$name.txt" | tail -n 30; }

# 1. the main table: tiny and small, plain / fast / Llama, 2 threads, fp32, batch 8 x 256
run main --preset tiny small --skip-plain-decode --decode-prompt-lengths 128 1024 4096 --decode-tokens 16 --repeats 3
# 2. one thread (the same, without the plain path and decoding)
run one-thread --preset small --impl fast llama --threads 1 --decode-prompt-lengths --repeats 5
# 3. memory at 2048 against 256, and decode latency at a 16,384-token prompt against 128
run memory-and-long-decode --preset small --impl fast llama --memory-seq-lens 2048 --decode-prompt-lengths 128 16384 --decode-tokens 32 --repeats 3
# 4. a 64-token segment (the 256-token windows are then recomputed in 4 segments)
run segment-64 --preset small --impl fast llama --segment-length 64 --memory-seq-lens 2048 --decode-prompt-lengths --repeats 5
# 5. what bf16 buys on this CPU
run bf16 --preset small --impl fast llama --dtype bfloat16 --decode-prompt-lengths 1024 --decode-tokens 16 --repeats 3
