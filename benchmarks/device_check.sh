#!/usr/bin/env bash
# The GPU machine's one script: build from source there, run the GPU tests, run the GPU suite (P1, P2) and
# leave logs and JSON under the folder given as $1 (default: benchmarks/out). About 9 minutes in all:
# build ~2 min, tests ~1 min, suite SUITE_BUDGET_S (default 330 s) plus its imports and model building.
#   bash benchmarks/device_check.sh "$OUT"              # SUITE_ARGS="--p3" adds P3 (give it more time)
# DeepSpeed is not installed on the GPU box: benchmarks/fetch_gpu_wheels.sh puts it and its dependencies in
# .whl/ on a machine with PyPI; carry .whl/ along and they are installed into /tmp/site here.
set -uo pipefail
mkdir -p "${1:-benchmarks/out}"
out=$(cd "${1:-benchmarks/out}" && pwd)   # absolute: the cd below must not move it
cd "$(dirname "$0")/.."
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
{ nvidia-smi -L; free -g | head -2; nproc
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } 2>&1 | tee "$out/machine.txt"

# setup.py run directly builds against the installed torch: the --no-build-isolation semantics.
python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1
status=$?
tail -n 20 "$out/build.log"
[ $status -eq 0 ] || { echo "build failed (exit $status): $out/build.log"; exit 1; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tee "$out/wheels.log"
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  # DeepSpeed's CPU Adam is compiled with ninja at first use; build it now, beside the tests, so the suite's
  # DeepSpeed time is training, not compiling. A failure here shows again, recorded, in the suite.
  (timeout 300 python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print("cpu_adam built")' \
     > "$out/deepspeed_cpu_adam_build.log" 2>&1) &
  ds_build=$!
else
  echo "no .whl/: the DeepSpeed baseline will record itself as not importable" | tee "$out/wheels.log"
  ds_build=
fi

timeout 240 python3 -m pytest tests/test_cuda.py tests/test_optimizer_ops.py -q 2>&1 | tee "$out/pytest.log"
tests=${PIPESTATUS[0]}
if [ -n "$ds_build" ]; then wait "$ds_build"; tail -n 3 "$out/deepspeed_cpu_adam_build.log"; fi

timeout $(( ${SUITE_BUDGET_S:-330} + 150 )) python3 benchmarks/gpu_suite.py --out "$out/suite" \
  --budget-s "${SUITE_BUDGET_S:-330}" ${SUITE_ARGS:-} 2>&1 | tee "$out/gpu_suite.log"
suite=${PIPESTATUS[0]}
echo "tests exit $tests, suite exit $suite; results in $out"
[ "$tests" -eq 0 ] && [ "$suite" -eq 0 ]
