#!/usr/bin/env bash
# The GPU machine's one script: build from source there, run the test suite (the CUDA tests run instead of
# skipping), run the benchmarks, and leave logs under the folder given as $1 (default: benchmarks/out).
#   bash benchmarks/device_check.sh "$OUT"
set -uo pipefail
out=${1:-benchmarks/out}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
  2>&1 | tee "$out/machine.txt"
python3 setup.py -q build_ext --inplace 2>&1 | tail -n 20 | tee "$out/build.log" || exit 1
python3 -m pytest -q tests 2>&1 | tee "$out/pytest.log"
python3 benchmarks/bench_optimizers.py 2>&1 | tee "$out/bench_optimizers.log"
python3 benchmarks/bench_training.py 2>&1 | tee "$out/bench_training.log"
