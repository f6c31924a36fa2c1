"""Where placement "auto" keeps and steps each spilled task's shards: the lane model's choice (`_C.lane_forecast`,
core/lanes.h and core/lane_plan.h) for this run's tasks, from the rates this machine's lanes are measured at when
the call starts (hydra_torch.run.lane_rates) and each shard's compute as measured on one batch.

The lane model weighs, for every shard of a spilled task, what its step costs on the host (gradient out, the host's
memory traffic, weights back in) against the device (master and moments in and out over the link, the step on the
device's memory), and keeps the placement whose simulated run is shortest within the device's room. The plan starts
from the engine's rule (its resident models and resident ends, engine/placement.h); the engine then keeps resident
the further shards the plan makes resident and steps on the device those it steps there, as far as the budget holds
their homes, their steps' regions and (where a task's steps sum several backwards) their gradient buffers.

On several devices the lane model counts every device alike (a spilled task's units run on any of them): there it
keeps no home, and steps shards on the devices only of tasks whose every backward is followed by its step (a step
summing backwards would sum them on one device, and they may run on several), and only where the host lane bounds
the rule's placement (_host_binds); the engine grants what every device's room holds.

The lanes are apart on a GPU: a CPU device shares its cores and memory with the host, and there the lane model
runs only where the link or the host is emulated (hydra_torch.testing), else "auto" keeps the engine's rule.

Each shard's compute is its pieces' forward + backward as the planner measured them (shards="auto"); a task cut
otherwise has its pieces measured when the call starts (hydra_torch.run.measuring), on one batch of its data, with
every random generator left as it was. A one-shot iterator's batch cannot be drawn twice: such a task is priced by
its elements at the seconds per element of the measured tasks, and where no task could be measured "auto" keeps the
engine's rule. What the lane model was told and forecast is Results.lane_plan.

A task added to the running call (one joining it, one re-planned after running out of memory, or one placed again
once another has left: hydra_torch.run.replacement) is placed from the same rates, the tasks still training kept
where they are (added_device_shards): the arena is sized by then, so it only steps shards on the device.
"""
from __future__ import annotations

import statistics
import warnings

import torch

from hydra_torch import testing
from hydra_torch._loader import native as _C
from hydra_torch.run import lane_rates

STEPS_FORECAST = 6  # steps of each task the lane model simulates: enough for its steady state, bounded in time


def step_bytes(task) -> tuple[float, float, float, float, float]:
    """Bytes per element as the engine counts them (core/lanes.h StepBytes): (weight, state, host step, host
    accumulate, device step). The fp32 master is the weight itself in fp32 and a copy beside the bf16 weight in
    bf16; every step reads the gradient, reads and writes the master and each optimizer state (a bf16 shadow written
    on top, where the gradient is half the size): 12 + 8 a state in both."""
    states = task.optimizer.spec().num_states
    weight = 2.0 if task.precision == "bf16" else 4.0
    state = 4.0 * states + (4.0 if task.precision == "bf16" else 0.0)
    touched = 12.0 + 8.0 * states
    return weight, state, touched, 8.0, touched


def shard_seconds(task) -> list[float] | None:
    """Each shard's forward + backward as the planner measured its pieces, or None."""
    pieces = task.piece_seconds
    if pieces is None or len(pieces) != sum(len(group) for group in task.modules):
        return None
    seconds, start = [], 0
    for group in task.modules:
        seconds.append(sum(pieces[start:start + len(group)]))
        start += len(group)
    return seconds


def task_shape(runner, store, seconds: list[float]) -> tuple:
    """(shards, micro-batches, accumulate, clipped) for the lane model, each shard (forward s, backward s, weights,
    grads, params, tied_to, borrowed: _C.lane_forecast's). A unit's recomputing backward costs three forwards
    (CostModel::kPhaseWeight): the probe's forward + backward, without recomputation, is three forwards too."""
    shards = []
    for s in range(store.num_shards):
        last = s == store.num_shards - 1
        forward, backward = (0.0, seconds[s]) if last else (seconds[s] / 3, seconds[s])
        sources = store.sources(s)
        tied_to = sources[1] if len(sources) > 1 else -1  # the owner of a weight it borrows
        # Frozen or not, the layout's tail (from one owner; from several, the trainable part alone is priced).
        borrowed = store.device_numel(s) - store.owned_numel(s) if len(sources) == 2 else 0
        shards.append((forward, backward, store.device_numel(s), store.gradient_numel(s), store.trainable_numel(s),
                       tied_to, borrowed))
    accumulate = runner.task.accumulate
    return shards, STEPS_FORECAST * accumulate, accumulate, runner.task.clip_grad_norm is not None


