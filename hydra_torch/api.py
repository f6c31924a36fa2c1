"""ht.train: trains a list of tasks on one or more devices in one call."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable

import torch

from hydra_torch._loader import native as _C
from hydra_torch.models import memory, planner
from hydra_torch.models.memory import parse_budget
from hydra_torch.recipe.reals import integral, whole
from hydra_torch.report.results import Results
from hydra_torch.run import call_end, lifecycle, measuring, saved_bytes
from hydra_torch.run.caller_modes import training_modes
from hydra_torch.run.devices import expandable_segments, host_step_threads, pinned, resolve_devices
from hydra_torch.run.inbox import Inbox
from hydra_torch.run.progress import Progress
from hydra_torch.run.runner import TaskRunner
from hydra_torch.run.workers import DeviceSlot, device_worker, make_loop
from hydra_torch.selection.arrivals import Arrivals, OpenRun
from hydra_torch.selection.rules import Selection
from hydra_torch.state import checkpoint, checkpoint_dirs, interrupts, task_rng
from hydra_torch.state.checkpoint_writer import Checkpointer
from hydra_torch.models import frozen_base
from hydra_torch.task import ModelTask
from hydra_torch.task_checks import check_own_models, warn_eval_mode, warn_restarted


def _check_seed(seed):
    # The random policy's generator takes 64 unsigned bits: outside them the native call would fail with its
    # signature instead of the argument's name.
    if not whole(seed) or seed >= 2**64:
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


@contextlib.contextmanager
def _sole_call():
    """The process's one ht.train call at a time (see train), or RuntimeError before anything is touched."""
    global _running_in
    if not _ONE_CALL.acquire(blocking=False):
        raise RuntimeError(f"another ht.train call is running in this process (in thread {_running_in!r}): its "
                           "tasks and this call's would draw from the one CPU random generator of the process. "
                           "Pass all the tasks to one call, or make this call after it returns")
    _running_in = threading.current_thread().name
    try:
        yield
    finally:
        _running_in = None
        _ONE_CALL.release()


@contextlib.contextmanager
def _serving(arrivals):
    """The call's hold on its Arrivals (one serves one call): when the call ends, whether it trained or raised
    before training, the driver's calls return."""
    if not isinstance(arrivals, Arrivals):  # None, or refused by _checked
        yield
        return
    arrivals.claim()
    try:
        yield
    finally:
        arrivals.end()


