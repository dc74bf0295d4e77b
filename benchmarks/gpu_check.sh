#!/usr/bin/env bash
# One short device run (fits in 5 minutes on one H200): CUDA correctness of the fast path and its Triton
# kernels (Triton = torch ops = plain, fp32 and bf16; the decode graph; the training graphs), the 130M
# model's one-token step and its training step with the training graphs off and on,
# then `gpn bench` of the 130M GPN+M in bf16 beside the matched Llama at 16 x 2048 and at the largest
# batch of {64, 32} that fits both; last, one JSON summary of every figure and target.
#
# Usage (repo root): bash benchmarks/gpu_check.sh        outputs in $OUT (default /tmp/gpu_out)
# Exit status: 0 all correctness checks passed and every bench ran; 1 something failed (each step says
# what); 2 no CUDA device: only the CPU-interpreter correctness tests ran (tests/test_triton_kernels.py and
# tests/test_training_graphs.py),
# so nothing about the GPU was checked.
# Needs the transformers wheel the project pins in .whl/ when the image's transformers is older.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
status=0

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here. Running only the CPU-interpreter correctness part"
  echo "(every Triton kernel against the torch ops, fast = plain on the Triton path) and exiting 2."
  TRITON_INTERPRET=1 python3 -m pytest -q tests/test_triton_kernels.py tests/test_training_graphs.py
  echo "gpu_check: exit 2 (no CUDA device: the GPU checks and benchmarks did not run)"
  exit 2
fi

if ls .whl/transformers-5.24*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/transformers-5.24*.whl && export PYTHONPATH=/tmp/site
fi
# the package layout without installing: modeling_gpn + its configuration presets
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r modeling_gpn /tmp/pkg/ && cp -r configuration /tmp/pkg/modeling_gpn/configuration && cp -r conversion /tmp/pkg/modeling_gpn/conversion && cp -r eval /tmp/pkg/modeling_gpn/evaluation
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
unset TRITON_INTERPRET  # compiled kernels on the GPU
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import triton; print('triton', triton.__version__)" || { echo "[FAIL] triton does not import: the fast path runs its torch ops, the Triton kernels are not checked"; status=1; }

# 1. correctness (with the training graphs) + the one-token step (about 70 s)
timeout 110 python3 benchmarks/gpu_check.py --decode-timing --out "$OUT" 2>&1 | tee "$OUT/correctness.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] gpu_check.py: see the lines above"; status=1; }
# 1b. the 130M training step (bf16, 16 x 256) with the training graphs off and on (about 20 s)
timeout 60 python3 benchmarks/gpu_check.py --training-timing --out "$OUT" 2>&1 | tee "$OUT/training_timing.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] training timing: see the lines above"; status=1; }
# the bench uses graphs only where their checks passed: all of them (GPN_CUDA_GRAPHS=1), or those of the
# no-grad windows only (GPN_CUDA_GRAPHS=inference: generate() through the decode graph)
if grep -q "^\[ok\] cuda generate() through the captured decode graph" "$OUT/correctness.txt"; then
  export GPN_CUDA_GRAPHS=inference
  if grep -q "^\[ok\] cuda fp32 training through graphs" "$OUT/correctness.txt" && grep -q "^\[ok\] cuda bf16 training through graphs" "$OUT/correctness.txt" \
     && grep -q "^\[ok\] cuda gpn-m-1l-130m bf16 16x256 training gradients, graphs on vs off" "$OUT/training_timing.txt"; then
    export GPN_CUDA_GRAPHS=1
  fi
fi
echo "graphs in the bench: ${GPN_CUDA_GRAPHS:-off} (1: decode and training; inference: decode only)"

# 2. gpn bench at 16 x 2048 (training, forward, prefill and decode after a 4096-token prompt; about 100 s)
BENCH="env -C /tmp/pkg python3 -m modeling_gpn.cli bench --device cuda --dtype bfloat16 --preset gpn-m-1l-130m --impl fast llama --repeats 2"
timeout 130 $BENCH --batch 16 --seq-len 2048 --decode-prompt-lengths 4096 --decode-tokens 12 --json "$OUT/bench_16x2048.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_16x2048.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] bench at 16 x 2048 did not finish (timeout 130 s or an error above)"; status=1; }

# 3. the largest batch of {64, 32} that fits both models (training and forward only; about 80 s)
for batch in 64 32; do
  timeout 90 $BENCH --batch $batch --seq-len 2048 --decode-prompt-lengths --json "$OUT/bench_large_${batch}x2048.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_large_${batch}x2048.txt"
  code=${PIPESTATUS[0]}
  if [ "$code" -eq 0 ]; then break; fi
  rm -f "$OUT/bench_large_${batch}x2048.json"
  if grep -q "OutOfMemoryError\|out of memory" "$OUT/bench_large_${batch}x2048.txt"; then
    echo "batch $batch does not fit: trying the next"; continue
  fi
  echo "[FAIL] bench at $batch x 2048 exited $code (not a memory error: see above)"; status=1; break
done

# 4. one JSON summary
python3 benchmarks/gpu_check.py --summary "$OUT" | tee "$OUT/summary.json"
echo "gpu_check: exit $status"
exit $status