def timed_seconds(runners, stores, per_element: float | None = None) -> list[list[float] | None]:
    """Each task's shard seconds: measured, else priced by its elements at the median seconds per element of the
    measured tasks, or where none was measured at `per_element` (the call's, measured as it started); None for every
    task where neither is known."""
    measured = [shard_seconds(runner.task) for runner in runners]
    rate = _seconds_per_element(measured, stores) or per_element
    if rate is None:
        return [None] * len(runners)
    return [seconds if seconds is not None else [rate * store.device_numel(s) for s in range(store.num_shards)]
            for seconds, store in zip(measured, stores)]


def _seconds_per_element(measured, stores) -> float | None:
    """The median seconds per element of the tasks whose shard seconds were `measured` (None: not), or None."""
    per_element = [sum(seconds) / sum(store.device_numel(s) for s in range(store.num_shards))
                   for seconds, store in zip(measured, stores) if seconds is not None]
    return statistics.median(per_element) if per_element else None


def lanes_apart(device) -> bool:
    """Whether the device's compute, its link and the host's memory are lanes apart (see the module)."""
    return torch.device(device).type != "cpu" or testing.link_bytes_per_second() > 0 \
        or testing.host_bytes_per_second() > 0


def plan(runners, stores, devices, candidates: list[bool], decided, free_left: list[int]):
    """(per task, per shard: "host", "device" or "resident"; what the lane model was told and forecast) for the
    lane model's choice from the placement the engine's rule `decided` (place_models' decision: resident models and
    resident ends), within the room every device's budget leaves beyond that (`free_left`, per device) less the
    largest working set; None where no task is spilled or none had its compute measured. Tasks that may not step off
    the host (`candidates`) are in the model for the lanes they load, and keep their steps on the host whatever it
    says of them; resident ones are kept where they are (on several devices, each on its own). The lanes' rates are
    the first device's."""
    spilled = [store for store, (resident_on, *_) in zip(stores, decided) if resident_on < 0]
    seconds = timed_seconds(runners, stores)
    if not spilled or seconds[0] is None:
        return None
    shapes = [task_shape(runner, store, s) for runner, store, s in zip(runners, stores, seconds)]
    start = [["resident" if resident_on >= 0 or s in resident_shards else "host" for s in range(store.num_shards)]
             for store, (resident_on, _, resident_shards, _, _) in zip(stores, decided)]
    resident = [resident_on >= 0 for resident_on, *_ in decided]
    largest = max(max(store.device_numel(s) for s in range(store.num_shards)) for store in stores)
    rates = lane_rates.measure(devices[0], largest)
    room = max(0, min(free_left) - max(_C.DeviceEngine.spilled_need(store) for store in spilled))
    bytes_ = step_bytes(runners[candidates.index(True)].task)
    if len(devices) > 1 and not _host_binds(shapes, rates, bytes_, len(devices), start):
        return None
    forecast = _C.lane_forecast(shapes, rates, bytes_, len(devices), None, room, start, resident)
    places = [list(p) if candidate else ["host"] * len(p) for p, candidate in zip(forecast["placement"], candidates)]
    per_element = _seconds_per_element([shard_seconds(runner.task) for runner in runners], stores)
    return places, told_and_forecast(rates, forecast, per_element, room, start)


def _host_binds(shapes, rates, bytes_, devices: int, start) -> bool:
    """Whether the host lane bounds the rule's placement (`start`) on `devices` devices: the lane that steps taken
    off the host relieve. On several devices the simulator counts every device alike and forecast host-stepped runs
    1.2x longer than they ran on two emulated devices (benchmarks/RESULTS.md), so its choice there, which once
    stepped shards on the device where the link bound and took 1.26x the host-only span, is asked only where the
    host binds."""
    bound = _C.lane_forecast(shapes, rates, bytes_, devices, start)["bound"]
    return bound["host"] >= max(bound["compute"], bound["host_to_device"], bound["device_to_host"])


def told_and_forecast(rates, forecast, per_element: float | None, room: int, start) -> dict:
    """Results.lane_plan: the lanes' measured rates (bytes/s), the measured tasks' compute in seconds per element
    (their median: it prices a task added to the run later where no measured task still trains), the room it placed
    in beyond the rule's placement `start` (both as the lane model was told: a forecast of another placement in that
    room, lane_forecast's `room` and `start`) and the forecast's busy share of each lane over its run of
    STEPS_FORECAST steps of every task."""
    busy, makespan = forecast["busy_seconds"], forecast["makespan"]
    return {"rates": dict(zip(("copies_in", "copies_out", "host_steps", "device_steps"), rates)),
            "seconds_per_element": per_element, "room": room, "start": start,
            "busy": {"compute": forecast["bound"]["compute"] / makespan,
                     "copies_in": busy["host_to_device"] / makespan, "copies_out": busy["device_to_host"] / makespan,
                     "host": busy["host"] / makespan}}


