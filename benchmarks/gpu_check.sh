#!/usr/bin/env bash
# One short device run (at most GPU_CHECK_BUDGET seconds of stages, default 240, on one H100 or H200): first the
# kernels' self-checks at every size the timings use (which also compiles them), then CUDA correctness of the
# fast path and its Triton kernels (Triton = torch ops = plain, fp32 and bf16; the decode graph; the training
# graphs), the 130M model's one-token step and its training step with the training graphs off and on,
# then `gpn bench` of the 130M GPN+M in bf16 beside the matched Llama at 16 x 2048, the largest batch of
# {64, 32} that fits both, a profile of where a step's time goes (kernels, GPU busy fraction, HBM bandwidth),
# and last one JSON summary of every figure and target.
#
# Before a device run, once, here: `bash benchmarks/gpu_prepare.sh` (puts the wheels the device's image
# lacks into .whl/, which git ignores). Then, with the device tool:
#     run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=300)
# Usage (repo root): bash benchmarks/gpu_check.sh
# Outputs: every stage writes into RUN (default /tmp/gpu_check_run); after each stage RUN is packed into
# $OUT/gpu_check_results.tar.gz (OUT default /tmp/gpu_out), and the summary is also $OUT/summary.json: two
# files, since the device tool brings back at most 8, and a run cut short still brings back every stage
# it finished. Unpack with `tar -xzf gpu_check_results.tar.gz`; gpu_check.log in it is the whole output.
# Every stage has its own time limit, and none runs past the budget: a stage that would gets less time or
# is skipped with a [SKIP] line, so the summary always comes back inside the device call.
# Exit status: 0 all correctness checks passed and every stage ran; 1 something failed or was skipped (each
# step says what); 2 no CUDA device: only the CPU-interpreter correctness tests ran
# (tests/fast_path/test_triton_kernels.py and tests/fast_path/test_training_graphs.py), so nothing about the GPU was checked.
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
  TRITON_INTERPRET=1 python3 -m pytest -q tests/fast_path/test_triton_kernels.py tests/fast_path/test_training_graphs.py
  echo "gpu_check: exit 2 (no CUDA device: the GPU checks and benchmarks did not run)"
  exit 2
fi

# The budget: 240 s from here to the summary (the wheels' install and every stage), inside a device call
# of 300 s (timeout_s=300): 60 s of margin for what comes after (packing) and for a slow start. Per stage,
# its cap (it never gets more; less when the stages after it need their reserve). The caps are estimates
# (the CPU dry run, the launch counts, cold compiles of ~40 kernel variants at 1-2 s each), not yet
# measured on a GPU: the [stage] lines' timestamps and stages.tsv will say.
#   0  self-checks at the 130M sizes + compiling every kernel variant (cold Triton cache, which
#      the later stages' processes then load instead of compiling)                              cap 45
#   1  correctness (tiny models, fp32 and bf16, decode and training graphs) + decode timing    cap 60
#   1b the 130M training step 16 x 256, graphs off and on                                       cap 35
#   2  gpn bench 16 x 2048 (training, forward, prefill and decode @4096)                        cap 65
#   3  the largest batch of {64, 32} (training and forward): what is left, skipped under 20 s   cap 40
#   4  profile: kernels per step, GPU busy fraction, HBM bandwidth                              cap 20
# A stage past its cap is stopped (exit 124) and the summary's "notes" say so, and what it changed for the
# stages after it (the bench's graphs setting is read from stages 1 and 1b's results).
BUDGET=${GPU_CHECK_BUDGET:-240}
deadline=$((SECONDS + BUDGET))
# stage_limit CAP RESERVE: seconds for the next stage: CAP, or less so that RESERVE seconds stay for the
# stages after it; prints 0 (and the stage is skipped) when fewer than 20 would be left
stage_limit() {
  local left=$((deadline - SECONDS - $2))
  if [ "$left" -gt "$1" ]; then left=$1; fi
  if [ "$left" -lt 20 ]; then echo 0; else echo "$left"; fi
}
# stage NAME LIMIT OUTPUT COMMAND...: run COMMAND under `timeout LIMIT` (its output also into RUN/OUTPUT),
# with its start time and duration printed and appended to RUN/stages.tsv; sets $code
stage() {
  local name=$1 limit=$2 output=$3 began=$SECONDS start
  shift 3
  start=$(date -u +%H:%M:%S)
  echo "[stage] $name: start $start, limit $limit s (+${SECONDS} s into the run)"
  timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "it/s\]" | tee "$RUN/$output"
  code=${PIPESTATUS[0]}
  echo "[stage] $name: exit $code after $((SECONDS - began)) s (limit $limit s)$([ "$code" -eq 124 ] && echo ': TIMED OUT')"
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$start" "$((SECONDS - began))" "$limit" "$code" >> "$RUN/stages.tsv"
}
skip() { echo "[SKIP] $1: not enough of the ${BUDGET} s budget left"; printf '%s\t%s\t0\t0\t-1\n' "$1" "$(date -u +%H:%M:%S)" >> "$RUN/stages.tsv"; status=1; }

