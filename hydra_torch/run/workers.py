"""One thread per device: ask the scheduler for a unit, run it, report its duration."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from hydra_torch._loader import native as _C
from hydra_torch.report.results import TraceEntry
from hydra_torch.run import replacement, replan, unit_clock
from hydra_torch.run.saved_bytes import SavedBytes

# How many units ahead each device plans its shard visits (for eviction: keep what is needed soonest), how many
# of them it commits to (Scheduler.commit_plan: it runs them in that order while they hold, so what it prefetched
# and kept is used though the cost model's estimates move), and how far ahead of the next planned shard
# prefetch goes, in bytes. Measured on an emulated link (benchmarks/RESULTS.md, "Against the bound"):
# committing to 4 units cut four spilled models' training time by 8-12% and their copies by 11-14%; at memory
# speed it changed nothing beyond noise; prefetching beyond the next planned shard was no faster, committed or not.
# Read when a run starts (make_loop).
PLAN_UNITS = 32
COMMITTED_UNITS = 4
PREFETCH_BEYOND_NEXT_BYTES = 0
# A spilled task whose step was just queued is held back (Scheduler.hold) until the first shard its next forward
# copies in (shard 0, or the first past its resident ends) can come in again: other tasks run meanwhile instead of
# the device waiting for the step and the copy.
HOLD_FOR_STEPS = True


def make_loop(scheduler, engine, index: int):
    """The device's per-unit seam (_C.DeviceLoop): begin plans, acquires and prefetches; end reports the
    backward and releases."""
    return _C.DeviceLoop(scheduler, engine, index, PLAN_UNITS, COMMITTED_UNITS, PREFETCH_BEYOND_NEXT_BYTES,
                         HOLD_FOR_STEPS)


@dataclass
class DeviceSlot:
    index: int
    device: torch.device
    engine: object            # _C.DeviceEngine
    scheduler: object = None  # _C.Scheduler
    runners: list = None      # TaskRunner per task id
    stop: object = None       # interrupts.StopRequest: once set, tasks end at their next step boundary
    checkpoints: object = None  # checkpoint_writer.Checkpointer, when the run keeps checkpoints
    inbox: object = None        # inbox.Inbox: engine work other threads ask of this one
    open_run: object = None     # arrivals.OpenRun: told of every task that ends (it leaves the engines at once)
    peers: list = None          # every device's slot, this one included
    loop: object = None         # _C.DeviceLoop (make_loop)
    saved: SavedBytes = field(default_factory=SavedBytes)  # what micro-batches in flight hold here
    budget_split: dict = None   # the budget's split between the arena, a unit's working set and saved activations
    # ht.train's placement, and what the lane model was told and forecast as the call started (Results.lane_plan;
    # None: not asked): a task added to the run (joining it, re-planned) or placed again steps shards on the device
    # as they say (lane_choice.added_device_shards).
    placement: str = "host"
    lane_plan: dict = None
    thread: int = None          # the worker's thread (threading.get_ident), once it runs


def device_worker(slot: DeviceSlot, trace: list, lock: threading.Lock, threads_per_device: int | None):
    """Runs units until the scheduler has none left for this device. A KeyboardInterrupt (on the main thread)
    propagates after the interrupted unit's shard has been released; the caller cancels the scheduler."""
    slot.thread = threading.get_ident()
    previous_device = torch.cuda.current_device() if slot.device.type == "cuda" else None
    if slot.device.type == "cuda":
        torch.cuda.set_device(slot.device)
    if threads_per_device is not None:
        torch.set_num_threads(threads_per_device)
    try:
        _run_units(slot, trace, lock)
    finally:
        if previous_device is not None:
            torch.cuda.set_device(previous_device)  # device 0's worker is the caller's own thread


