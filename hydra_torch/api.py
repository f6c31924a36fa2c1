"""ht.train: trains a list of tasks on one or more devices in one call."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings

import torch

from hydra_torch import testing
from hydra_torch._loader import native as _C
from hydra_torch.models import memory, planner, sharding
from hydra_torch.models.memory import parse_budget
from hydra_torch.report.results import Results
from hydra_torch.run import lifecycle
from hydra_torch.run.inbox import Inbox
from hydra_torch.run.progress import Progress
from hydra_torch.run.runner import TaskRunner
from hydra_torch.run.workers import DeviceSlot, device_worker, make_loop
from hydra_torch.selection.arrivals import Arrivals, OpenRun
from hydra_torch.selection.rules import Selection
from hydra_torch.state import checkpoint, interrupts, task_rng
from hydra_torch.task import ModelTask, check_own_models


def resolve_devices(devices) -> list[torch.device]:
    """"auto" (the first GPU, else the CPU), a device, or a list of devices. Repeating "cpu" k times gives
    k virtual CPU devices (one intra-op thread each)."""
    if devices == "auto":
        return [torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    try:
        resolved = [torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"cannot read devices={devices!r}: {error}") from None
    if not resolved:
        raise ValueError("devices is empty")
    out = []
    for device in resolved:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device} was asked for but CUDA is not available")
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
            if device.index >= torch.cuda.device_count():
                raise ValueError(f"device {device} does not exist: {torch.cuda.device_count()} CUDA devices")
            if device in out:
                raise ValueError(f"device {device} is listed twice")
        elif device.type != "cpu":
            raise ValueError(f"unsupported device {device}: use CPU or CUDA devices")
        out.append(device)
    if any(d.type == "cpu" for d in out) and any(d.type == "cuda" for d in out):
        raise ValueError("mixing CPU and CUDA devices in one call is not supported")
    return out


def _pin(pin_memory, devices) -> bool:
    if pin_memory == "auto":
        return any(d.type != "cpu" for d in devices)  # a CPU device copies host to host: pinning buys nothing
    return bool(pin_memory)


def _host_step_threads(host_threads) -> int:
    if host_threads is None:
        # Host steps stream through memory: a few threads saturate it, and the rest of the cores issue compute.
        return max(1, min(4, (os.cpu_count() or 1) // 2))
    if isinstance(host_threads, bool) or not isinstance(host_threads, int) or host_threads < 1:
        raise ValueError(f"host_threads must be a positive int, got {host_threads!r}")
    return host_threads


def _check_seed(seed):
    # The random policy's generator takes 64 unsigned bits: outside them the native call would fail with its
    # signature instead of the argument's name.
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")


def _check_checkpoint_dir(checkpoint_dir):
    if checkpoint_dir is None:
        return
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path (a str or os.PathLike), got {type(checkpoint_dir).__name__}")
    if not os.fspath(checkpoint_dir):
        raise ValueError("checkpoint_dir is an empty path: name a directory (e.g. 'checkpoints')")


_ONE_CALL = threading.Lock()
_running_in: str | None = None  # the thread whose call holds _ONE_CALL, for the error a second call gets


def train(tasks, devices="auto", memory_budget=None, schedule: str = "lrtf", pin_memory="auto",
          progress: bool = True, seed: int = 0, host_threads: int | None = None, checkpoint_dir=None,
          checkpoint_every=None, selection=None, arrivals=None) -> Results:
    """Trains every task concurrently and returns their results; the user's modules hold the trained weights.

    devices: "auto" (the first GPU, else the CPU), a device such as "cuda:0", or a list of devices; a list
        like ["cpu"] * 4 gives four virtual CPU devices with one thread each.
    memory_budget: per device, the bytes of training state it may hold: an int ("4096"), "8GiB", "512MB", or a
        fraction of free memory (0.8, "0.8", "80%"; virtual CPU devices split it). A model whose whole training
        state fits stays resident on one device;
        otherwise its shards are spilled to host memory and visit the devices in turn.
    schedule: which ready task a free device runs next: "lrtf" (longest remaining time first), "fifo",
        "round_robin" or "random" (seeded by `seed`).
    pin_memory: "auto" (pin host buffers for accelerator devices), True or False.
    progress: tqdm progress bars, one per task and a total.
    host_threads: threads for the host optimizer steps of spilled models, shared by all devices (default:
        half the cores, at most 4).
    checkpoint_dir: a directory for each task's checkpoints (weights, optimizer state, data position, random
        states, losses). A task with a checkpoint there continues from it: the same call after a crash resumes
        every task, and ends as the uninterrupted run would have. Also written when a task ends or is stopped.
        A checkpoint of another model, optimizer, learning rate, lr_schedule or warmup_steps (a callable
        lr_schedule is told only from a named one), or of more steps than the task now takes, is refused. The
        call holds each task's directory (a lock file in it) until it returns, however it ends: another run of
        the same task, in another process or this one, is refused with the holder's pid and host; a process
        that dies (even by SIGKILL) lets go, so its tasks resume.
    checkpoint_every: steps (an int) or a duration ("10min", "30s") between a task's checkpoints; default
        "10min". Only with checkpoint_dir.
    selection: a rule that stops the worse tasks early, such as ht.SuccessiveHalving(min_steps=20); the devices
        go to the others at once. A stopped task's result says when and why (`TaskResult.stopped`).
    arrivals: a hydra_torch.arrivals.Arrivals through which more tasks join while the devices train (how
        hydra_torch.optuna runs its trials); each task then leaves the run, its weights written back, as soon
        as it ends. The call returns once the Arrivals is closed and every task is done.

    A task that fails (say its loss becomes NaN) stops with its last good weights, its error in its result;
    the others finish. A task whose unit runs out of device memory is re-planned instead (spilled if it was
    resident, else cut into shards half the size) and its step retried with the same batches and random draws,
    while the others go on; `TaskResult.replans` says what happened. Ctrl-C (or SIGTERM) stops every task at
    its next step boundary, writes the weights back and returns the results so far, the tasks it cut short
    marked (`TaskResult.cut_short`); SIGTERM is then passed on to the handler that was there before. A second
    Ctrl-C stops at once: the weights still come home, steps in progress are left half-applied, and
    KeyboardInterrupt propagates.

    One call at a time in a process: every call's tasks draw from the process's one CPU random generator, so
    a second call while one runs (from another thread, or a callback) raises RuntimeError before it touches
    anything. Several calls' tasks train together when passed to one call.
    """
    global _running_in
    if not _ONE_CALL.acquire(blocking=False):
        raise RuntimeError(f"another ht.train call is running in this process (in thread {_running_in!r}): its "
                           "tasks and this call's would draw from the one CPU random generator of the process. "
                           "Pass all the tasks to one call, or make this call after it returns")
    _running_in = threading.current_thread().name
    try:
        return _train(tasks, devices, memory_budget, schedule, pin_memory, progress, seed, host_threads,
                      checkpoint_dir, checkpoint_every, selection, arrivals)
    finally:
        _running_in = None
        _ONE_CALL.release()


def _train(tasks, devices, memory_budget, schedule, pin_memory, progress, seed, host_threads, checkpoint_dir,
           checkpoint_every, selection, arrivals) -> Results:
    if isinstance(tasks, ModelTask):
        tasks = [tasks]
    tasks = list(tasks)
    if not tasks or not all(isinstance(t, ModelTask) for t in tasks):
        raise TypeError("train() takes a non-empty list of ModelTask")
    if len({t.name for t in tasks}) != len(tasks):
        raise ValueError("task names must be unique")
    check_own_models(tasks)
    for task in tasks:
        task.check_unchanged()
    if selection is not None:
        if not isinstance(selection, Selection):
            raise TypeError(f"selection must be a hydra_torch.SuccessiveHalving(...), got {type(selection).__name__}")
        selection.check(tasks)
    if arrivals is not None:
        if not isinstance(arrivals, Arrivals):
            raise TypeError(f"arrivals must be a hydra_torch.arrivals.Arrivals, got {type(arrivals).__name__}")
        if checkpoint_dir is not None:
            raise ValueError("checkpoint_dir cannot be combined with arrivals: a resumed run could not know which "
                             "tasks had joined it")
    try:
        _C.parse_policy(schedule)
    except ValueError as error:
        raise ValueError(f"unknown schedule {schedule!r}: {error}") from None
    _check_seed(seed)
    _check_checkpoint_dir(checkpoint_dir)
    resolved = resolve_devices(devices)
    # Virtual CPU devices share one memory: a fraction of it (or the default) is split between them.
    budgets = [parse_budget(memory_budget, d, sharing=resolved.count(d) if d.type == "cpu" else 1) for d in resolved]
    loaded = _load_checkpoints(tasks, checkpoint_dir, checkpoint_every)
    memory.check_host_memory(tasks)
    host_steps = _C.HostSteps(_host_step_threads(host_threads))
    pin = _pin(pin_memory, resolved)

    for task in tasks:
        planner.plan_for_devices(task, resolved, budgets)
    link = testing.link_bytes_per_second()
    engines = [_C.DeviceEngine(str(d), b, host_steps, link) for d, b in zip(resolved, budgets)]
    for engine in engines if arrivals is not None else ():
        engine.expect_arrivals()
    task_rng.new_run()
    for task in tasks:
        task.stopped_on_request = False
        task.ended.clear()
    start_rng = task_rng.TaskRng.current(resolved[0])
    runners = [TaskRunner(task, i, start_rng) for i, task in enumerate(tasks)]
    lifecycle.place(runners, engines, pin)
    for runner, state in zip(runners, loaded):
        if state is not None:
            checkpoint.restore(state, runner)
    del loaded
    selection_run = selection.start(runners) if selection is not None else None
    # Shard costs rank tasks nothing has been timed of yet by their size, not as if all were alike.
    specs = [r.scheduler_spec(sharding.shard_costs(r.task.modules)) for r in runners]
    scheduler = _C.Scheduler(specs, len(engines), schedule, seed)
    stop = interrupts.StopRequest()
    # It holds the tasks' checkpoint directories until _finish closes it: made as late as can be, so that little
    # can fail between here and the workers' try.
    checkpoints = (checkpoint.Checkpointer(checkpoint_dir, checkpoint_every, runners) if checkpoint_dir is not None
                   else None)
    slots = [DeviceSlot(i, d, e, scheduler, runners, stop, checkpoints, Inbox(), loop=make_loop(scheduler, e, i))
             for i, (d, e) in enumerate(zip(resolved, engines))]
    for slot in slots:
        slot.peers = slots

    trace, lock = [], threading.Lock()
    open_run = None
    if arrivals is not None:
        open_run = OpenRun(slots=slots, scheduler=scheduler, runners=runners, devices=resolved, budgets=budgets,
                           pin=pin, start_rng=start_rng, trace=trace, trace_lock=lock, start=time.perf_counter(),
                           stop=stop, selection=selection_run, on_ended=arrivals.on_ended)
        for slot in slots:
            slot.open_run = open_run
        scheduler.set_open(True)
        arrivals.attach(open_run)
    threads_per_device = 1 if len(resolved) > 1 and resolved[0].type == "cpu" else None
    bars = Progress(runners, progress)
    # Device 0's worker is this thread: a fresh thread gets a fresh OpenMP pool, which on a busy CPU fights
    # the pool this thread already has (measured: up to 1.5x slower kernels). Other devices get threads.
    threads = [threading.Thread(target=device_worker, args=(slot, trace, lock, threads_per_device),
                                name=f"hydra-{slot.device}", daemon=True) for slot in slots[1:]]
    threads_before = torch.get_num_threads()
    start = open_run.start if open_run is not None else time.perf_counter()
    interrupted = None
    try:
        with interrupts.stop_requests(stop):
            for thread in threads:
                thread.start()
            device_worker(slots[0], trace, lock, threads_per_device)
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.1)
    except BaseException as interrupt:  # Ctrl-C, or a fatal error: stop the others, then write weights back
        interrupted = interrupt
    # Whatever arrives now (a second Ctrl-C) waits until every worker has stopped and every model is home.
    with interrupts.deferred():
        if interrupted is not None:
            scheduler.cancel()
            for thread in threads:
                thread.join()
        if open_run is not None:
            open_run.workers_gone()
        torch.set_num_threads(threads_before)
        wall = time.perf_counter() - start
        for runner in runners:  # a clipped step queued before the run stopped is counted while the bars are open
            runner.settle_at_end()
        bars.close(runners)
        results = _finish(runners, engines, trace, start, resolved, wall, checkpoints)
        results.interrupted = stop.name
        for runner in runners:
            runner.task.stop_reason = None  # a request ends with the call
            runner.task.ended.set()
    if interrupted is not None:
        raise interrupted
    if stop.is_set():
        cut = [r.name for r in results if r.cut_short]
        warnings.warn(f"training stopped by {stop.name} at step boundaries; {len(cut)} of {len(results)} tasks "
                      f"cut short{': ' + ', '.join(cut) if cut else ''}", RuntimeWarning, stacklevel=3)
        if stop.signal != signal.SIGINT:
            if checkpoints is not None:
                sys.stderr.write(f"{stop.name}: every task stopped at a step boundary and was checkpointed in "
                                 f"{checkpoint_dir}; the same ht.train call with checkpoint_dir={checkpoint_dir!r} "
                                 "resumes it\n")
            interrupts.deliver(stop.signal)
    for result in results:
        if result.replans:
            warnings.warn(f"task {result.name!r} ran out of device memory and was re-planned "
                          f"{len(result.replans)} time(s), last at {result.replans[-1]}; give it smaller shards or "
                          "more memory to spare the retries", RuntimeWarning, stacklevel=3)
        if result.error is not None:
            warnings.warn(f"task {result.name!r} stopped: {result.error}", RuntimeWarning, stacklevel=3)
    return results


def _load_checkpoints(tasks, checkpoint_dir, checkpoint_every) -> list:
    """Each task's checkpoint in `checkpoint_dir` (None where it has none), checked against the task before
    anything is allocated."""
    if checkpoint_dir is None:
        if checkpoint_every is not None:
            raise ValueError("checkpoint_every needs checkpoint_dir: where to keep the checkpoints")
        return [None] * len(tasks)
    checkpoint.parse_every(checkpoint_every)
    for task in tasks:  # a name that cannot name a directory is refused before checkpoint_dir is made
        checkpoint.check_name(task.name)
    checkpoint.prepare_directory(checkpoint_dir)
    return [checkpoint.load(checkpoint_dir, task) for task in tasks]


def _finish(runners, engines, trace, start, devices, wall, checkpoints=None) -> Results:
    results = []
    try:
        for runner in runners:
            if runner.result is None:  # else it left the run when it ended (see arrivals)
                lifecycle.bring_home(runner, engines, checkpoints)
                runner.result = lifecycle.task_result(runner, engines, trace, start)
            results.append(runner.result)
    finally:  # the tasks' checkpoint directories are let go however this ends
        if checkpoints is not None:
            checkpoints.close()
    names = [str(d) for d in devices]
    if len(set(names)) < len(names):  # virtual devices: number them
        names = [f"{name}[{i}]" for i, name in enumerate(names)]
    return Results(results, names, [e.stats() for e in engines], sorted(trace, key=lambda e: e.start), wall,
                   checkpoint_failures=checkpoints.failures if checkpoints is not None else 0)
