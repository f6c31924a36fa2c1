"""Hyperparameters as torch.optim takes them, as the floats the native step takes and a checkpoint's manifest
(JSON) records."""
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
