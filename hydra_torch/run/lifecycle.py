"""A task's life on the engines: its host state made and placed (resident on one device, or spilled on
all), and, once it ends, its weights brought home and its result put together."""
from __future__ import annotations

import warnings

from hydra_torch import testing
from hydra_torch._loader import native as _C
from hydra_torch.models.memory import format_bytes
from hydra_torch.report.errors import detached
from hydra_torch.report.results import TaskResult
from hydra_torch.run import bases, lane_choice

PLACEMENTS = ("auto", "host", "device")  # ht.train's and ht.plan's `placement`


def check_placement(placement, none_allowed: bool = False) -> None:
    """ValueError unless `placement` is one of PLACEMENTS (or None, where `none_allowed`)."""
    if (placement is None and none_allowed) or (isinstance(placement, str) and placement in PLACEMENTS):
        return
    raise ValueError(f"placement must be one of {', '.join(map(repr, PLACEMENTS))}{' or None' if none_allowed else ''}"
                     f", got {placement!r}")


def make_store(runner, pin: bool):
    """The task's host training state (fp32 master, optimizer state), with its parameter groups' options."""
    task = runner.task
    store = _C.ShardStore(bases.own_params(task), task.optimizer.spec(), task.precision == "bf16", pin)
    # Then a device-stepped shard's gradients need device memory only from its backward to its step.
    store.steps_after_each_backward = task.accumulate == 1 and task.clip_grad_norm is None
    if pin and not store.pinned:
        warnings.warn("pinned host memory is unavailable; using pageable memory, so host-device copies are "
                      "synchronous and slower", RuntimeWarning, stacklevel=4)
    for param, lr, weight_decay in task.param_options.values():
        if id(param) not in task.base_weights:  # a base's weights are frozen: no group applies to them
            store.set_param_options(param, lr, weight_decay)
    runner.store = store
    return store


def may_keep_ends(task) -> bool:
    """Whether "auto" may keep the task's ends resident (and "device" step shards on the device). Not a bf16
    task that sums micro-batches: a resident or device-stepped shard's gradients add up in its bf16 buffer (as
    autograd adds them), a spilled one's in an fp32 accumulator."""
    return not (task.precision == "bf16" and task.accumulate > 1)


def make_engines(devices, budgets, host_steps, kept_outside: int, arrivals=None) -> list:
    """One native DeviceEngine per device, whose arena may take what the budget keeps for no unit's working set
    and no micro-batch's saved inputs (`kept_outside`); with arrivals, each arena takes that from the start."""
    for device, budget in zip(devices, budgets):
        if budget <= kept_outside:
            raise ValueError(f"memory budget {format_bytes(budget)} on {device} leaves nothing for training state: "
                             f"one unit's working set and one micro-batch's saved inputs take "
                             f"{format_bytes(kept_outside)}; raise memory_budget or train on smaller batches")
    link, host = testing.link_bytes_per_second(), testing.host_bytes_per_second()
    host_pace = _C.HostPace(host) if host > 0 else None  # one memory bandwidth, shared by every device's steps
    engines = [_C.DeviceEngine(str(d), b - kept_outside, host_steps, link, host_pace)
               for d, b in zip(devices, budgets)]
    for engine in engines if arrivals is not None else ():
        engine.expect_arrivals()
    return engines


def place(runners, engines, devices, pin: bool, graph_bytes=(), kept_outside: int = 0, placement: str = "auto"):
    """Registers every task's state with the engines: resident on one device or spilled on all, as the
    engines' budget rules decide (`_C.place_models`: a task is resident only where every task that may spill
    there keeps room for its working set, and its own autograd graph, `graph_bytes`, fits beside it). With
    `placement="auto"` (or "device") on one device a spilled task keeps its first and last shards resident where
    they fit; with "auto" it also keeps resident, or steps on the device, the shards the lane model takes off the
    host (hydra_torch.run.lane_choice), and with "device" it steps all its other shards on the device, a tied
    weight's with the shards that share it (engine/placement.h); on several devices it keeps no shard resident, and
    steps untied shards on the device only where each of its backwards is followed by its step. The engines'
    budgets are memory_budget less `kept_outside`, which a refusal says. The frozen bases the tasks share (ht.FrozenBase) are held and registered first
    (hydra_torch.run.bases).
    Returns what the lane model was told and forecast (Results.lane_plan), or None where it was not asked."""
    held = bases.hold(runners, engines, pin)
    stores = [make_store(runner, pin) for runner in runners]
    placed, lane_plan = _placed(runners, stores, engines, devices, graph_bytes, kept_outside, placement,
                                decide_only=False)
    for runner, (device, home, resident_shards, model_ids, device_shards) in zip(runners, placed):
        runner.model_ids = {d: model for d, model in enumerate(model_ids) if model >= 0}
        runner.resident_shards = list(range(runner.n)) if device >= 0 else list(resident_shards)
        runner.device_shards = list(device_shards)
        if home >= 0:
            runner.home = home if len(engines) > 1 else None
        if device >= 0:
            runner.keep_graphs = runner.resident = True
    for base in held:
        for runner in base.members:
            base.attach(runner, engines)
    return lane_plan