def _next_unit(slot: DeviceSlot):
    # Waits in short slices: Python runs a Ctrl-C handler on the main thread only between them, and between
    # them a worker does what other threads ask of its engine (a task joining, leaving or re-planned).
    while True:
        slot.inbox.drain()
        if slot.open_run is not None and slot.stop is not None and slot.stop.is_set():
            slot.scheduler.set_open(False)  # stopping: no more arrivals, the run ends with the tasks in it
        unit = slot.scheduler.next_for(slot.index, 0.05)
        if unit is not None or slot.scheduler.cancelled() or not slot.scheduler.has_work(slot.index):
            return unit


def _run_units(slot: DeviceSlot, trace: list, lock: threading.Lock):
    clock = unit_clock.for_device(slot.device)
    try:
        while True:
            unit = _next_unit(slot)
            if unit is None:
                return
            if not _settle(slot, unit, lock):
                continue
            if _stop_asked(slot, slot.runners[unit.task]) and _cut_short(slot, unit):
                continue
            _checkpoint_if_due(slot, slot.runners[unit.task])
            if not _placed_anew(slot, unit, lock):
                continue
            _run_unit(slot, unit, clock, trace, lock)
    finally:
        try:
            if clock is not None:
                clock.poll(wait=True)
        finally:
            slot.inbox.close()


def _settle(slot: DeviceSlot, unit, lock: threading.Lock) -> bool:
    """Before the task's next unit: its clipped step queued last is counted once its norm is read (see
    TaskRunner.settle_step), so a stop, a checkpoint or a selection rule sees it. If the norm was not finite, or a
    selection rule stops the task at this step, the task ends here without running `unit`; returns False then."""
    runner = slot.runners[unit.task]
    failed = False
    try:
        runner.settle_step()
    except Exception as error:
        with lock:
            runner.error = runner.error or error  # a device error of its last unit may have come first
        failed = True
    if not failed and runner.stopped is None:
        return True
    _end_without(slot, unit, runner)
    return False


def _end_without(slot: DeviceSlot, unit, runner):
    """Ends the task here, without running `unit`."""
    slot.scheduler.fail(unit.task)  # drops its remaining units; handing this one back ends the task
    slot.scheduler.complete(slot.index, unit, None)
    _leave_if_ended(slot, unit, runner)


def _placed_anew(slot: DeviceSlot, unit, lock: threading.Lock) -> bool:
    """Before the task's next unit: placed again if a task has left the run since it was placed (run/replacement.py).
    If it could not be added back to any engine, it ends here with that error, without running `unit`; if it was
    added back on one device only, `unit` goes back to the scheduler, for that device. Returns False then."""
    runner = slot.runners[unit.task]
    home = runner.home
    why_not = replacement.replace_if_due(slot, runner)
    if why_not is None and runner.home == home:
        return True
    if why_not is None:
        replacement.pin(slot, runner, unit)
        return False
    with lock:
        runner.error = runner.error or RuntimeError(why_not)
    _end_without(slot, unit, runner)
    return False


def _checkpoint_if_due(slot: DeviceSlot, runner):
    """At a step boundary of a task due a checkpoint: its pending steps are waited for and its resident state
    copied home, then the state goes to the background writer (see Checkpointer.submit). Other tasks run on
    meanwhile."""
    if slot.checkpoints is None or not runner.at_step_boundary() or not slot.checkpoints.due(runner):
        return
    _checkpoint(slot, runner)


def _checkpoint(slot: DeviceSlot, runner):
    model = runner.model_ids[slot.index]
    slot.engine.snapshot(model)
    slot.checkpoints.submit(runner, resident=slot.engine.resident(model))


def _stop_asked(slot: DeviceSlot, runner) -> bool:
    return (slot.stop is not None and slot.stop.is_set()) or runner.task.stop_reason is not None


