#!/usr/bin/env bash
# The end-of-run hang hunt of issue 23: 2-process `gpn train` launches on CPU in a loop, DDP (--multi_gpu)
# and FSDP2 (--use_fsdp --fsdp_version 2) in turn; a run that exceeds BOUND seconds has every process's
# stack dumped (py-spy --native where installed, then Python's faulthandler through SIGABRT) and is killed.
#
# Usage: bash benchmarks/multiprocess_loop.sh OUT_DIR [RUNS=100] [BOUND_S=150]
#   with the project's venv active and GPN_SHARED_DIR set (default ../shared); OUT_DIR/summary.txt gets one
#   line per run ("i kind rc=... seconds", "HANG ..." for a run past its bound) and DONE at the end.
set -u
OUT=${1:?usage: multiprocess_loop.sh OUT_DIR [RUNS] [BOUND_S]}; RUNS=${2:-100}; BOUND=${3:-150}
SHARED=${GPN_SHARED_DIR:-$(cd "$(dirname "$0")/../.." && pwd)/shared}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false PYTHONFAULTHANDLER=1 ACCELERATE_USE_CPU=1
SMALL=(--recipe tiny-cpu --dataset "$SHARED/data/tinyshakespeare/input.txt" --bpe-vocab-size 512 --seq-len 32 --batch-size 8
       --micro-batch-size 4 --eval-windows 8 --log-interval 1 --eval-interval 0 --checkpoint-interval 0 --sample-tokens 8
       --num-threads 1 --cache-dir "$OUT/cache" --no-progress --steps 6)
mkdir -p "$OUT"
for i in $(seq 1 "$RUNS"); do
  if (( i % 2 )); then kind=ddp; dist=(--multi_gpu); else kind=fsdp; dist=(--use_fsdp --fsdp_version 2); fi
  run=$OUT/run-$i-$kind; rm -rf "$run"
  start=$(date +%s.%N)
  setsid accelerate launch "${dist[@]}" --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
      --main_process_port $((20000 + RANDOM % 20000)) -m modeling_gpn.train "${SMALL[@]}" --output-dir "$run" \
      > "$run.log" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    sleep 0.5
    if (( $(echo "$(date +%s.%N) - $start > $BOUND" | bc) )); then
      echo "HANG run $i ($kind) after $BOUND s" >> "$OUT/summary.txt"
      if command -v py-spy >/dev/null; then
        for p in $(pgrep -s $pid); do py-spy dump --native --pid "$p" >> "$run.stacks" 2>&1; done
      fi
      ps -o pid,ppid,stat,etime,cmd -s $pid >> "$run.stacks"
      kill -ABRT -- -$pid; sleep 10; kill -KILL -- -$pid 2>/dev/null
      break
    fi
  done
  wait $pid; rc=$?
  printf "%d %s rc=%d %.1fs\n" "$i" "$kind" "$rc" "$(echo "$(date +%s.%N) - $start" | bc)" >> "$OUT/summary.txt"
done
echo DONE >> "$OUT/summary.txt"
