"""One thread per device: ask the scheduler for a unit, run it, report its duration."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from hydra_torch.results import TraceEntry


@dataclass
class DeviceSlot:
    index: int
    device: torch.device
    engine: object            # _C.DeviceEngine
    scheduler: object = None  # _C.Scheduler
    runners: list = None      # TaskRunner per task id

    def prefetch(self):
        """Brings in the shard of the unit this device is planned to run next, possibly another task's."""
        planned = self.scheduler.peek(self.index)
        if planned is None:
            return
        model = self.runners[planned.task].model_ids.get(self.index)
        if model is not None:
            self.engine.prefetch(model, planned.shard)

    def plan(self, runner, unit):
        """Tells the engine which shard visits come next here, so eviction keeps the right ones."""
        visits = [(runner.model_ids[self.index], s) for s in runner.upcoming(unit)]
        planned = self.scheduler.peek(self.index)
        if planned is not None and planned.task != unit.task:
            model = self.runners[planned.task].model_ids.get(self.index)
            if model is not None:
                visits.insert(1, (model, planned.shard))
        self.engine.plan(visits)


def device_worker(slot: DeviceSlot, trace: list, lock: threading.Lock, threads_per_device: int | None):
    """Runs units until the scheduler has none left for this device. A KeyboardInterrupt (on the main thread)
    propagates after the interrupted unit's shard has been released; the caller cancels the scheduler."""
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
    if threading.current_thread() is not threading.main_thread():
        return slot.scheduler.next(slot.index)
    # The main thread waits in short slices: Python runs a Ctrl-C handler only between them.
    while True:
        unit = slot.scheduler.next_for(slot.index, 0.05)
        if unit is not None or slot.scheduler.cancelled() or not slot.scheduler.has_work(slot.index):
            return unit


def _run_units(slot: DeviceSlot, trace: list, lock: threading.Lock):
    while True:
        unit = _next_unit(slot)
        if unit is None:
            return
        runner = slot.runners[unit.task]
        start = time.perf_counter()
        copied = slot.engine.host_to_device_bytes()
        fatal = None
        try:
            slot.plan(runner, unit)
            runner.run_unit(unit, slot)
            if slot.device.type == "cuda":
                # The scheduler's cost model needs the unit's device time, not the time to enqueue it.
                torch.cuda.current_stream(slot.device).synchronize()
        except Exception as error:  # the task ends; the others go on
            with lock:
                runner.error = error
            slot.scheduler.fail(unit.task)
        except BaseException as error:  # Ctrl-C or an exit: the task ends, and so does this worker
            with lock:
                runner.error = runner.error or error
            slot.scheduler.fail(unit.task)
            fatal = error
        end = time.perf_counter()
        slot.scheduler.complete(slot.index, unit, max(end - start, 1e-9))
        with lock:
            trace.append(TraceEntry(slot.index, unit.task, runner.task.name, unit.index, unit.shard,
                                    str(unit.phase).rsplit(".", 1)[-1], start, end,
                                    slot.engine.host_to_device_bytes() - copied))
        if fatal is not None:
            raise fatal