def wishes(runners, stores, engines, devices, placement: str, candidates: list[bool], graph_bytes, bases):
    """(per task, the shards it asks to keep resident (the resident ends among them) and the shards it asks to step
    on the device: engine/placement.h's `wishes`; the lane model's rates and the forecast of what it asked, or
    None). Every shard on the device for "device"; the lane model's choice for "auto" on devices whose lanes are
    apart; nothing for "host". `candidates`, `graph_bytes` and `bases` are place_models' `resident_ends`,
    `graph_bytes` and `bases`.

    The lane model only informs the placement: where measuring or planning fails (a device out of memory for the
    rates' buffers, say), a warning says so and "auto" keeps the engine's rule. So it does where granting its
    wishes, task by task, would cost a later task the residency or resident ends the rule gives it."""
    nothing = [([], []) for _ in stores]
    if placement == "device":
        return [([], list(range(store.num_shards)) if candidate else [])
                for store, candidate in zip(stores, candidates)], None
    if placement != "auto" or not lanes_apart(devices[0]):
        return nothing, None
    # On several devices a step summing backwards stays on the host (engine/placement.h).
    movable = [candidate and (len(engines) == 1 or store.steps_after_each_backward)
               for candidate, store in zip(candidates, stores)]
    if not any(movable):
        return nothing, None
    names = [runner.task.name for runner in runners]
    decided, free_left = _C.place_models(engines, stores, names, graph_bytes, candidates, bases, [], True)
    try:
        planned = plan(runners, stores, devices, movable, decided, free_left)
    except Exception as error:  # noqa: BLE001  (see the docstring; KeyboardInterrupt is not caught)
        warnings.warn(f"placement='auto' could not ask the lane model ({type(error).__name__}: {error}); every "
                      f"spilled task keeps the engine's rule (resident ends)", RuntimeWarning, stacklevel=5)
        return nothing, None
    if planned is None:
        return nothing, None
    places, told = planned
    # The lane model has weighed what its homes and device steps cost the weights the devices keep (its simulator keeps
    # them in the room those leave): the engine grants them as far as the budget holds, as when a task is placed
    # again (added_device_shards).
    asked = [([s for s, place in enumerate(shard_places) if place == "resident"],
              [s for s, place in enumerate(shard_places) if place == "device"]) for shard_places in places]
    granted, _ = _C.place_models(engines, stores, names, graph_bytes, candidates, bases, asked, True)
    if any(_loses(rule, got) for rule, got in zip(decided, granted)):
        return nothing, None
    return asked, told


def added_device_shards(newcomer, store, running, uncommitted: list[int], placement: str, lane_plan) -> list[int]:
    """The shards a task added to the running call (`newcomer`, its `store`: a task joining it, one re-planned after
    running out of memory, or one placed again once another has left) steps on the devices: every one that may be
    for "device", the lane model's choice for "auto" from what the call measured as it started (`lane_plan`,
    Results.lane_plan: the lanes' rates, and the compute per element that prices a task not measured), with the
    tasks still training (`running`) kept as they are placed, in the room every device's `uncommitted` bytes leave
    (DeviceEngine's uncommitted_bytes, per device: what working sets and device steps share); none for "host" or
    where the call asked no lane model as it started. The arena is sized by then, so the task keeps no home and
    holds no gradient buffer: only a task whose every backward is followed by its step
    (ShardStore.steps_after_each_backward) steps shards on the device, and neither a tied shard (a tie's owner keeps
    a gradient buffer for the run, where its borrowers' gradients of it wait for its own) nor one with nothing to
    train. On several devices "auto" asks the lane model only where the host lane bounds the placement with
    every one of the task's shards on the host (_host_binds), as at the call's start. The engine has the last word
    (add_model)."""
    if placement not in ("auto", "device") or not store.steps_after_each_backward:
        return []
    eligible = untied_trainable(store)
    if placement == "device" or not eligible:
        return eligible
    if lane_plan is None:
        return []
    rates = tuple(lane_plan["rates"].values())
    runners, stores = running + [newcomer], [r.store for r in running] + [store]
    seconds = timed_seconds(runners, stores, lane_plan["seconds_per_element"])
    if seconds[-1] is None:
        return []
    shapes = [task_shape(runner, s, sec) for runner, s, sec in zip(runners, stores, seconds)]
    start = [_placed(runner) for runner in running] + [["host"] * store.num_shards]
    bytes_, devices = step_bytes(newcomer.task), len(uncommitted)
    if devices > 1 and not _host_binds(shapes, rates, bytes_, devices, start):
        return []
    room = _room_left(runners, stores, uncommitted)
    # The shards not eligible stay on the host: told so, the lane model chooses among the others and forecasts what
    # the engine grants (were the tied embedding and head free to move, it would weigh a placement never granted).
    kept = [[] for _ in running] + [[s for s in range(store.num_shards) if s not in eligible]]
    forecast = _C.lane_forecast(shapes, rates, bytes_, devices, None, room, start, [True] * len(running) + [False],
                                kept)
    # A shard the lane model would keep resident is off the host too: stepped on the device, in less room.
    return [s for s in eligible if forecast["placement"][-1][s] != "host"]


