#!/usr/bin/env bash
# Before a device run (benchmarks/gpu_check.sh), once, here: download the wheels the GPU machine's image
# lacks into .whl/ (which .gitignore ignores), for its Python 3.12 on x86-64 Linux.
#
# The image (see /work/.library/device/KINDS.md) has torch 2.11, triton 3.6 and transformers 5.17; the
# project needs transformers >= 5.24 (pyproject.toml). We send the versions this checkout's tests pass
# with (read from the active environment), and regex, which transformers 5.24 checks at import
# (>= 2025.10.22) and whose version on the image is not recorded. Nothing can be fetched on the device,
# so gpu_check.sh installs every .whl/*.whl there (--no-deps, into /tmp/site) and refuses to run the
# benchmarks on an older transformers.
#
# Usage (repo root, with the project's venv active):  bash benchmarks/gpu_prepare.sh
# then:  run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=300)
set -euo pipefail
cd "$(dirname "$0")/.."
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
wanted=("transformers==$(version transformers)" "regex==$(version regex)")
rm -rf .whl && mkdir -p .whl
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl "${wanted[@]}"
ls -l .whl
du -sh .whl
echo "gpu_prepare: .whl/ holds ${wanted[*]}; carry \".whl\" in the device run"