def decide(runners, engines, devices, graph_bytes=(), kept_outside: int = 0, placement: str = "auto"):
    """What `place` would decide for tasks without a frozen base, registering nothing: (per task, per shard:
    "resident", "device" or "host"; what the lane model was told and forecast, or None). Makes each task's store
    (its host state, unpinned) as place does."""
    stores = [make_store(runner, pin=False) for runner in runners]
    placed, lane_plan = _placed(runners, stores, engines, devices, graph_bytes, kept_outside, placement,
                                decide_only=True)
    places = [lane_choice.shard_places(store.num_shards, device >= 0, resident_shards, device_shards)
              for store, (device, _, resident_shards, _, device_shards) in zip(stores, placed)]
    return places, lane_plan


def _placed(runners, stores, engines, devices, graph_bytes, kept_outside: int, placement: str, decide_only: bool):
    """place_models' placements of `stores` (registered unless `decide_only`) with the lane model's wishes, and what
    the lane model was told and forecast; a budget that cannot hold a task is a ValueError."""
    off_host = [placement in ("auto", "device") and may_keep_ends(runner.task) for runner in runners]
    base_ids = [runner.base.group if runner.base is not None else -1 for runner in runners]
    try:
        wishes, lane_plan = lane_choice.wishes(runners, stores, engines, devices, placement, off_host,
                                               list(graph_bytes), base_ids)
        placed, _ = _C.place_models(engines, stores, [runner.task.name for runner in runners], list(graph_bytes),
                                    off_host, base_ids, wishes, decide_only)
    except RuntimeError as error:
        kept = (f" (the arena's share of memory_budget: {kept_outside} bytes of it are kept for one unit's working "
                f"set and one micro-batch's saved inputs)" if kept_outside else "")
        raise ValueError(str(error) + kept) from None
    return placed, lane_plan


def home_slot(runner) -> int:
    """The device whose engine writes the task's weights back: where it is resident, else the first."""
    return runner.home if runner.home is not None else next(iter(runner.model_ids))


def bring_home(runner, engines, checkpoints=None):
    """After the task's last unit, all devices idle: waits for its host jobs, writes the weights back into
    its model (also when a job failed: the error goes into runner.error) and writes its final checkpoint."""
    if not runner.model_ids:  # no engine holds it: a re-plan failed after its weights came home
        if runner.base is not None:
            runner.base.point_home(runner)
        runner.restore_buffers()
        return
    home = home_slot(runner)
    try:
        if runner.error is not None:
            runner.discard_unfinished_step(engines)
        for slot_index, model in runner.model_ids.items():
            if slot_index != home:
                engines[slot_index].synchronize(model)
    except Exception as error:  # a host job of the task failed after its last unit
        runner.error = runner.error or error
    if checkpoints is not None:  # finish rewrites the store a resident task's last checkpoint may be reading
        checkpoints.wait(runner)
    try:
        engines[home].finish(runner.model_ids[home])  # writes the weights back even when it raises
    except Exception as error:
        runner.error = runner.error or error
    if runner.base is not None:
        runner.base.point_home(runner)
    runner.restore_buffers()
    if checkpoints is not None and runner.error is None and runner.at_step_boundary():
        checkpoints.submit(runner, final=True)


def task_result(runner, engines, trace, start: float) -> TaskResult:
    units = [e for e in trace if e.task == runner.index]
    loads = [sum(col) for col in zip(*(engines[i].shard_loads(m) for i, m in runner.model_ids.items()))]
    return TaskResult(runner.task.name, runner.losses, runner.steps, runner.epochs_done,
                      (max(e.end for e in units) - start) if units else 0.0, runner.resident, loads,
                      detached(runner.error),
                      busy_time=sum(e.end - e.start for e in units), host_bytes=runner.store.host_bytes,
                      cut_short=runner.cut_short, eval_losses=list(runner.eval_losses), stopped=runner.stopped,
                      replans=list(runner.replans), total_steps=runner.task.total_steps,
                      resident_shards=list(runner.resident_shards), device_shards=list(runner.device_shards))
