"""Hyperparameters as torch.optim takes them, as the floats and ints the native code takes and a checkpoint's
manifest (JSON) records."""
from __future__ import annotations

import numbers

import torch


def real(name: str, value) -> float:
    """`value` as a float: a Python or NumPy real, or a one-element real tensor (as torch.optim takes a tensor lr).
    Raises TypeError, naming it, for anything else (a bool, a str, a tensor of several elements)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype != torch.bool \
            and not value.is_complex():
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise TypeError(f"{name} must be a real number, got {value!r}")


def integral(value):
    """`value` as a Python int where it is a whole number of another type: a NumPy integer or a one-element integer
    tensor (from np.arange, a sweep's table, a DataFrame row), as torch takes them. Anything else is returned as it
    is, for the caller's check to refuse by name: a float (2.0), a bool, NumPy's bool too."""
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)  # NumPy's integers register as numbers.Integral; its bool does not
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and not value.is_complex() and value.dtype != torch.bool:
        return int(value)
    return value


def whole(value, least: int = 0) -> bool:
    """Whether `value` is an int of at least `least`: the check behind every count an argument gives (steps, epochs,
    trials, threads), each site with its own message. A bool is not a count, though Python's bool is an int."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
