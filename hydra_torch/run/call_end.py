"""The end of an ht.train call, once its workers have stopped: every model brought home, the results gathered,
and the user told of stops, re-plans and failed tasks."""
from __future__ import annotations

import signal
import sys
import time
import warnings

from hydra_torch._loader import native as _C
from hydra_torch.report.results import Results, StepEntry
from hydra_torch.run import lifecycle
from hydra_torch.state import interrupts


def bring_home(runners, engines, checkpoints):
    """Every task still in the run (the others left when they ended) written back into its model, its final
    checkpoint taken; every checkpoint written and the tasks' directories let go, however this ends."""
    try:
        for runner in runners:
            if runner.result is None:
                lifecycle.bring_home(runner, engines, checkpoints)
    finally:
        if checkpoints is not None:
            checkpoints.close()


def results_of(runners, engines, workers, start, devices, wall, checkpoints, host_threads: int) -> Results:
    """What the call returns: every task's result, the trace and the engines' statistics. Each task's part in
    the call is then over: a stop request ends with it, and `task.ended` is set."""
    trace, stop = workers.trace, workers.stop
    for runner in runners:
        if runner.result is None:
            runner.result = lifecycle.task_result(runner, engines, trace, start)
    names = [str(d) for d in devices]
    if len(set(names)) < len(names):  # virtual devices: number them
        names = [f"{name}[{i}]" for i, name in enumerate(names)]
    stats = [_device_stats(engine, slot, host_threads) for engine, slot in zip(engines, workers.slots)]
    results = Results([r.result for r in runners], names, stats, sorted(trace, key=lambda e: e.start), wall,
                      checkpoint_failures=checkpoints.failures if checkpoints is not None else 0)
    results.interrupted = stop.name
    results.steps = step_entries(engines, runners)
    results.bases = {r.base.base.name: r.base.summary(engines) for r in runners if r.base is not None}
    for runner in runners:
        runner.task.stop_reason = None  # a request ends with the call
        runner.task.cut_short_after = runner.steps if runner.cut_short else None
        runner.task.ended.set()
    return results


def step_entries(engines, runners) -> list[StepEntry]:
    """Every shard step the engines logged (engine/step_log.h), on perf_counter's clock as the trace is."""
    offset = time.perf_counter() - _C.steady_seconds()
    names = {runner.index: runner.task.name for runner in runners}
    steps = [StepEntry(device, task, names[task], shard, step, place, start + offset, end + offset)
             for device, engine in enumerate(engines)
             for task, shard, step, place, start, end in engine.step_log() if task in names]
    return sorted(steps, key=lambda e: e.start)


def _device_stats(engine, slot, host_threads: int) -> dict:
    """The engine's statistics, the budget's split, the most bytes the micro-batches in flight held there, and the
    host-step threads its steps shared with the other devices'."""
    return {**engine.stats(), **(slot.budget_split or {}), "saved_high_water_bytes": slot.saved.high_water,
            "host_threads": host_threads}


def tell(results, stop, checkpoints, checkpoint_dir):
    """Warns of a stop at step boundaries (and passes SIGTERM on), of re-plans and of failed tasks."""
    if stop.is_set():
        cut = [r.name for r in results if r.cut_short]
        passed_on = stop.signal != signal.SIGINT
        if passed_on and checkpoints is not None and sys.stderr is not None:  # None: a process started with 2>&-
            sys.stderr.write(f"{stop.name}: every task stopped at a step boundary and was checkpointed in "
                             f"{checkpoint_dir}; the same ht.train call with checkpoint_dir={checkpoint_dir!r} "
                             "resumes it\n")
        try:  # a warnings filter that raises (python -W error) must not keep the signal from the previous handler
            warnings.warn(f"training stopped by {stop.name} at step boundaries; {len(cut)} of {len(results)} tasks "
                          f"cut short{': ' + ', '.join(cut) if cut else ''}", RuntimeWarning, stacklevel=3)
        finally:
            if passed_on:
                interrupts.deliver(stop.signal)
    for result in results:
        if result.replans:
            warnings.warn(f"task {result.name!r} ran out of device memory and was re-planned "
                          f"{len(result.replans)} time(s), last at {result.replans[-1]}; give it smaller shards or "
                          "more memory to spare the retries", RuntimeWarning, stacklevel=3)
        if result.error is not None:
            warnings.warn(f"task {result.name!r} stopped: {result.error}", RuntimeWarning, stacklevel=3)
