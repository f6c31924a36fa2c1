"""The Results of a cluster run, put together from what every node run sent back: one machine's Results, with
a device row per node and device ("node1/cuda:0"), and the driver's models loaded with the trained weights."""
from __future__ import annotations

import time

from hydra_torch.models.sharding import root_module
from hydra_torch.report.results import Results, StepEntry, TraceEntry

_KEPT_MAX = ("budget_bytes", "capacity_bytes", "high_water_bytes", "staging_bytes", "working_set_bytes",
             "saved_allowance_bytes", "saved_high_water_bytes")  # summed otherwise


def assemble(tasks, outcomes: dict, moves: list, runs: list, start: float) -> Results:
    """`outcomes`: task index -> (node, TaskResult, state dict or None); `moves`: per task, why it moved;
    `runs`: (node, payload) of every node run that came back; `start`: the run's wall-clock start."""
    devices, stats, index = [], [], {}
    for node, payload in runs:
        for name, stat in zip(payload["devices"], payload["stats"]):
            key = (node, name)
            if key not in index:
                index[key] = len(devices)
                devices.append(f"node{node}/{name}")
                stats.append(dict(stat))
                continue
            merged = stats[index[key]]
            for k, v in stat.items():
                if isinstance(v, (int, float)):
                    merged[k] = max(merged[k], v) if k in _KEPT_MAX else merged[k] + v
    trace = []
    for node, payload in runs:
        for device, task, unit, shard, phase, begin, end, copied in payload["trace"]:
            trace.append(TraceEntry(index[(node, payload["devices"][device])], task, tasks[task].name, unit, shard,
                                    phase, begin - start, end - start, copied))
    trace.sort(key=lambda e: e.start)
    steps = [StepEntry(index[(node, payload["devices"][device])], task, tasks[task].name, shard, step, place,
                       begin - start, end - start)
             for node, payload in runs
             for device, task, shard, step, place, begin, end in payload.get("steps", [])]
    steps.sort(key=lambda e: e.start)
    results, models = [], {}
    for i, task in enumerate(tasks):
        node, result, weights = outcomes[i]
        if weights is not None:
            root_module(task.model, task.pieces).load_state_dict(weights)
        result.moves = list(moves[i])
        result.node = f"node{node}" if node is not None else None
        results.append(result)
        models[task.name] = task.model
    return Results(results, devices, stats, trace, time.time() - start, models=models, steps=steps)
