"""ht.plan: the shards the planner cuts a task into on a device (hydra_torch.models.planner), and where each would
live and step were the task trained there alone, decided as ht.train decides it.

    plan = ht.plan(task, device="cuda:0", budget="16GiB")
    print(plan)   # per shard: pieces, bytes, seconds, where it steps; the lanes' rates and forecast busy shares
    ht.planner.apply_plan(task, plan)   # cut as planned, with the working set ht.train splits the budget by

A task cut by hand instead (`shards=plan.starts`) is measured when ht.train starts, on a GPU (not on a CPU device,
whose activations are the host's memory), so ht.train may place it otherwise there.
"""
from __future__ import annotations

import copy
import types

import torch

from hydra_torch.models import memory, planner
from hydra_torch.models.planner import Plan
from hydra_torch.recipe.reals import integral
from hydra_torch.run import lifecycle, saved_bytes
from hydra_torch.run.caller_modes import training_modes
from hydra_torch.run.devices import resolve_devices


def plan(task, device="cpu", budget=None, sample_batch=None, *, max_shards: int | None = None, repeats: int = 3,
         placement: str | None = "auto") -> Plan:
    """Shards for `task` on `device` under `budget` (what hydra_torch.models.memory.parse_budget accepts; None: 90%
    of free memory), measured on `sample_batch` (default: the task's first batch); see planner.plan_shards.

    With `placement` (ht.train's: "auto", "host" or "device"; None: the shards alone), `Plan.placement` says where
    each shard would live and step were the task trained alone on the device under the budget: "resident" (the
    whole model, or a spilled model's resident shards), "device" (stepped there) or "host". Where the device's lanes
    are apart (a GPU; a CPU device with an emulated link or host, hydra_torch.testing) and "auto" asks the lane
    model, `Plan.lane_plan` holds the lanes' rates measured now and its forecast busy share of each lane. Trained
    beside other tasks the task may be placed otherwise: `TaskResult.placement` and `Results.lane_plan` say what it
    got. To decide, the task's host training state (fp32 master, optimizer state) is made as ht.train makes it, as
    much host memory as training it takes until the call returns; the task itself keeps its own cut. A task that
    shares a FrozenBase is placed beside its base and the base's other tasks, which one task does not show: its
    placement is None.
    """
    lifecycle.check_placement(placement, none_allowed=True)
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"ht.plan plans for one device (\"cuda:0\", \"cpu\", \"auto\"), got {device!r}")
    device = resolve_devices(device)[0]  # as ht.train reads it: "auto", and a device that is not there refused
    with training_modes("ht.plan", stacklevel=1):  # as ht.train measures, whatever the caller's modes
        cut = planner.plan_shards(task, device, budget, sample_batch, max_shards=integral(max_shards),  # np.int64(4)
                                  repeats=integral(repeats))
        if placement is not None and task.base is None:
            cut.placement, cut.lane_plan = placed_alone(task, cut, placement)
    return cut


def placed_alone(task, cut: Plan, placement: str) -> tuple[list[str], dict | None]:
    """Where each shard of `task`, cut as `cut` says, would live and step trained alone on the plan's device under
    its budget, and what the lane model was told and forecast (None where it was not asked)."""
    alone = copy.copy(task)  # cut as the plan says; `task` keeps its own shards
    planner.apply_plan(alone, cut)
    memory.check_host_memory([alone])
    kept_outside = sum(saved_bytes.kept_outside_arena([alone]))
    device = torch.device(cut.device)
    engines = lifecycle.make_engines([device], [cut.budget_bytes], None, kept_outside)
    runner = types.SimpleNamespace(task=alone, base=None, store=None)  # what placing reads of a TaskRunner
    places, lane_plan = lifecycle.decide([runner], engines, [device], saved_bytes.graphs_beyond_inputs([alone]),
                                         kept_outside, placement)
    return places[0], lane_plan