def train(tasks, devices="auto", memory_budget=None, schedule: str = "lrtf", pin_memory="auto",
          progress: bool = True, seed: int = 0, host_threads: int | None = None, checkpoint_dir=None,
          checkpoint_every=None, selection=None, arrivals=None, placement: str = "auto") -> Results:
    """Trains every task concurrently and returns their results; the user's modules hold the trained weights.

    devices: "auto" (the first GPU, else the CPU), a device such as "cuda:0", or a list of devices; a list
        like ["cpu"] * 4 gives four virtual CPU devices with one thread each.
    memory_budget: per device, all the memory the run uses there: an int ("4096"), "8GiB", "512MB", or a
        fraction of free memory (0.8, "0.8", "80%"; virtual CPU devices split it). It holds the training state
        (the arena), one unit's working set, and the saved activations of the micro-batches in flight, which
        the scheduler keeps within what is left (results.summary() shows the split). A model whose whole
        training state fits stays resident on one device; otherwise its shards are spilled to host memory and
        visit the devices in turn. On CUDA the caching allocator grows its segments in place
        (expandable_segments:True) unless PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF is set.
    schedule: which ready task a free device runs next: "lrtf" (longest remaining time first), "fifo",
        "round_robin" or "random" (seeded by `seed`).
    pin_memory: "auto" (pin host buffers for accelerator devices), True or False.
    progress: tqdm progress bars, one per task and a total.
    host_threads: threads for the host optimizer steps of spilled models, shared by all devices (default: with
        GPUs, the cores their workers and copy lanes leave (3 each), at most 4, each step's OpenMP team sized so
        the threads together use those cores; on CPU devices half the cores, at most 4).
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
    placement: where a spilled task's shards live and step. "auto": on one device, its first and last shards
        stay resident where the budget has room for their whole state beside every task's working set and,
        beside other spilled tasks, still caches every spilled shard's weights (they step on the device, and the
        next step's forward need not wait for the first shard's round trip through the host). Where the device's
        lanes are apart (a GPU; a CPU device only with an emulated link or host, hydra_torch.testing), the lane
        model then weighs each other shard's step on the host against the device from the lanes' rates measured at
        the start and each layer's measured compute, and keeps the shortest simulated run: more shards resident,
        stepped on the device (see "device"), or on the host (hydra_torch.run.lane_choice). On several devices
        a spilled task keeps no shard resident (its units run on any device), and the lane model steps shards on
        the devices only of a task with one micro-batch a step and no clipping, and only where the host's
        memory bounds the run. A task joining later spills
        every shard.
        "host": every shard of a spilled task is spilled.
        "device": as "auto", and every other shard of a spilled task steps on the device: its gradients stay
        there, its fp32 master and optimizer state come in after its backward and go home with its new weights,
        so the host does no arithmetic for it; as many as the budget holds (each step's regions beside a unit,
        and on one device with accumulation or clipping a gradient buffer per shard for the run), first shards
        first. Shards that share a tied weight (an embedding and its head) step on the device together or not
        at all: the tie's owner keeps a gradient buffer for the run, where the head's gradient of it waits for
        the embedding's. On several devices each untied shard steps on the device that ran its backward, and
        only for a task with one micro-batch a step and no clipping (its gradients would otherwise be summed on
        several devices). Worth it where
        the host's memory bandwidth, not the link, binds the run (results.lanes() says which). Not for a bf16
        task that sums micro-batches (as "auto" keeps its ends spilled).
        `TaskResult.placement` says what each task got.

    A task that fails (say its loss becomes NaN) stops with its last good weights, its error in its result;
    the others finish. A task whose unit runs out of device memory is re-planned instead (spilled if it was
    resident, else cut into shards half the size) and its step retried with the same batches and random draws,
    while the others go on; `TaskResult.replans` says what happened. Ctrl-C (or SIGTERM) stops every task at
    its next step boundary, writes the weights back and returns the results so far, the tasks it cut short
    marked (`TaskResult.cut_short`); SIGTERM is then passed on to the handler that was there before. A second
    Ctrl-C stops at once: the weights still come home, steps in progress are left half-applied, and
    KeyboardInterrupt propagates. A later call trains a task cut short from the start of its data, schedule and
    optimizer state again, from its weights as they are, and warns so, unless checkpoint_dir resumes it.

    One call at a time in a process: every call's tasks draw from the process's one CPU random generator, so
    a second call while one runs (from another thread, or a callback) raises RuntimeError before it touches
    anything. Several calls' tasks train together when passed to one call. A call under torch.no_grad() or
    torch.inference_mode() (a notebook cell's) trains and measures with gradients; under torch.autocast it warns
    and trains as without (precision="bf16" is the tasks' mixed precision); the caller's modes stay as they were.
    """
    # The first device's units run in this thread.
    with _serving(arrivals), _sole_call(), training_modes("ht.train", stacklevel=1):
        seed, host_threads, checkpoint_every = map(integral, (seed, host_threads, checkpoint_every))  # np.int64(3)
        tasks = _checked(tasks, schedule, seed, checkpoint_dir, selection, arrivals, placement)
        resolved = resolve_devices(devices)
        pin = pinned(pin_memory, resolved)
        threads, team = host_step_threads(host_threads, resolved)
        budgets = _budgets(resolved, memory_budget)
        loaded = _load_checkpoints(tasks, checkpoint_dir, checkpoint_every)
        checkpoint.check_selection(checkpoint_dir, tasks, loaded, selection)
        warn_restarted(tasks, loaded, stacklevel=2)
        memory.check_host_memory(tasks)
        host_steps = _C.HostSteps(threads, team)
        expandable_segments(resolved)  # before the planner's probes: the run's first device allocation
        planner.plan_for_devices(tasks, resolved, budgets)
        # The others' working sets and saved inputs, and where "auto" asks the lane model their units' compute.
        measuring.measure_tasks(tasks, resolved, budgets, time_units=placement == "auto")
        kept_outside = saved_bytes.kept_outside_arena(tasks)  # (working set, saved inputs)
        engines = lifecycle.make_engines(resolved, budgets, host_steps, sum(kept_outside), arrivals)
        runners, start_rng = _runners(tasks, resolved)
        # From train itself: the stack level of its warning counts on it.
        lane_plan = lifecycle.place(runners, engines, resolved, pin, saved_bytes.graphs_beyond_inputs(tasks),
                                    sum(kept_outside), placement)
        _restore_checkpoints(runners, loaded)
        selection_run = selection.start(runners) if selection is not None else None
        # The checkpointer holds the tasks' checkpoint directories until call_end.bring_home closes it, or an error
        # before the workers start does.
        checkpoints = _checkpointer(runners, checkpoint_dir, checkpoint_every)
        with _closed_on_error(checkpoints):
            workers = _Workers(runners, resolved, engines, schedule, seed, checkpoints, placement, lane_plan)
            _share_budgets(workers, engines, budgets, tasks)
            open_run = _open_run(arrivals, workers, runners, resolved, budgets, pin, start_rng, selection_run,
                                 kept_outside)
            bars = Progress(runners, progress)
        start = open_run.start
        interrupted = workers.run()
        # Whatever arrives now (a second Ctrl-C) waits until every worker has stopped and every model is home.
        with interrupts.deferred():
            workers.end(interrupted, open_run)
            wall = time.perf_counter() - start
            for runner in runners:  # a clipped step queued before the run stopped is counted while the bars are open
                runner.settle_at_end()
            bars.close(runners)
            call_end.bring_home(runners, engines, checkpoints)
            results = call_end.results_of(runners, engines, workers, start, resolved, wall, checkpoints, threads)
            results.lane_plan = lane_plan
        if interrupted is not None:
            raise interrupted
        call_end.tell(results, workers.stop, checkpoints, checkpoint_dir)
        return results

