#!/usr/bin/env bash
# Run on the CPU machine (it reaches PyPI; the GPU box does not). Puts into .whl/ the wheels the GPU suite's
# DeepSpeed baseline needs on the GPU box (Python 3.12, manylinux x86_64, torch 2.11+cu130 already there):
#   - DeepSpeed itself, built here as a pure-Python wheel: DS_BUILD_OPS=0 compiles no op now; its CPU Adam
#     is JIT-compiled with ninja on the GPU box at first use (about a minute with MAX_JOBS=16).
#   - DeepSpeed's Requires-Dist that the GPU box lacks. torch, numpy, packaging and tqdm come with torch and
#     transformers there and are not fetched (a second numpy would shadow the one torch was built against).
# benchmarks/device_check.sh installs them with pip --no-index --no-deps --target /tmp/site.
#   bash benchmarks/fetch_gpu_wheels.sh        # then carry .whl/ to the GPU box (it is git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
# Versions pinned here are the ones recorded in benchmarks/RESULTS.md.
DEEPSPEED=0.19.8
PURE=(hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 annotated-types==0.7.0 typing-inspection==0.4.2
      typing-extensions==4.16.0 pydantic==2.13.4 nvidia-ml-py==13.615.71)
# Compiled wheels for CPython 3.12 on manylinux x86_64 (the GPU box), not for this machine's Python.
BINARY=(pydantic-core==2.46.4 msgpack==1.2.4 psutil==7.2.2 ninja==1.13.2)
rm -rf "$dest" && mkdir -p "$dest"

python3 -m pip --version >/dev/null
python3 -c 'import torch, setuptools, wheel' 2>/dev/null || python3 -m pip install -q setuptools wheel
# DeepSpeed's setup.py imports torch (present here, CPU build); no build isolation so it sees it. With
# DS_BUILD_OPS=0 nothing is compiled, so the wheel is py3-none-any and loads on any torch >= 2.0.
DS_BUILD_OPS=0 python3 -m pip wheel -q "deepspeed==$DEEPSPEED" --no-deps --no-build-isolation -w "$dest"

common=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        -d "$dest")
python3 -m pip download -q "${common[@]}" "${PURE[@]}" "${BINARY[@]}"

ls -la "$dest"
du -sh "$dest"
python3 - "$dest" <<'EOF'
import pathlib, sys
files = sorted(pathlib.Path(sys.argv[1]).glob("*.whl"))
total = sum(f.stat().st_size for f in files)
assert any(f.name.startswith("deepspeed-") and f.name.endswith("-none-any.whl") for f in files), "no pure DeepSpeed wheel"
assert total < 60 * 2**20, f"{total / 2**20:.1f} MiB: over the 60 MiB the GPU box's carry allows"
print(f"{len(files)} wheels, {total / 2**20:.1f} MiB")
EOF
