"""Facilities for tests and benchmarks, not for training.

`emulated_link(bytes_per_second)`: inside it, runs on CPU devices copy weights in and gradients out at the
pace of a host link of that bandwidth (say PCIe at 25e9), on the same asynchronous path a GPU takes, so a
machine without a GPU can test and measure how well copies are hidden behind compute.

`emulated_host(bytes_per_second)`: inside it, the host optimizer steps of a run (on any device) share a host
memory bandwidth of that rate: a step that touches B bytes of host memory (gradient, fp32 master and optimizer
states read, master, states and bf16 shadow written) holds the host's memory lane for B / rate seconds, one step
after another, as on a machine whose memory is that fast (say 90e9), so the host lane that bounds a GPU box can
be tested and measured on a machine whose memory is faster or slower.

Inside either, a CPU device's memory counts as a device's own: the budget keeps room beside the arena for the
activations of tasks cut by hand too (hydra_torch.run.measuring, whose `kept_beside_arena(tasks)` says how much,
for sizing a budget by the arena it leaves).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

_rates = {"link": 0.0, "host": 0.0}  # bytes per second; 0: the machine's own speed


def link_bytes_per_second() -> float:
    """The emulated link's bandwidth for CPU devices; 0 when copies run at memory speed."""
    return _rates["link"]


def host_bytes_per_second() -> float:
    """The emulated host memory bandwidth of host steps; 0 when they run at the machine's own speed."""
    return _rates["host"]


@contextmanager
def _emulated(lane: str, bytes_per_second):
    if isinstance(bytes_per_second, bool) or not isinstance(bytes_per_second, (int, float)) \
            or not math.isfinite(bytes_per_second) or bytes_per_second <= 0:
        raise ValueError(f"emulated_{lane}: bytes_per_second must be a positive number, got {bytes_per_second!r}")
    previous, _rates[lane] = _rates[lane], float(bytes_per_second)
    try:
        yield
    finally:
        _rates[lane] = previous


def emulated_link(bytes_per_second: float):
    return _emulated("link", bytes_per_second)


def emulated_host(bytes_per_second: float):
    return _emulated("host", bytes_per_second)

