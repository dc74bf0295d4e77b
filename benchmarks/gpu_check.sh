#!/usr/bin/env bash
# One short device run: CUDA correctness of the fast path, then `gpn bench` of the 130M GPN+M in bf16
# beside a matched Llama. Usage on the device machine (repo root): bash benchmarks/gpu_check.sh
# Needs the transformers wheel the project pins in .whl/ (the image's transformers is older).
set -u
OUT=${OUT:-/tmp/gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if ls .whl/transformers-5.24*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/transformers-5.24*.whl && export PYTHONPATH=/tmp/site
fi
# the package layout without installing: modeling_gpn + its configuration presets
rm -rf /tmp/pkg && mkdir -p /tmp/pkg && cp -r modeling_gpn /tmp/pkg/ && cp -r configuration /tmp/pkg/modeling_gpn/configuration && cp -r conversion /tmp/pkg/modeling_gpn/conversion && cp -r eval /tmp/pkg/modeling_gpn/evaluation
export PYTHONPATH=/tmp/pkg:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
[ -n "${SKIP_CHECK:-}" ] || timeout 90 python3 benchmarks/gpu_check.py 2>&1 | tee "$OUT/correctness.txt"
BENCH="env -C /tmp/pkg python3 -m modeling_gpn.cli bench --device cuda --dtype bfloat16 --preset gpn-m-1l-130m --impl fast llama --repeats 2"
timeout 170 $BENCH --batch 16 --seq-len 512 --decode-prompt-lengths 128 1024 4096 --decode-tokens 12 --json "$OUT/bench_512.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_512.txt"
timeout 110 $BENCH --batch 16 --seq-len 2048 --memory-seq-lens 256 --decode-prompt-lengths 16384 --decode-tokens 12 --json "$OUT/bench_2048.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_2048.txt"
