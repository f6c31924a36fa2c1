"""The tasks the planner did not cut (shards given by hand, one per layer by default), measured when a call starts
or a task joins it: each piece's activations and input on one batch, so that each device's budget keeps room
beside the arena for their working set and saved activations as it does for a planned task's; and each piece's
forward + backward, the unit times the lane model weighs where "auto" asks it (hydra_torch.run.lane_choice).

Only where the device's memory is its own: on a GPU, or on a CPU device whose link or host hydra_torch.testing
emulates (lane_choice.lanes_apart). A plain CPU device's activations are the host's memory, as its arena is, and a
budget there keeps nothing for them (a planned task's are kept: its cut counts on them)."""
from __future__ import annotations

import collections.abc
import copy

import torch

from hydra_torch.models import planner, sharding
from hydra_torch.models.first_batch import first_batch, has_workers
from hydra_torch.run import saved_bytes
from hydra_torch.run.lane_choice import lanes_apart


def measure_tasks(tasks, devices, budgets, time_units: bool) -> None:
    """Measures every task the planner did not cut (planner.probe, on one batch) on the device with the smallest
    budget, where the planner measures those it cuts (a spilled task may run on any device). Before the engines
    exist, as the planner's probes are, so that nothing else holds device memory; every random generator is left as
    it was (a shuffling DataLoader draws its order from them: torch's, Python's, NumPy's, and the loader's own).

    A one-shot iterator's batch cannot be drawn twice, and a loader with worker processes would start them: their
    tasks are not measured. Nor is a task whose data yields nothing or whose pieces fail on its batch: the
    measurement only informs the budget and the placement, and the task's own units then meet the error where it is
    the task's alone (its result says it). A task not measured keeps what it held (a plan's, applied by
    ht.planner.apply_plan; else nothing kept for it beside the arena), and no unit times. With `time_units` (placement
    "auto" where the call starts), each piece's forward + backward is timed and kept; without, each piece runs twice
    (to warm up, then measured) and nothing is timed."""
    device = torch.device(devices[min(range(len(devices)), key=lambda i: budgets[i])])
    if not lanes_apart(device):
        return  # a CPU device's activations are the host's memory (see the module)
    for task in tasks:
        # The planner has just measured a task it cut (on the same device); the others anew, for this device.
        if not task.auto_shards:
            _measure(task, device, time_units)


def kept_beside_arena(tasks, resident=(), device="cpu") -> int:
    """What ht.train would keep of each `device`'s budget beside the arena for `tasks` (nothing for a CPU device
    outside hydra_torch.testing's emulated link and host): one unit's working set and one micro-batch's saved inputs,
    the largest among the tasks', and the autograd graphs the tasks named in `resident` keep beyond those where they
    are resident. For tests and benchmarks that size a budget by the arena it leaves; the tasks keep what they
    held."""
    if not lanes_apart(device):
        return 0
    copies = [copy.copy(task) for task in tasks]
    measure_tasks(copies, [device], [0], time_units=False)
    graphs = saved_bytes.graphs_beyond_inputs(copies)
    return sum(saved_bytes.kept_outside_arena(copies)) + sum(g for t, g in zip(tasks, graphs) if t.name in resident)


def _measure(task, device: torch.device, time_units: bool) -> None:
    task.piece_seconds = None  # not another call's, perhaps on another device
    if isinstance(task.data, collections.abc.Iterator) or has_workers(task.data):
        return  # a loader with workers would start them (and a persistent one keep this pass's order)
    with torch.random.fork_rng(devices=planner.rng_devices(device)):
        try:
            batch = first_batch(task.data)
            measured = planner.probe(task, device, batch, repeats=1 if time_units else 0)
        except Exception:  # noqa: BLE001  (see measure_tasks; KeyboardInterrupt is not caught)
            return
    starts = sharding.starts_in(task.modules, task.pieces)
    if starts is not None:
        planner.keep_needs(task, [c[1] for c in measured.costs], measured.input_bytes, starts)
    if time_units:
        task.piece_seconds = [c[2] for c in measured.costs]