if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks (benchmarks/gpu_prepare.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 - <<'PY' || { echo "[FAIL] the transformers here is older than the project needs: run benchmarks/gpu_prepare.sh before the device run and carry .whl"; exit 1; }
import re, sys, transformers
have = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
sys.exit(0 if have >= (5, 24) else 1)
PY
# the package layout without installing: modeling_gpn + its configuration presets
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r modeling_gpn gpn_cli /tmp/pkg/ && cp -r configuration /tmp/pkg/modeling_gpn/configuration && cp -r conversion /tmp/pkg/modeling_gpn/conversion && cp -r eval /tmp/pkg/modeling_gpn/evaluation
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
unset TRITON_INTERPRET  # compiled kernels on the GPU
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import triton; print('triton', triton.__version__)" || { echo "[FAIL] triton does not import: the fast path runs its torch ops, the Triton kernels are not checked"; status=1; }

# 0. the kernels' self-checks at every size the timings use, before any timing (and the cold compiles)
limit=$(stage_limit 45 170)
if [ "$limit" -gt 0 ]; then
  stage "self-checks" "$limit" self_checks.txt python3 benchmarks/gpu_check.py --self-checks --out "$RUN"
  [ "$code" -eq 0 ] || { echo "[FAIL] self-checks: see the lines above (the kernels are off where one failed)"; status=1; }
else skip "self-checks"; fi
save
# 1. correctness (with the training graphs) + the one-token step
limit=$(stage_limit 60 115)
if [ "$limit" -gt 0 ]; then
  stage "correctness + decode timing" "$limit" correctness.txt python3 benchmarks/gpu_check.py --decode-timing --out "$RUN"
  [ "$code" -eq 0 ] || { echo "[FAIL] gpu_check.py: see the lines above (limit ${limit} s)"; status=1; }
else skip "correctness"; fi
save
# 1b. the 130M training step (bf16, 16 x 256) with the training graphs off and on
limit=$(stage_limit 35 80)
if [ "$limit" -gt 0 ]; then
  stage "training timing" "$limit" training_timing.txt python3 benchmarks/gpu_check.py --training-timing --out "$RUN"
  [ "$code" -eq 0 ] || { echo "[FAIL] training timing: see the lines above (limit ${limit} s)"; status=1; }
else skip "training timing"; touch "$RUN/training_timing.txt"; fi
save
# the bench uses graphs only where their checks passed: all of them (GPN_CUDA_GRAPHS=1), or those of the
# no-grad windows only (GPN_CUDA_GRAPHS=inference: generate() through the decode graph); why goes to the summary
graphs_why="stage 1 did not report the decode graph's check as ok (failed, or cut short by its limit: see stages)"
if grep -q "^\[ok\] cuda generate() through the captured decode graph" "$RUN/correctness.txt" 2>/dev/null; then
  export GPN_CUDA_GRAPHS=inference
  graphs_why="the training graphs' checks (stage 1 fp32 and bf16, stage 1b 130M) did not all report ok (failed, or cut short: see stages)"
  if grep -q "^\[ok\] cuda fp32 training through graphs" "$RUN/correctness.txt" && grep -q "^\[ok\] cuda bf16 training through graphs" "$RUN/correctness.txt" \
     && grep -q "^\[ok\] cuda gpn-m-1l-130m bf16 16x256 training gradients, graphs on vs off" "$RUN/training_timing.txt"; then
    export GPN_CUDA_GRAPHS=1
    graphs_why="every graph check passed"
  fi
fi
echo "graphs in the bench: ${GPN_CUDA_GRAPHS:-off} (1: decode and training; inference: decode only): $graphs_why"
printf '{"setting": "%s", "why": "%s"}\n' "${GPN_CUDA_GRAPHS:-off}" "$graphs_why" > "$RUN/graphs_in_bench.json"

# 2. gpn bench at 16 x 2048 (training, forward, prefill and decode after a 4096-token prompt)
BENCH="env -C /tmp/pkg python3 -m gpn_cli bench --device cuda --dtype bfloat16 --preset gpn-m-1l-130m --impl fast llama --repeats 2"
limit=$(stage_limit 65 20)
if [ "$limit" -gt 0 ]; then
  stage "bench 16x2048" "$limit" bench_16x2048.txt $BENCH --batch 16 --seq-len 2048 --decode-prompt-lengths 4096 --decode-tokens 12 --json "$RUN/bench_16x2048.json"
  [ "$code" -eq 0 ] || { echo "[FAIL] bench at 16 x 2048 did not finish (limit ${limit} s, or an error above)"; status=1; }
else skip "bench 16x2048"; fi
save

# 3. the largest batch of {64, 32} that fits both models (training and forward only): what the budget leaves
for batch in 64 32; do
  limit=$(stage_limit 40 20)
  if [ "$limit" -eq 0 ]; then skip "bench ${batch}x2048"; break; fi
  stage "bench ${batch}x2048" "$limit" "bench_large_${batch}x2048.txt" $BENCH --batch $batch --seq-len 2048 --decode-prompt-lengths --json "$RUN/bench_large_${batch}x2048.json"
  if [ "$code" -eq 0 ]; then break; fi
  rm -f "$RUN/bench_large_${batch}x2048.json"
  if grep -q "OutOfMemoryError\|out of memory" "$RUN/bench_large_${batch}x2048.txt"; then
    echo "batch $batch does not fit: trying the next"; continue
  fi
  echo "[FAIL] bench at $batch x 2048 exited $code (limit ${limit} s; not a memory error: see above)"; status=1; break
done
save

# 4. where a step's time goes: kernels per step from torch.profiler, the GPU's busy fraction, HBM bandwidth
limit=$(stage_limit 20 5)
if [ "$limit" -gt 0 ]; then
  stage "profile" "$limit" profile.txt python3 benchmarks/gpu_check.py --profile --out "$RUN"
  [ "$code" -eq 0 ] || { echo "[FAIL] profile: see the lines above (limit ${limit} s)"; status=1; }
else skip "profile"; fi

# 5. one JSON summary
python3 benchmarks/gpu_check.py --summary "$RUN" | tee "$RUN/summary.json"
cp "$RUN/summary.json" "$OUT/summary.json"
echo "gpu_check: exit $status after $SECONDS s"
save
exit $status
