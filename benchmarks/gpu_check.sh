#!/usr/bin/env bash
# One short device run (at most GPU_CHECK_BUDGET seconds, default 330, on one H200): CUDA correctness of the
# fast path and its Triton kernels (Triton = torch ops = plain, fp32 and bf16; the decode graph; the training
# graphs), the 130M model's one-token step and its training step with the training graphs off and on,
# then `gpn bench` of the 130M GPN+M in bf16 beside the matched Llama at 16 x 2048, the largest batch of
# {64, 32} that fits both, a profile of where a step's time goes (kernels, GPU busy fraction, HBM bandwidth),
# and last one JSON summary of every figure and target.
#
# Before a device run, once, here: `bash benchmarks/gpu_prepare.sh` (puts the wheels the device's image
# lacks into .whl/, which git ignores). Then, with the device tool:
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=420)
# Usage (repo root): bash benchmarks/gpu_check.sh
# Outputs: every stage writes into RUN (default /tmp/gpu_check_run); after each stage RUN is packed into
# $OUT/gpu_check_results.tar.gz (OUT default /tmp/gpu_out), and the summary is also $OUT/summary.json: two
# files, since the device tool brings back at most 8, and a run cut short still brings back every stage
# it finished. Unpack with `tar -xzf gpu_check_results.tar.gz`; gpu_check.log in it is the whole output.
# Every stage has its own time limit, and none runs past the budget: a stage that would gets less time or
# is skipped with a [SKIP] line, so the summary always comes back inside the device call.
# Exit status: 0 all correctness checks passed and every stage ran; 1 something failed or was skipped (each
# step says what); 2 no CUDA device: only the CPU-interpreter correctness tests ran
# (tests/test_triton_kernels.py and tests/test_training_graphs.py), so nothing about the GPU was checked.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
RUN=${RUN:-/tmp/gpu_check_run}; rm -rf "$RUN"; mkdir -p "$RUN"
exec > >(tee -a "$RUN/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
status=0
# pack what the stages wrote so far into $OUT (after every stage: a run cut short keeps what it finished)
save() { tar -czf "$OUT/gpu_check_results.tar.gz.part" -C "$RUN" . && mv "$OUT/gpu_check_results.tar.gz.part" "$OUT/gpu_check_results.tar.gz"; }

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here. Running only the CPU-interpreter correctness part"
  echo "(every Triton kernel against the torch ops, fast = plain on the Triton path) and exiting 2."
  TRITON_INTERPRET=1 python3 -m pytest -q tests/test_triton_kernels.py tests/test_training_graphs.py
  echo "gpu_check: exit 2 (no CUDA device: the GPU checks and benchmarks did not run)"
  exit 2
fi

BUDGET=${GPU_CHECK_BUDGET:-330}
deadline=$((SECONDS + BUDGET))
# stage_limit CAP RESERVE: seconds for the next stage: CAP, or less so that RESERVE seconds stay for the
# stages after it; prints 0 (and the stage is skipped) when fewer than 20 would be left
stage_limit() {
  local left=$((deadline - SECONDS - $2))
  if [ "$left" -gt "$1" ]; then left=$1; fi
  if [ "$left" -lt 20 ]; then echo 0; else echo "$left"; fi
}
skip() { echo "[SKIP] $1: not enough of the ${BUDGET} s budget left"; status=1; }

if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks (benchmarks/gpu_prepare.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 - <<'PY' || { echo "[FAIL] the transformers here is older than the project needs: run benchmarks/gpu_prepare.sh before the device run and carry .whl"; exit 1; }
import re, sys, transformers
have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
sys.exit(0 if have >= (5, 24) else 1)
PY
# the package layout without installing: modeling_gpn + its configuration presets
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r modeling_gpn /tmp/pkg/ && cp -r configuration /tmp/pkg/modeling_gpn/configuration && cp -r conversion /tmp/pkg/modeling_gpn/conversion && cp -r eval /tmp/pkg/modeling_gpn/evaluation
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
unset TRITON_INTERPRET  # compiled kernels on the GPU
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import triton; print('triton', triton.__version__)" || { echo "[FAIL] triton does not import: the fast path runs its torch ops, the Triton kernels are not checked"; status=1; }

# 1. correctness (with the training graphs) + the one-token step (about 70 s)
limit=$(stage_limit 110 200)
if [ "$limit" -gt 0 ]; then
  timeout "$limit" python3 benchmarks/gpu_check.py --decode-timing --out "$RUN" 2>&1 | tee "$RUN/correctness.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] gpu_check.py: see the lines above (limit ${limit} s)"; status=1; }
else skip "correctness"; fi
save
# 1b. the 130M training step (bf16, 16 x 256) with the training graphs off and on (about 20 s)
limit=$(stage_limit 60 180)
if [ "$limit" -gt 0 ]; then
  timeout "$limit" python3 benchmarks/gpu_check.py --training-timing --out "$RUN" 2>&1 | tee "$RUN/training_timing.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] training timing: see the lines above (limit ${limit} s)"; status=1; }
