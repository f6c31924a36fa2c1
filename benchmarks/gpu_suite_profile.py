"""Where one spilled training step's time goes: the suite's profile phase.

One model trains for `steps` steps under the memory budget; the CUDA profiler records exactly the units of the
last step (started before its first unit, stopped after its last unit's device work). From that window:
  - per unit (hydra's trace): wall seconds by phase (forward, forward+backward, backward);
  - on the GPU (profiler): kernel time, host-to-device and device-to-host copy time, how much of the copying
    ran under kernels, and how long the GPU had nothing at all to do;
  - on the host (the engine's own counters, whole run, per step): fp32 optimizer steps, and waiting for gradient
    copies plus adding them into the fp32 accumulators.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

import torch

from gpu_suite_env import GiB, Workload
from gpu_suite_systems import WEIGHT_DECAY, _reset, failure


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total overlap of two sorted, disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def gpu_activity(chrome_trace: dict) -> dict:
    """Seconds of kernels and copies in a torch.profiler Chrome trace, and their overlaps."""
    kernels, h2d, d2h, other = [], [], [], []
    for e in chrome_trace.get("traceEvents", []):
        cat, dur = e.get("cat", ""), e.get("dur")
        if dur is None or cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        span = (e["ts"] / 1e6, (e["ts"] + dur) / 1e6)
        name = e.get("name", "")
        if cat == "kernel":
            kernels.append(span)
        elif "HtoD" in name:
            h2d.append(span)
        elif "DtoH" in name:
            d2h.append(span)
        else:
            other.append(span)
    if not (kernels or h2d or d2h):
        return {"events": 0}
    k, copies = _union(kernels), _union(h2d + d2h)
    everything = _union(kernels + h2d + d2h + other)
    window = everything[-1][1] - everything[0][0]
    return {"events": len(kernels) + len(h2d) + len(d2h) + len(other), "kernels": len(kernels),
            "window_s": window, "kernel_s": _length(k), "kernel_sum_s": sum(b - a for a, b in kernels),
            "h2d_s": _length(_union(h2d)), "d2h_s": _length(_union(d2h)), "copy_s": _length(copies),
            "copy_under_kernels_s": _intersection(copies, k), "gpu_idle_s": window - _length(everything)}


def profile_hydra(model, w: Workload, data, device: torch.device, budget, steps: int = 2) -> dict:
    """Trains `model` for `steps` steps (batches from `data`), its shards planned for the budget, and profiles the
    last step."""
    try:
        import hydra_torch as ht
        from hydra_torch.run import workers

        _reset(device)
        task = ht.ModelTask(model, data=data[:steps], optimizer=ht.optim.AdamW(lr=1e-4, weight_decay=WEIGHT_DECAY),
                            name="profiled", precision="bf16", shards="auto")

        def last_step_units():  # known once ht.train has planned the shards
            per_step = 2 * task.num_shards - 1
            return (steps - 1) * per_step, steps * per_step - 1
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(activities=activities)
        original = workers._visit

        def visit(slot, unit, runner):
            # Only the last step's units are recorded: earlier steps warm the allocator, cuBLAS and the caches.
            first, last = last_step_units()
            if unit.index == first:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                profiler.start()
            try:
                return original(slot, unit, runner)
            finally:
                if unit.index == last:
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    profiler.stop()

        workers._visit = visit
        try:
            start = time.perf_counter()
            results = ht.train([task], devices=[device], memory_budget=budget, progress=False, seed=w.seed)
            wall = time.perf_counter() - start
        finally:
            workers._visit = original
        if results[0].error is not None:
            return {"error": f"{type(results[0].error).__name__}: {results[0].error}"}
        first, last = last_step_units()
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            profiler.export_chrome_trace(path)
            with open(path) as f:
                gpu = gpu_activity(json.load(f))
        units = [e for e in results.trace if first <= e.unit <= last]
        by_phase = {}
        for e in units:
            entry = by_phase.setdefault(e.phase, {"units": 0, "seconds": 0.0})
            entry["units"] += 1
            entry["seconds"] += e.end - e.start
        stats = results.stats[0]
        return {"shards": task.num_shards, "steps": steps, "resident": results[0].resident, "wall_s": wall,
                "budget_gib": stats["budget_bytes"] / GiB,
                "step_wall_s": units[-1].end - units[0].start if units else None,
                "unit_seconds_sum": sum(e.end - e.start for e in units), "by_phase": by_phase,
                "unit_seconds": [[e.shard, e.phase[0], round(e.end - e.start, 6), e.bytes_copied] for e in units],
                "gpu": gpu,
                "host_step_seconds_per_step": stats["host_step_seconds"] / steps,
                "grad_copy_seconds_per_step": stats["grad_copy_seconds"] / steps,
                "weight_copy_seconds_per_step": stats["weight_copy_seconds"] / steps,
                "host_to_device_gb_per_step": stats["host_to_device_bytes"] / steps / 1e9,
                "device_to_host_gb_per_step": stats["device_to_host_bytes"] / steps / 1e9}
    except Exception as error:
        return failure(error)
    finally:
        _reset(device)
