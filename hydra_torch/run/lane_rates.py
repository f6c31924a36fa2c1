"""The rates of a device's lanes, measured when a call starts, for the lane model (core/lanes.h LaneRates):
(host-to-device, device-to-host, host, device memory), in bytes per second.

- The link, each way: a copy of a pinned host buffer to the device and back, timed. A CPU device's copies run at
  the emulated link's pace where one is set (hydra_torch.testing.emulated_link), else at the memory's.
- The host: the memory traffic of one fused AdamW step on the host (hydra.adam_step with an fp32 gradient and a
  bf16 shadow: 30 bytes an element), timed; the emulated host's pace where one is set.
- The device's memory: the same step on the device (on a CPU device, the host's own unpaced rate: the emulated
  host paces host steps only).

Each figure is the best of a few runs after one to warm up, on a buffer the size of the run's largest shard (at
most MAX_ELEMENTS): the steady rate the lanes reach, not a cold start's.
"""
from __future__ import annotations

import time

import torch

from hydra_torch import ops, testing
from hydra_torch.models.planner import synchronize

MAX_ELEMENTS = 1 << 24  # 64 MB of fp32 a buffer: long enough to time, short enough not to delay the start
MIN_ELEMENTS = 1 << 16
REPEATS = 3
ADAMW_BYTES = 30  # an element's traffic in the timed AdamW step: fp32 gradient read (4), master and two moments
                  # read and written (24), bf16 shadow written (2)


def _best_seconds(device: torch.device, work) -> float:
    work()  # warm: first-touch pages, kernels loaded
    best = float("inf")
    for _ in range(REPEATS):
        synchronize(device)
        start = time.perf_counter()
        work()
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def _adamw_rate(device: torch.device, elements: int) -> float:
    """Bytes per second of one fused AdamW step's memory traffic on `device`."""
    param, grad, exp_avg, exp_avg_sq = (torch.full((elements,), 0.5, device=device) for _ in range(4))
    shadow = torch.empty(elements, dtype=torch.bfloat16, device=device)
    step = [0]

    def adamw():
        step[0] += 1
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, shadow, lr=1e-3, step=step[0], weight_decay=0.01)

    return ADAMW_BYTES * elements / _best_seconds(device, adamw)


def _copy_rates(device: torch.device, elements: int) -> tuple[float, float]:
    host = torch.ones(elements, pin_memory=torch.cuda.is_available() and device.type == "cuda")
    on_device = torch.empty(elements, device=device)
    to_device = _best_seconds(device, lambda: on_device.copy_(host, non_blocking=True))
    to_host = _best_seconds(device, lambda: host.copy_(on_device, non_blocking=True))
    return 4 * elements / to_device, 4 * elements / to_host


def measure(device, largest_shard_elements: int) -> tuple[float, float, float, float]:
    """(host-to-device, device-to-host, host, device memory) bytes/s of `device`'s lanes (see the module)."""
    device = torch.device(device)
    elements = min(MAX_ELEMENTS, max(MIN_ELEMENTS, int(largest_shard_elements)))
    host_steps = None
    if device.type == "cpu":
        link = testing.link_bytes_per_second()
        to_device, to_host = (link, link) if link > 0 else _copy_rates(device, elements)
        host_steps = _adamw_rate(device, elements)
        device_memory = host_steps
    else:
        to_device, to_host = _copy_rates(device, elements)
        device_memory = _adamw_rate(device, elements)
    host = testing.host_bytes_per_second()
    if host <= 0:
        host = host_steps if host_steps is not None else _adamw_rate(torch.device("cpu"), elements)
    return to_device, to_host, host, device_memory
