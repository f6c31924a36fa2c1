"""Builds hydra_torch._C against the installed torch.

CPU sources are always built. CUDA sources (csrc/**/cuda/) are added when this torch was built with
CUDA and a CUDA toolkit is found; HYDRA_CUDA=0|1 overrides the decision. The build prints what it
decided so a CPU-only build is never a surprise.

HYDRA_SKIP_EXTENSION=1 builds nothing: `make` uses it for an editable install that only puts this checkout
on every Python's path, then builds the extension in place, where ninja rebuilds only what changed (pip
builds an editable install's extension from scratch each time, in a fresh temporary folder).
"""
import glob
import os
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))


def _want_cuda():
    forced = os.environ.get("HYDRA_CUDA")
    if forced in ("0", "1"):
        return forced == "1", f"HYDRA_CUDA={forced}"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA"
    if CUDA_HOME is None:
        return False, "no CUDA toolkit found (CUDA_HOME unset, no nvcc)"
    return True, f"torch CUDA {torch.version.cuda}, toolkit at {CUDA_HOME}"


def _process_libstdcxx():
    """The libstdc++ this process (Python, with torch imported) has loaded, or None off Linux.

    The extension must use that one copy. A toolchain that links libstdc++ statically (some CUDA images'
    compilers do) puts a second copy inside _C.so whose locale facets are never set up: formatting a number
    into a stream there, as every TORCH_CHECK message with a number does, crashed the process. Naming the
    loaded library first on the link line resolves every libstdc++ symbol to it, whatever the compiler adds."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    except OSError:
        return None
    return next((p for p in sorted(paths) if os.path.basename(p).startswith("libstdc++.so")), None)


def _extension():
    cpu_sources = [s for s in _sources("csrc/**/*.cpp") if f"{os.sep}cuda{os.sep}" not in s]
    use_cuda, why = _want_cuda()
    print(f"hydra-torch: building {'CPU + CUDA' if use_cuda else 'CPU only'} ({why})", file=sys.stderr)
    # -fno-math-errno: sqrt that may set errno cannot be vectorised (GCC ignores it in pragmas); it changes no
    # result, unlike -ffast-math, which the exact optimizer kernels must not have.
    # -fopenmp: at::parallel_for is a header template that runs serially unless the caller's TU is built with
    # OpenMP; the extension then shares the libgomp.so.1 torch has already loaded.
    cxx = ["-O3", "-std=c++20", "-fvisibility=hidden", "-fno-math-errno", "-fopenmp", "-Wall", "-Wno-unused-function"]
    link = ["-fopenmp"]
    libstdcxx = _process_libstdcxx()
    if libstdcxx is not None:
        link.insert(0, libstdcxx)
    print(f"hydra-torch: linking against {libstdcxx or 'the compiler default libstdc++'}", file=sys.stderr)
    define_macros = [("HYDRA_TORCH_BUILT_TORCH_VERSION", f'"{torch.__version__}"')]
    if not use_cuda:
        return CppExtension("hydra_torch._C", cpu_sources, include_dirs=[os.path.join(HERE, "csrc")],
                            extra_compile_args={"cxx": cxx}, extra_link_args=link,
                            define_macros=define_macros)
    cuda_sources = _sources("csrc/**/cuda/*.cu") + _sources("csrc/**/cuda/*.cpp")
    define_macros.append(("HYDRA_WITH_CUDA", "1"))
    return CUDAExtension("hydra_torch._C", cpu_sources + cuda_sources, include_dirs=[os.path.join(HERE, "csrc")],
                         extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++20"]},
                         extra_link_args=link, define_macros=define_macros)


setup(
    ext_modules=[] if os.environ.get("HYDRA_SKIP_EXTENSION") == "1" else [_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