def move_pays(runner, running, uncommitted: list[int], placement: str, lane_plan, wanted: list[int]) -> bool:
    """Whether a task still training (`runner`) gains, over its steps left, more by stepping `wanted` on the devices
    instead of where its shards step now (runner.device_shards) than the move costs: its weights copied in again
    (the cached copies go with the old registration). The lane model forecasts the run both ways (STEPS_FORECAST
    steps of every task, the tasks still training, `running`, kept where they are) from the call's rates, in the
    room every device's `uncommitted` bytes leave (per device, measured with the task still placed as it is: the
    room added_device_shards chose `wanted` in); the gain is the forecasts' difference for each step the task has
    left. Without that weighing a task placed again after each departure could go to four shards on the devices and
    back to two, copying its weights in each time. Only "auto" weighs it ("device" moves by its rule); where the
    lane model cannot price the tasks, it moves."""
    if placement != "auto" or lane_plan is None:
        return True
    rates = tuple(lane_plan["rates"].values())
    runners = running + [runner]
    stores = [r.store for r in runners]
    seconds = timed_seconds(runners, stores, lane_plan["seconds_per_element"])
    if seconds[-1] is None:
        return True
    shapes = [task_shape(r, store, sec) for r, store, sec in zip(runners, stores, seconds)]
    others = [_placed(r) for r in running]
    bytes_, devices = step_bytes(runner.task), len(uncommitted)
    room, start = _room_left(runners, stores, uncommitted), others + [_placed(runner)]

    def span(device_shards):
        here = shard_places(runner.n, False, [], device_shards)
        return _C.lane_forecast(shapes, rates, bytes_, devices, others + [here], room, start)["span"]
    gain_per_step = (span(runner.device_shards) - span(wanted)) / STEPS_FORECAST
    steps_left = max(0, runner.task.total_steps - runner.steps)  # as len(data) says (a lying one misweighs, never fails)
    weights_in = bytes_[0] * sum(stores[-1].device_numel(s) for s in range(runner.n)) / rates[0]
    return gain_per_step * steps_left > weights_in


def added_or_host(newcomer, store, running, uncommitted: list[int], placement: str, lane_plan,
                  stacklevel: int = 2) -> list[int]:
    """added_device_shards, or none where the lane model fails: a warning (at `stacklevel` above this function's
    caller) says so and every shard of the task steps on the host, as at the call's start."""
    try:
        return added_device_shards(newcomer, store, running, uncommitted, placement, lane_plan)
    except Exception as error:  # noqa: BLE001  (the lane model only informs the placement)
        warnings.warn(f"placement={placement!r} could not ask the lane model for {newcomer.task.name!r} "
                      f"({type(error).__name__}: {error}); it steps every shard on the host", RuntimeWarning,
                      stacklevel=stacklevel + 1)
        return []


def _room_left(runners, stores, uncommitted: list[int]) -> int:
    """The room the lane model places in beside tasks already placed: the least of every device's `uncommitted`
    bytes, less the largest working set of the spilled tasks (`runners`, their `stores`)."""
    spilled = [store for runner, store in zip(runners, stores) if not runner.resident]
    return max(0, min(uncommitted) - max((_C.DeviceEngine.spilled_need(store) for store in spilled), default=0))


def untied_trainable(store) -> list[int]:
    """The shards the engine may step on the device without a gradient buffer of their own (a tie's owner keeps one,
    SpilledModel::keeps_gradient_buffer): untied, with something to train."""
    tied = set()
    for s in range(store.num_shards):
        for source in store.sources(s):
            if source != s:
                tied.update((s, source))
    return [s for s in range(store.num_shards) if s not in tied and store.trainable_numel(s) > 0]


def _placed(runner) -> list[str]:
    """Where a training task's shards step: "resident", "device" or "host"."""
    return shard_places(runner.n, runner.resident, runner.resident_shards, runner.device_shards)


def shard_places(shards: int, resident: bool, resident_shards, device_shards) -> list[str]:
    """Per shard of a task placed so (resident whole, or these shards resident and these stepped on the device):
    "resident", "device" or "host"."""
    if resident:
        return ["resident"] * shards
    return ["resident" if s in resident_shards else "device" if s in device_shards else "host" for s in range(shards)]


def _loses(rule, got) -> bool:
    """Whether a task placed `got` lost what the rule gave it (`rule`): its residency, or a resident shard."""
    (rule_device, _, rule_shards, _, _), (device, _, shards, _, _) = rule, got
    return (rule_device >= 0 and device < 0) or not set(rule_shards) <= set(shards)