def _cut_short(slot: DeviceSlot, unit) -> bool:
    """After a stop request (a signal, or the task's own request_stop): ends the task here, without running
    `unit`, if it sits at a step boundary. A task in the middle of a step runs on until the step is applied to
    every shard."""
    runner = slot.runners[unit.task]
    if not runner.at_step_boundary():
        return False
    own = slot.stop is None or not slot.stop.is_set()
    runner.cut_short = runner.task.stop_reason if own else slot.stop.name
    if own:
        runner.task.stopped_on_request = True
        if slot.checkpoints is not None:  # it goes on elsewhere: its state is on disk before it ends here
            slot.checkpoints.wait(runner)  # an earlier write may still read the store the snapshot rewrites
            _checkpoint(slot, runner)
            slot.checkpoints.wait(runner)
    _end_without(slot, unit, runner)
    return True


def _leave_if_ended(slot: DeviceSlot, unit, runner):
    if slot.scheduler.finished(unit.task):
        runner.settle_at_end()  # its last step, if clipped
        runner.task.ended.set()
        if slot.open_run is not None:
            slot.open_run.ended(runner)


def _visit(slot: DeviceSlot, unit, runner) -> int:
    """The unit's shard visit: the runner's compute (which begins the visit on the loop where its compute
    starts), the loop's end (the shard released however the compute ended), then what the runner does once
    the shard's backward is reported. Returns the bytes copied to the device meanwhile."""
    try:
        backward = runner.run_unit(unit, slot)
    except BaseException:
        slot.loop.end(unit, None)
        raise
    copied = slot.loop.end(unit, backward)
    runner.unit_ended(unit, slot, backward)
    return copied


def _run_unit(slot: DeviceSlot, unit, clock, trace: list, lock: threading.Lock):
    runner = slot.runners[unit.task]
    start = time.perf_counter()
    mark = clock.start() if clock is not None else None
    plan = len(runner.replans)
    fatal = None
    failed = retried = False
    copied = 0
    try:
        copied = _visit(slot, unit, runner)
        if runner.stopped is not None:  # a selection rule stopped it here, at a step boundary
            slot.scheduler.fail(unit.task)
    except Exception as error:  # the task ends, unless it ran out of memory and can be re-planned; the others go on
        copied = slot.loop.copied()
        retried = replan.retry(slot, unit, runner, error)
        if not retried:
            runner.note_partial_step(error)
            with lock:
                runner.error = error
            slot.scheduler.fail(unit.task)
            failed = True
    except BaseException as error:  # Ctrl-C or an exit: the task ends, and so does this worker
        copied = slot.loop.copied()
        runner.note_partial_step(error)
        with lock:
            runner.error = runner.error or error
        slot.scheduler.fail(unit.task)
        fatal = error
        failed = True

    def record(begin, end):
        with lock:
            trace.append(TraceEntry(slot.index, unit.task, runner.task.name, unit.index, unit.shard,
                                    str(unit.phase).rsplit(".", 1)[-1], begin, end, copied))

    if retried:  # the scheduler has its step again, in the new plan
        record(start, time.perf_counter())
    elif clock is not None and not failed:
        # The task's next unit may start at once, on any device (streams order it after this one); the cost
        # model learns this unit's time once the device has run it.
        slot.scheduler.complete(slot.index, unit, None)

        def measured(begin, end):
            if len(runner.replans) == plan:  # else the unit belongs to a plan the cost model has forgotten
                slot.scheduler.observe(unit, max(end - begin, 1e-9))
            record(begin, end)

        def device_failed(error):  # the device reported an error of this unit after it was completed
            with lock:
                runner.error = runner.error or error
            slot.scheduler.fail(unit.task)
            _leave_if_ended(slot, unit, runner)  # a run open to arrivals would otherwise wait for it forever
        clock.stop(mark, measured, device_failed)
    else:
        end = time.perf_counter()
        slot.scheduler.complete(slot.index, unit, max(end - start, 1e-9))
        record(start, end)
    if fatal is None:
        _leave_if_ended(slot, unit, runner)
    if fatal is not None:
        raise fatal
