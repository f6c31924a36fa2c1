"""Facilities for tests and benchmarks, not for training.

`emulated_link(bytes_per_second)`: inside it, runs on CPU devices copy weights in and gradients out at the
pace of a host link of that bandwidth (say PCIe at 25e9), on the same asynchronous path a GPU takes, so a
machine without a GPU can test and measure how well copies are hidden behind compute.
"""
from __future__ import annotations

import math
from contextlib import contextmanager

_link_bytes_per_second = 0.0


def link_bytes_per_second() -> float:
    """The emulated link's bandwidth for CPU devices; 0 when copies run at memory speed."""
    return _link_bytes_per_second


@contextmanager
def emulated_link(bytes_per_second: float):
    global _link_bytes_per_second
    if isinstance(bytes_per_second, bool) or not isinstance(bytes_per_second, (int, float)) \
            or not math.isfinite(bytes_per_second) or bytes_per_second <= 0:
        raise ValueError(f"emulated_link: bytes_per_second must be a positive number, got {bytes_per_second!r}")
    previous, _link_bytes_per_second = _link_bytes_per_second, float(bytes_per_second)
    try:
        yield
    finally:
        _link_bytes_per_second = previous