else skip "training timing"; touch "$RUN/training_timing.txt"; fi
save
# the bench uses graphs only where their checks passed: all of them (GPN_CUDA_GRAPHS=1), or those of the
# no-grad windows only (GPN_CUDA_GRAPHS=inference: generate() through the decode graph)
if grep -q "^\[ok\] cuda generate() through the captured decode graph" "$RUN/correctness.txt" 2>/dev/null; then
  export GPN_CUDA_GRAPHS=inference
  if grep -q "^\[ok\] cuda fp32 training through graphs" "$RUN/correctness.txt" && grep -q "^\[ok\] cuda bf16 training through graphs" "$RUN/correctness.txt" \
     && grep -q "^\[ok\] cuda gpn-m-1l-130m bf16 16x256 training gradients, graphs on vs off" "$RUN/training_timing.txt"; then
    export GPN_CUDA_GRAPHS=1
  fi
fi
echo "graphs in the bench: ${GPN_CUDA_GRAPHS:-off} (1: decode and training; inference: decode only)"

# 2. gpn bench at 16 x 2048 (training, forward, prefill and decode after a 4096-token prompt; about 100 s)
BENCH="env -C /tmp/pkg python3 -m modeling_gpn.cli bench --device cuda --dtype bfloat16 --preset gpn-m-1l-130m --impl fast llama --repeats 2"
limit=$(stage_limit 130 70)
if [ "$limit" -gt 0 ]; then
  timeout "$limit" $BENCH --batch 16 --seq-len 2048 --decode-prompt-lengths 4096 --decode-tokens 12 --json "$RUN/bench_16x2048.json" 2>&1 | grep -v "it/s\]" | tee "$RUN/bench_16x2048.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] bench at 16 x 2048 did not finish (limit ${limit} s, or an error above)"; status=1; }
else skip "bench at 16 x 2048"; fi
save

# 3. the largest batch of {64, 32} that fits both models (training and forward only; about 80 s)
for batch in 64 32; do
  limit=$(stage_limit 90 40)
  if [ "$limit" -eq 0 ]; then skip "bench at $batch x 2048"; break; fi
  timeout "$limit" $BENCH --batch $batch --seq-len 2048 --decode-prompt-lengths --json "$RUN/bench_large_${batch}x2048.json" 2>&1 | grep -v "it/s\]" | tee "$RUN/bench_large_${batch}x2048.txt"
  code=${PIPESTATUS[0]}
  if [ "$code" -eq 0 ]; then break; fi
  rm -f "$RUN/bench_large_${batch}x2048.json"
  if grep -q "OutOfMemoryError\|out of memory" "$RUN/bench_large_${batch}x2048.txt"; then
    echo "batch $batch does not fit: trying the next"; continue
  fi
  echo "[FAIL] bench at $batch x 2048 exited $code (limit ${limit} s; not a memory error: see above)"; status=1; break
done
save

# 4. where a step's time goes: kernels per step from torch.profiler, the GPU's busy fraction, HBM bandwidth
limit=$(stage_limit 45 5)
if [ "$limit" -gt 0 ]; then
  timeout "$limit" python3 benchmarks/gpu_check.py --profile --out "$RUN" 2>&1 | tee "$RUN/profile.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "[FAIL] profile: see the lines above (limit ${limit} s)"; status=1; }
else skip "profile"; fi

# 5. one JSON summary
python3 benchmarks/gpu_check.py --summary "$RUN" | tee "$RUN/summary.json"
cp "$RUN/summary.json" "$OUT/summary.json"
echo "gpu_check: exit $status after $SECONDS s"
save
exit $status