def _checked(tasks, schedule, seed, checkpoint_dir, selection, arrivals, placement) -> list[ModelTask]:
    """The tasks as a list, once everything about the call that can be checked before any state exists is."""
    lifecycle.check_placement(placement)
    if isinstance(tasks, ModelTask):
        tasks = [tasks]
    if isinstance(tasks, dict):  # iterating it would give its keys
        raise TypeError("train() takes a non-empty list of ModelTask, and got a dict of them: pass its values, "
                        "list(tasks.values())")
    tasks = list(tasks) if isinstance(tasks, Iterable) else None
    if not tasks or not all(isinstance(t, ModelTask) for t in tasks):
        raise TypeError("train() takes a non-empty list of ModelTask")
    if len({t.name for t in tasks}) != len(tasks):
        raise ValueError("task names must be unique")
    check_own_models(tasks)
    for task in tasks:
        task.check_unchanged()
        task.check_trains_something()
    frozen_base.check(tasks)
    warn_eval_mode(tasks, stacklevel=3)
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
    return tasks


def _load_checkpoints(tasks, checkpoint_dir, checkpoint_every) -> list:
    """Each task's checkpoint in `checkpoint_dir` (None where it has none), checked against the task before
    anything is allocated."""
    if checkpoint_dir is None:
        if checkpoint_every is not None:
            raise ValueError("checkpoint_every needs checkpoint_dir: where to keep the checkpoints")
        return [None] * len(tasks)
    checkpoint.parse_every(checkpoint_every)
    for task in tasks:  # a name that cannot name a directory is refused before checkpoint_dir is made
        checkpoint_dirs.check_name(task.name)
    checkpoint_dirs.prepare_directory(checkpoint_dir)
    return [checkpoint.load(checkpoint_dir, task) for task in tasks]


def _budgets(devices, memory_budget) -> list[int]:
    """Each device's budget in bytes. Virtual CPU devices share one memory: a fraction of it (or the default) is
    split between them."""
    return [parse_budget(memory_budget, d, sharing=devices.count(d) if d.type == "cpu" else 1) for d in devices]


def _runners(tasks, devices) -> tuple[list[TaskRunner], task_rng.TaskRng]:
    """A runner per task, and the generators' state every task's own random streams start from."""
    task_rng.new_run()
    for task in tasks:
        task.stopped_on_request = False
        task.ended.clear()
    start_rng = task_rng.TaskRng.current(devices[0])
    return [TaskRunner(task, i, start_rng) for i, task in enumerate(tasks)], start_rng


def _restore_checkpoints(runners, loaded: list):
    """Each placed task continues from its checkpoint, if it has one; the loaded copies are let go."""
    for runner, state in zip(runners, loaded):
        if state is not None:
            checkpoint.restore(state, runner)
    loaded.clear()


def _checkpointer(runners, checkpoint_dir, checkpoint_every):
    """The run's checkpoint writer, when it keeps checkpoints: it holds each task's directory (see Checkpointer)."""
    if checkpoint_dir is None:
        return None
    return Checkpointer(checkpoint_dir, checkpoint_every, runners)


