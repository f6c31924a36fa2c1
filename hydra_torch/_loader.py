"""Loads the native library, refusing a torch it was not built for.

A library built against another torch fails in obscure ways (missing symbols, wrong dispatch keys), so the
mismatch is reported up front, naming both versions. Every module takes the library from here
(`from hydra_torch._loader import native as _C`), so it is checked before any of them uses it.
"""
import torch


def _release(version: str) -> str:
    # "2.13.0+cpu" and "2.13.0" are the same ABI; the local suffix names the wheel variant only.
    return version.split("+")[0]


def load():
    try:
        from hydra_torch import _C
    except ImportError as error:
        raise ImportError(
            f"hydra_torch's native library could not be loaded with torch {torch.__version__}: {error}. "
            "Rebuild it against this torch: pip install --no-build-isolation --force-reinstall ."
        ) from error
    built = _C.built_torch_version
    if _release(built) != _release(torch.__version__):
        raise ImportError(
            f"hydra_torch was built for torch {built} but torch {torch.__version__} is installed. "
            "Rebuild it against this torch: pip install --no-build-isolation --force-reinstall ."
        )
    return _C


native = load()
