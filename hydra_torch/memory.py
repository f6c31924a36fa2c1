"""Memory budgets: bytes, strings with a unit, or a fraction of the device's free memory."""
from __future__ import annotations

import os
import re

import torch

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation could get on `device` now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    raise ValueError(f"no free-memory query for device type {device.type!r}")


def parse_budget(budget, device: torch.device) -> int:
    """Bytes for `budget`: an int (bytes), a string like "8GiB" or "512MB", or a fraction in (0, 1] of the
    device's free memory (a float, or a string like "0.8" or "80%"). None means 90% of free memory."""
    if budget is None:
        return int(0.9 * free_bytes(device))
    if isinstance(budget, bool):
        raise TypeError(f"memory_budget must be bytes, a string with a unit, or a fraction; got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ValueError(f"memory_budget must be positive, got {budget}")
        return budget
    if isinstance(budget, float):
        return _fraction(budget, device)
    if isinstance(budget, str):
        text = budget.strip()
        if text.endswith("%"):
            return _fraction(float(text[:-1]) / 100.0, device)
        match = _PATTERN.match(text)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read memory_budget {budget!r}: use bytes, a unit such as '8GiB' or '512MB', "
                             "or a fraction of free memory such as '0.8' or '80%'")
        value, unit = float(match.group(1)), match.group(2).lower()
        if unit == "" and value <= 1.0:
            return _fraction(value, device)
        if unit in ("", "b") and value != int(value):
            raise ValueError(f"memory_budget {budget!r} is a fractional number of bytes")
        bytes_ = int(value * _UNITS[unit])
        if bytes_ <= 0:
            raise ValueError(f"memory_budget must be positive, got {budget!r}")
        return bytes_
    raise TypeError(f"memory_budget must be bytes, a string with a unit, or a fraction; got {type(budget).__name__}")


def _fraction(fraction: float, device: torch.device) -> int:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a memory_budget fraction must be in (0, 1], got {fraction}")
    return int(fraction * free_bytes(device))


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
