#!/usr/bin/env bash
# The Triton kernels against several triton releases, one after another in one scratch venv: for each
# version, the Triton tests through the CPU interpreter (tests/fast_path/test_triton_kernels.py and
# tests/fast_path/test_training_graphs.py: every kernel = the torch ops, fast path on the kernels = the plain loop)
# and benchmarks/triton_compile_check.py (every kernel compiled for sm_90 by that release's own compiler
# and ptxas, then every launch of a 130M training step as its JIT binds it on a GPU). No GPU needed.
#
# Why: CI installs the newest triton, but a GPU machine may pin an older one (the project's lease machine:
# torch 2.11 with triton 3.6.0). A kernel or a test helper that one release rejects would otherwise only
# show on the GPU, in a scarce lease. What it proves per version: the interpreter runs every kernel to the
# torch ops' results, and the real compiler accepts every kernel and every launch the wrappers make;
# not that the compiled kernels compute the right numbers (only a GPU run can: benchmarks/gpu_check.sh).
#
# Usage (repo root or anywhere):
#     bash benchmarks/triton_versions.sh SCRATCH_VENV [VERSION ...]
# SCRATCH_VENV is made if missing (torch==2.13.0 CPU + the project with its test extras, about 2 min)
# and its triton is replaced by each VERSION in turn (default: 3.6.0, then the newest on the index:
# "newest"); the last one stays installed. Ends with one summary line per version; exit status 0 when
# every version passed both checks, 1 otherwise.
# Run time: about 3 min per version on 2 busy CPU cores (interpreter tests about 2 min, compile check
# about 40 s with a cold cache, pip about 15 s), plus the venv's first install. Not part of CI (.ci/run)
# for that reason.
set -u
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 2
fi
venv=$1; shift
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.6.0 newest)

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" || exit 1
fi
. "$venv/bin/activate"
python -c "import torch, modeling_gpn" 2>/dev/null || pip install -q torch==2.13.0 -e ".[test]" || exit 1

logs=$(mktemp -d)
summary=()
status=0
for version in "${versions[@]}"; do
  if [ "$version" = newest ]; then
    pip install -q --upgrade triton
  else
    pip install -q "triton==$version"
  fi || { summary+=("triton $version: pip install failed"); status=1; continue; }
  installed=$(python -c "import triton; print(triton.__version__)")
  log="$logs/triton-$installed"
  echo "== triton $installed (logs: $log.*)"
  # a fresh Triton cache: every kernel really compiled by this release
  export TRITON_CACHE_DIR="$log.cache"

  start=$SECONDS
  TRITON_INTERPRET=1 python -m pytest -q -p no:cacheprovider tests/fast_path/test_triton_kernels.py tests/fast_path/test_training_graphs.py \
    > "$log.tests.txt" 2>&1
  tests_code=$?
  tests_seconds=$((SECONDS - start))
  tests_line=$(grep -E "^=*.*(passed|failed|error)" "$log.tests.txt" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')

  start=$SECONDS
  python benchmarks/triton_compile_check.py --arch 90 > "$log.compile.txt" 2>&1
  compile_code=$?
  compile_seconds=$((SECONDS - start))
  variants=$(grep -oE "[0-9]+ of [0-9]+ kernel variants" "$log.compile.txt" | tail -1 | sed 's/ kernel variants//')
  launches=$(grep -oE "[0-9]+ of [0-9]+ distinct launches" "$log.compile.txt" | tail -1 | sed 's/ distinct launches//')
  spilling=$(grep "\[SPILLS\]" "$log.compile.txt" | sed -E 's/^\[ok\] //; s/: [0-9.]+ s,.*//' | paste -sd ';' -)

  line="triton $installed: interpreter tests ${tests_line:-none ran} (exit $tests_code, ${tests_seconds} s);"
  line+=" sm_90 compile: ${variants:-?} kernel variants, ${launches:-?} distinct step launches (exit $compile_code, ${compile_seconds} s);"
  line+=" spills: ${spilling:-none}"
  summary+=("$line")
  [ "$tests_code" -eq 0 ] && [ "$compile_code" -eq 0 ] || status=1
  [ "$tests_code" -eq 0 ] || tail -30 "$log.tests.txt"
  [ "$compile_code" -eq 0 ] || grep -E "FAIL|Error" "$log.compile.txt" | head -20
done

echo "== summary (logs in $logs)"
printf '%s\n' "${summary[@]}"
exit $status
