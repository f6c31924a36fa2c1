"""Compiles every CUDA source with nvcc, without linking, so CUDA code is checked on machines
with no GPU and a CPU-only torch (whose wheel still ships the ATen/c10 CUDA headers).

Exit status is non-zero if any source fails. With no nvcc on PATH this says so; under CI (CI set) that is a
failure, since CUDA sources that are never compiled rot; elsewhere the check is skipped.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import torch
from torch.utils.cpp_extension import include_paths

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None)
    if nvcc is None or not os.path.exists(nvcc):
        print("compile_cuda: nvcc not found; CUDA sources cannot be checked", file=sys.stderr)
        return 1 if os.environ.get("CI") else 0
    sources = sorted(glob.glob(os.path.join(HERE, "csrc", "**", "cuda", "*.cu"), recursive=True)
                     + glob.glob(os.path.join(HERE, "csrc", "**", "cuda", "*.cpp"), recursive=True))
    includes = [os.path.join(HERE, "csrc"), sysconfig.get_paths()["include"], *include_paths()]
    failed = 0
    with tempfile.TemporaryDirectory() as out:
        for source in sources:
            obj = os.path.join(out, os.path.basename(source) + ".o")
            cmd = [nvcc, "-c", source, "-o", obj, "-std=c++20", "-O2", "-arch=sm_90", "-x", "cu",
                   "-DHYDRA_WITH_CUDA=1", "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI))]
            cmd += [f"-I{path}" for path in includes]
            result = subprocess.run(cmd, capture_output=True, text=True)
            status = "ok" if result.returncode == 0 else "FAILED"
            print(f"compile_cuda: {os.path.relpath(source, HERE)}: {status}")
            if result.returncode != 0:
                failed += 1
                print(result.stdout + result.stderr, file=sys.stderr)
    print(f"compile_cuda: {len(sources) - failed} of {len(sources)} CUDA sources compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
