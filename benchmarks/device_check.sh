#!/usr/bin/env bash
# The GPU machine's one script: a preflight (versions, ninja, a build forced to include CUDA, the CUDA kernel
# registered), the GPU tests, then the GPU suite (P2, P1 with its profile, the stream stress), leaving logs and
# JSON under the folder given as $1 (default: benchmarks/out): setup.log, build.log, pytest.log, host_adamw.log,
# gpu_suite.log, suite/gpu_suite.json, suite/gpu_suite.md and suite/runs.jsonl (a line per suite run, as it
# ends, so a run cut short keeps what it measured). About 8 minutes in all: build ~1.5 min, tests ~1 min, the
# host AdamW under 1 min, suite SUITE_BUDGET_S (default 270 s; the suite ends within it).
#   bash benchmarks/device_check.sh "$OUT"              # SUITE_ARGS="--p3" adds P3 (give it more time)
#   SUITE_ARGS="--phases p2" bash benchmarks/device_check.sh "$OUT"   # one phase
# DeepSpeed is not installed on the GPU box: benchmarks/fetch_gpu_wheels.sh puts it and its dependencies in
# .whl/ on a machine with PyPI; carry .whl/ along and they are installed into /tmp/site here.
set -uo pipefail
mkdir -p "${1:-benchmarks/out}"
out=$(cd "${1:-benchmarks/out}" && pwd)   # absolute: the cd below must not move it
cd "$(dirname "$0")/.."
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
# An in-place build is not an install: every Python process here (the suite's too) imports this checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
setup="$out/setup.log"
# Preflight: what would make the next 8 minutes worthless is found in the first one.
fail() { echo "preflight failed: $*" | tee -a "$setup"; exit 1; }
{ date -u; git log -1 --format='commit %H %s' 2>/dev/null; nvidia-smi -L; free -g | head -2; nproc
  grep -m1 'model name' /proc/cpuinfo; grep -o -m1 'avx512f' /proc/cpuinfo
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda",
torch.version.cuda, "devices", torch.cuda.device_count())'
  for p in transformers pytest tqdm ninja nvidia-ml-py deepspeed; do
    python3 -c "import importlib.metadata as m, sys; print('$p', m.version('$p'))" 2>/dev/null || echo "$p absent"
  done
  echo "ninja on PATH: $(command -v ninja || echo no)"; } > "$setup" 2>&1
cat "$setup"
command -v ninja > /dev/null || fail "ninja is not on PATH: the build would compile one file at a time"
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() and torch.version.cuda else 1)' \
  || fail "this torch sees no CUDA device"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$setup" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
  deepspeed=1
else
  echo "no .whl/: the DeepSpeed baselines will record themselves as not importable" | tee -a "$setup"
  deepspeed=
fi

# setup.py run directly builds against the installed torch: the --no-build-isolation semantics. HYDRA_CUDA=1
# makes a build that would quietly leave CUDA out (no toolkit found) fail instead.
start=$SECONDS
HYDRA_CUDA=1 timeout 400 python3 setup.py -q build_ext --inplace > "$out/build.log" 2>&1
status=$?
echo "build: exit $status in $((SECONDS - start)) s" | tee -a "$out/build.log"
tail -n 5 "$out/build.log"
[ $status -eq 0 ] || fail "build exit $status: $out/build.log"
python3 -c 'import torch, hydra_torch, sys
sys.exit(0 if torch._C._dispatch_has_kernel_for_dispatch_key("hydra::adam_step", "CUDA") else 1)' >> "$setup" 2>&1 \
  || fail "the built extension registers no CUDA kernel for hydra::adam_step"
echo "preflight: ok (hydra::adam_step has a CUDA kernel)" | tee -a "$setup"

ds_build=
if [ -n "$deepspeed" ]; then
  # DeepSpeed's CPU Adam is compiled with ninja at first use; build it now, beside the tests (not beside
  # hydra's own build, which takes every core), so the suite's DeepSpeed time is training, not compiling. A
  # failure here shows again, recorded, in the suite.
  (timeout 300 python3 -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print("cpu_adam built")' \
     > /tmp/deepspeed_cpu_adam_build.log 2>&1) &
  ds_build=$!
fi

# A native crash in a test is reported with its native frames (tools/segv_backtrace.c), resolved to source
# lines here, where the crashed libraries are. The argument-check tests run alone first (is a crash there
# independent of the CUDA tests before it?); then every GPU test, under xdist where pytest-xdist is importable
# (a crash then fails one test instead of ending the run).
log="$out/pytest.log"
preload=/tmp/segv_backtrace.so
cc=$(command -v gcc || command -v cc || echo /opt/gcc/bin/gcc)
"$cc" -shared -fPIC -O1 -o "$preload" tools/segv_backtrace.c > "$log" 2>&1
echo "== argument checks alone" >> "$log"
LD_PRELOAD=$preload timeout 120 python3 -m pytest -p no:faulthandler -p no:cacheprovider --capture=sys -q \
  tests/test_optimizer_ops.py -k rejects >> "$log" 2>&1
echo "exit $?" >> "$log"
echo "== the budget test alone (the first CUDA user in its process)" >> "$log"
LD_PRELOAD=$preload timeout 120 python3 -m pytest -p no:faulthandler -p no:cacheprovider --capture=sys -q \
  "tests/test_cuda.py::test_cuda_allocations_stay_within_budget" >> "$log" 2>&1
alone=$?
echo "exit $alone" >> "$log"
echo "== GPU tests" >> "$log"
xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 2")
LD_PRELOAD=$preload timeout 300 python3 -m pytest -p no:faulthandler -p no:cacheprovider --capture=sys -q $xdist -rfE \
  tests/test_cuda.py tests/test_cuda_allocator.py tests/test_optimizer_ops.py >> "$log" 2>&1
tests=$?
echo "exit $tests" >> "$log"
[ "$alone" -eq 0 ] || tests=$alone
grep -v "^hydra-segv" "$log" | tail -n 25
if grep -q "^hydra-segv" "$log"; then
  echo "== native frames of the crashes above" >> "$log"
  python3 tools/resolve_frames.py "$log" > /tmp/frames.txt 2>&1
  cat /tmp/frames.txt >> "$log"
  head -n 60 /tmp/frames.txt
fi
if [ -n "$ds_build" ]; then wait "$ds_build"; tail -n 3 /tmp/deepspeed_cpu_adam_build.log | tee -a "$setup"; fi

# The host AdamW's bytes/s against the host's copy bandwidth with 1, 2, 4 threads and every core (under a minute):
# the host lane's rate, and how many cores the host-step pool needs to reach it.
timeout 90 python3 benchmarks/bench_optimizers.py --sizes 50e6 --rounds 5 --threads 1 2 4 0 > "$out/host_adamw.log" 2>&1
echo "host AdamW: exit $? ($out/host_adamw.log)"; grep -E "hydra adam_step \||copy_" "$out/host_adamw.log"

# The suite ends within its time box; the outer limit only covers its own start and a wedged process.
timeout $(( ${SUITE_BUDGET_S:-270} + 30 )) python3 benchmarks/gpu_suite.py --out "$out/suite" \
  --budget-s "${SUITE_BUDGET_S:-270}" ${SUITE_ARGS:-} 2>&1 | tee "$out/gpu_suite.log"
suite=${PIPESTATUS[0]}
echo "tests exit $tests, suite exit $suite; results in $out"
[ "$tests" -eq 0 ] && [ "$suite" -eq 0 ]
