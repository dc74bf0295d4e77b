#!/usr/bin/env bash
# The byte-limit tables of benchmarks/RESULTS.md (issue 28): batch-1 decode and prefill of `small` and
# gpn-m-1l-130m in fp32, bf16 and int8 (torchao int8 weight-only), at 1 and 2 threads, each figure beside
# the limit measured in the same run; "before" is the torch-ops fast path (GPN_STEP_KERNELS=0), "after"
# the C step kernels. Then `python benchmarks/byte_limit_table.py OUT_DIR` prints the table.
# Usage: bash benchmarks/byte_limit.sh [OUT_DIR] [PROMPT_LENGTHS...]   (default 2048 16384; run nothing else
# meanwhile: on 2 quiet cores about 2 hours, most of it the 16,384-token prefills of the 130M model before)
# PRESETS, DTYPES, THREADS and CODES (environment) narrow the matrix, e.g. PRESETS=small THREADS=1 (DTYPES may
# also name int4: torchao's int4 weight-only, which the C kernels' int4 products read as int4).
set -euo pipefail
out=${1:-byte-limit-out}
shift || true
lengths=${*:-2048 16384}
mkdir -p "$out"
for threads in ${THREADS:-1 2}; do
  for dtype in ${DTYPES:-float32 bfloat16 int8}; do
    for preset in ${PRESETS:-small gpn-m-1l-130m}; do
      repeats=3; [ "$preset" = gpn-m-1l-130m ] && repeats=2
      for code in ${CODES:-before after}; do
        setting=1; [ "$code" = before ] && setting=0
        name="$preset-$dtype-t$threads-$code"
        echo "== $name"
        GPN_STEP_KERNELS=$setting gpn bench --preset "$preset" --impl fast --dtype "$dtype" --threads "$threads" \
          --skip-training --decode-prompt-lengths $lengths --decode-tokens 8 --decode-batches 1 4 16 \
          --repeats "$repeats" --json "$out/$name.json" > "$out/$name.txt" 2>&1 || { echo "failed: see $out/$name.txt"; continue; }
        grep -E "limit:|one-token step|generate\(\) decode" "$out/$name.txt" || true
      done
    done
  done
done
python benchmarks/byte_limit_table.py "$out"