@contextlib.contextmanager
def _closed_on_error(checkpoints):
    """Lets go of the tasks' checkpoint directories if the block raises."""
    try:
        yield
    except BaseException:
        if checkpoints is not None:
            checkpoints.close()
        raise


class _Workers:
    """One worker per device over one native Scheduler: device 0's is the calling thread (a fresh thread gets a
    fresh OpenMP pool, which on a busy CPU fights the pool this thread already has: measured, up to 1.5x slower
    kernels), the other devices' get threads."""

    def __init__(self, runners, devices, engines, schedule, seed, checkpoints, placement: str, lane_plan):
        specs = [r.scheduler_spec() for r in runners]
        self.scheduler = _C.Scheduler(specs, len(engines), schedule, seed)
        self.stop = interrupts.StopRequest()
        self.slots = [DeviceSlot(i, d, e, self.scheduler, runners, self.stop, checkpoints, Inbox(),
                                 loop=make_loop(self.scheduler, e, i))
                      for i, (d, e) in enumerate(zip(devices, engines))]
        for slot in self.slots:
            slot.peers, slot.placement, slot.lane_plan = self.slots, placement, lane_plan
        self.trace, self.lock = [], threading.Lock()
        self.threads_per_device = 1 if len(devices) > 1 and devices[0].type == "cpu" else None
        self.threads = [threading.Thread(target=device_worker, name=f"hydra-{slot.device}", daemon=True,
                                         args=(slot, self.trace, self.lock, self.threads_per_device))
                        for slot in self.slots[1:]]
        self.threads_before = torch.get_num_threads()

    def run(self) -> BaseException | None:
        """Until every worker has ended. Returns what stopped them early, to be raised once the models are home:
        a second Ctrl-C, or a fatal error."""
        try:
            with interrupts.stop_requests(self.stop):
                for thread in self.threads:
                    thread.start()
                device_worker(self.slots[0], self.trace, self.lock, self.threads_per_device)
                for thread in self.threads:
                    while thread.is_alive():
                        thread.join(0.1)
        except BaseException as interrupt:  # Ctrl-C, or a fatal error: stop the others, then write weights back
            return interrupt
        return None

    def end(self, interrupted, open_run):
        """Every worker stopped (at once, when `interrupted`), what they left undone run, this thread's own
        thread count back."""
        if interrupted is not None:
            self.scheduler.cancel()
            for thread in self.threads:
                thread.join()
        open_run.workers_gone()  # what the workers left of tasks leaving runs here
        torch.set_num_threads(self.threads_before)
        for slot in self.slots:  # the slots' cycles would keep the engines, arenas and all, until a collection
            slot.peers = slot.open_run = None


def _share_budgets(workers, engines, budgets, tasks):
    """Each device's budget split: the arena as placed, one unit's working set (the largest measured),
    and the rest for the saved activations of the micro-batches in flight, which the scheduler keeps within it."""
    working_set = max((t.working_set_bytes for t in tasks), default=0)
    for i, (engine, budget) in enumerate(zip(engines, budgets)):
        share = saved_bytes.allowance(budget, engine.stats()["capacity_bytes"], working_set)
        workers.scheduler.set_saved_allowance(i, share)
        workers.slots[i].budget_split = {"budget_bytes": budget, "working_set_bytes": working_set,
                                         "saved_allowance_bytes": share}


def _open_run(arrivals, workers, runners, devices, budgets, pin, start_rng, selection_run, kept_outside):
    """The running call's side of its tasks' comings and goings: a task that ends leaves the engines at once (its
    device memory freed for the others, which are placed again: run/replacement.py); with arrivals, tasks may join
    from now on too (placed as the workers' slots say: DeviceSlot.placement)."""
    open_run = OpenRun(slots=workers.slots, scheduler=workers.scheduler, runners=runners, devices=devices,
                       budgets=budgets, pin=pin, start_rng=start_rng, trace=workers.trace, trace_lock=workers.lock,
                       start=time.perf_counter(), stop=workers.stop, selection=selection_run,
                       on_ended=arrivals.on_ended if arrivals is not None else None, kept_outside=kept_outside)
    for slot in workers.slots:
        slot.open_run = open_run
    if arrivals is not None:
        workers.scheduler.set_open(True)
        arrivals.attach(open_run)
    return open_run
