"""Tasks that join a run while the devices train, and tasks that leave it the moment they end.

A driver (hydra_torch.optuna's, say) hands ht.train an `Arrivals` and adds tasks through it from a thread of
its own. Each device's worker registers a newcomer with its engine between two of its units (engines belong
to their worker's thread), then the scheduler hands out the newcomer's units. While arrivals are open the
workers wait for work instead of ending; `close()` lets the run end once the tasks in it are done.

A task that ends (finished, failed, stopped by a selection rule or cut short) leaves at once, in every call
(OpenRun runs without arrivals too): each device's worker waits for the task's work there, the one holding its state
writes the weights back into the model (its final checkpoint taken then, where the call keeps checkpoints), each
releases what its engine holds for it (OpenRun.ended), the tasks still training are placed again in the room it left
(hydra_torch.run.replacement), and with arrivals the driver's `on_ended(result)` hears of it, on a thread of the
run's own (see Arrivals). A task that arrives is spilled: the device arenas were sized when training started.
"""
from __future__ import annotations

import queue
import threading

from hydra_torch.run.caller_modes import training_modes
from hydra_torch.run.inbox import on_devices
from hydra_torch.state import interrupts, task_rng
from hydra_torch.state.run_warnings import warn_in_run


class RunClosedError(RuntimeError):
    """The run no longer takes tasks: it was closed, or stopped by Ctrl-C or SIGTERM."""


class Arrivals:
    """The driver's handle on a run open to arrivals, for one ht.train call (a second is refused: make a new one).
    Once the call ends, whether it trained or raised before training, add raises RunClosedError and close returns.

    `on_ended(result)` is called with each task's TaskResult once it has left the run, one call at a time in the
    order the tasks ended, on a thread of the run's own: not a device's worker, so it may take its time, add
    the next task (keeping K tasks running that way) or close the run. One that raises is a RuntimeWarning
    naming the task and the error; the task's result stays as it trained, and the run and the other callbacks
    go on. ht.train returns once every ended task's callback has returned."""

    def __init__(self, on_ended=None):
        self.on_ended = on_ended
        self._run = None
        self._attached = threading.Event()
        self._gone = "the run ended before it started training"  # what add says once no run is attached
        self._claimed = False
        self._claim_lock = threading.Lock()

    # -- the driver's side -------------------------------------------------------------------------------------
    def add(self, task):
        """Adds a ModelTask to the running call; returns once every device can run it. Raises ValueError or
        TypeError for a task that cannot join (nothing changes then), RunClosedError once the run is closing.
        Build the task's model inside `hydra_torch.state.task_rng.exclusive()`: model construction draws from the CPU
        generator, which the workers share; call add outside it (add takes it itself to measure the task)."""
        self._attached.wait()
        run = self._run  # read once: the run lets go of this handle as it ends
        if run is None:
            raise RunClosedError(self._gone)
        return run.add(task)

    def close(self):
        """No more tasks will come: the run ends when the tasks in it are done."""
        self._attached.wait()
        run = self._run
        if run is not None:
            run.close()

    # -- the run's side ----------------------------------------------------------------------------------------
    def claim(self):
        """ht.train's, before anything else: an Arrivals serves one call. A second call's close() would find the
        first run's handle and return at once, leaving the second run open to arrivals for ever."""
        with self._claim_lock:
            if self._claimed:
                raise ValueError("this Arrivals served an earlier call: make a new one for each call")
            self._claimed = True

    def attach(self, run):
        """The run is open to arrivals: the driver's calls waiting for it go on."""
        self._run = run
        self._attached.set()

    def end(self):
        """The call is over, trained or raised before training: the driver's calls return (add raising
        RunClosedError), and a handle the driver keeps no longer keeps the engines (arenas that took their whole
        budgets) and models alive."""
        if self._attached.is_set():
            self._gone = "the run has ended"
        self._run = None
        self._attached.set()


class OpenRun:
    """The running call's side of its tasks' comings and goings: lets ended tasks leave and, with Arrivals, admits
    new ones (see the module's doc)."""

    def __init__(self, *, slots, scheduler, runners, devices, budgets, pin, start_rng, trace, trace_lock, start,
                 stop, selection=None, on_ended=None, kept_outside=(0, 0)):
        self.slots, self.scheduler, self.runners = slots, scheduler, runners
        self.devices, self.budgets, self.pin, self.start_rng = devices, budgets, pin, start_rng
        # What each device's budget keeps beside the arena for a unit's working set and a micro-batch's saved
        # inputs (saved_bytes.kept_outside_arena of the first tasks): a newcomer's must fit in them.
        self.kept_outside = kept_outside
        self.trace, self.trace_lock, self.start, self.stop = trace, trace_lock, start, stop
        self.selection = selection          # the run's selection (its per-run object), told of each newcomer
        self._callbacks = _Callbacks(on_ended) if on_ended is not None else None
        self._lock = threading.Lock()       # one arrival at a time
        self._closed = False
        self._workers_gone = threading.Event()
        self._leaving: set[int] = set()
        # How many tasks have left the engines: a task still training is placed again at its next step boundary
        # once one has (hydra_torch.run.replacement).
        self.departures = 0
        self._leaving_lock = threading.Lock()  # not _lock: an arrival holds that while the workers register it

    def add(self, task):
        from hydra_torch.models import memory, planner
        from hydra_torch.run import bases, lifecycle, measuring, moving
        from hydra_torch.run.runner import TaskRunner
        from hydra_torch.task import ModelTask
        from hydra_torch.task_checks import check_own_models, warn_eval_mode, warn_restarted

        if not isinstance(task, ModelTask):
            raise TypeError(f"a task joining the run must be a ModelTask, got {type(task).__name__}")
        if any(slot.thread == threading.get_ident() for slot in self.slots):  # it would wait for itself
            raise RuntimeError("Arrivals.add was called on a device's worker thread (from a task's loss_fn, inputs or "
                               "lr_schedule): it waits for every device's worker to register the task, this one too. "
                               "Call it from a thread of the driver's own, or from on_ended")
        with self._lock:
            self._check_open()
            if any(r.task.name == task.name for r in self.runners):
                raise ValueError(f"a task named {task.name!r} is already in the run: task names must be unique")
            check_own_models([r.task for r in self.runners if r.result is None] + [task])  # ended ones let go
            task.check_unchanged()
            task.check_trains_something()
            warn_eval_mode([task], stacklevel=3)  # Arrivals.add's caller
            warn_restarted([task], [None], stacklevel=3)  # a run with arrivals keeps no checkpoints
            held = bases.held_for(self.runners, task) if task.base is not None else None
            memory.check_host_memory([task], bases_held=[held.base] if held is not None else [])
            # Measured on a batch while the workers train: their random draws must not see the measurement's. As
            # ht.train measures, whatever this thread's modes.
            with task_rng.exclusive(self.devices), training_modes("Arrivals.add", stacklevel=2):
                planner.plan_for_devices([task], self.devices, self.budgets, reserve_bytes=sum(self.kept_outside))
                measuring.measure_tasks([task], self.devices, self.budgets, time_units=False)  # one cut by hand
            need, kept = (task.working_set_bytes, task.boundary_bytes), self.kept_outside
            if need[0] > kept[0] or need[1] > kept[1]:
                raise ValueError(
                    f"task {task.name!r} cannot join the run: one unit's working set and one micro-batch's saved "
                    f"inputs need {memory.format_bytes(need[0])} and {memory.format_bytes(need[1])} of each "
                    f"device's budget beside the arena, and the run kept {memory.format_bytes(kept[0])} and "
                    f"{memory.format_bytes(kept[1])} for them when it started (the largest its first tasks' plans "
                    f"measured); start the run with a task at least this large")
            task.stopped_on_request = False
            task.ended.clear()
            runner = TaskRunner(task, len(self.runners), self.start_rng)
            joined = held is not None
            if joined:  # checked against it (and cut as its tasks are) before any engine holds the task
                held.admit(runner)
            try:
                if self.selection is not None:  # may refuse the task (no eval_data, say): before any engine holds it
                    self.selection.arrive(runner)
            except Exception:
                if joined:
                    held.members.remove(runner)
                raise
            if task.base is not None and not joined:  # the run's first task of this base
                held = bases.HeldBase(task.base, [runner], self.pin)
                self._on_every_device(lambda slot: held.ids.__setitem__(slot.index, slot.engine.add_base(held.store)))
            store = lifecycle.make_store(runner, self.pin)
            runner.placed_after = self.departures  # placed beside the tasks training now
            device_shards = (moving.added_shards(runner, store, self.slots, self.runners, self._on_every_device,
                                                   stacklevel=3) if held is None else [])

            def add_everywhere(device_shards):
                def add(slot):
                    base = held.ids[slot.index] if held is not None else -1
                    model = slot.engine.add_model(store, allow_resident=False, task=runner.index, base=base,
                                                  device_shards=device_shards)
                    runner.model_ids[slot.index] = model
                    runner.device_shards = list(slot.engine.device_shards(model))
                    if held is not None:
                        held.attach_model(runner, slot.engine, slot.index, model)
                return self._on_every_device(add)

            def release_everywhere():
                self._on_every_device(lambda slot: slot.index in runner.model_ids
                                      and slot.engine.release_model(runner.model_ids[slot.index]))
                runner.model_ids.clear()
            errors = add_everywhere(device_shards)
            if errors and device_shards and not self._workers_gone.is_set():
                # No room for the steps after all (the engine's count is the exact one): all on the host, on every
                # device alike.
                release_everywhere()
                errors = add_everywhere([])
            if errors or self._workers_gone.is_set():
                release_everywhere()
                if joined:
                    held.members.remove(runner)
                if not errors:
                    raise RunClosedError("the run ended while the task was joining it")
                raise ValueError(f"task {task.name!r} cannot join the run: {errors[0]}")
            if held is not None:
                held.point_home(runner)
            self.runners.append(runner)
            self.scheduler.add_task(runner.scheduler_spec())
            return runner

    def close(self):
        with self._lock:
            self._closed = True
        self.scheduler.set_open(False)

    def _check_open(self):
        if self._closed or self._workers_gone.is_set():
            raise RunClosedError("the run takes no more tasks: it was closed")
        if self.stop.is_set():
            raise RunClosedError(f"the run takes no more tasks: it was stopped by {self.stop.name}")

    def _on_every_device(self, job) -> list[Exception]:
        """Runs job(slot) on every device's worker thread; waits for all. Returns the errors raised."""
        return on_devices(self.slots, job, gone=self._workers_gone)

    # -- called by the workers ---------------------------------------------------------------------------------
    def ended(self, runner):
        """The task will run no more: each device holding it lets it go between its own units, in three rounds.
        Every device first waits for the task's own work in flight there (its host jobs write the one store); then
        the device holding its state drops a failed step's gradients and writes the weights back into the model;
        then every device frees its memory. Dropping the gradients while another device's jobs still summed into
        them was a data race (two devices, a task failing mid-run)."""
        from hydra_torch.run import lifecycle

        with self._leaving_lock:
            if runner.index in self._leaving:
                return
            self._leaving.add(runner.index)
        holding = [self.slots[d] for d in runner.model_ids]
        home = self.slots[lifecycle.home_slot(runner)] if holding else None
        checkpoints = self.slots[0].checkpoints

        def on_each(slots, job, then):
            """job(slot) on each slot's worker; then() on the thread that ran the last one. A Ctrl-C arriving meanwhile
            (on the main thread, device 0's worker) waits until the job is done and, after the last round, the task's
            result taken: else the call's end would bring home a task its engines have already released."""
            remaining, count = [len(slots)], threading.Lock()

            def run(slot):
                with interrupts.deferred():
                    try:
                        job(slot)
                    except Exception as error:
                        runner.error = runner.error or error
                    with count:
                        remaining[0] -= 1
                        last = remaining[0] == 0
                    if last:
                        then()
            for slot in slots:  # where that device's worker has ended, its engine is this thread's
                slot.inbox.run_or_post(lambda slot=slot: run(slot))

        def wait_here(slot):
            slot.engine.synchronize(runner.model_ids[slot.index])

        def write_back(slot):
            model = runner.model_ids[slot.index]
            try:
                if runner.error is not None:
                    slot.engine.discard_grads(model)
                if checkpoints is not None:  # finish rewrites the store a resident task's checkpoint may read
                    checkpoints.wait(runner)
            finally:
                slot.engine.finish(model)  # writes the weights back into the task's model

        def release(slot):
            slot.engine.release_model(runner.model_ids[slot.index])

        def gone():
            with self._leaving_lock:
                self.departures += 1
            if runner.base is not None:
                runner.base.point_home(runner)
            runner.restore_buffers()
            with self.trace_lock:
                trace = list(self.trace)
            runner.result = lifecycle.task_result(runner, [s.engine for s in self.slots], trace, self.start)
            if checkpoints is not None and runner.error is None and runner.at_step_boundary():
                checkpoints.submit(runner, final=True)  # the writer reads its store: kept until the run ends
            else:
                runner.store = None  # its host state: freed now, not when the run ends
            if self._callbacks is not None:
                self._callbacks.put(runner.result)
        if not holding:  # no engine holds it (a re-plan that failed): its weights are home already
            with interrupts.deferred():
                gone()
            return
        on_each(holding, wait_here,
                lambda: on_each([home], write_back, lambda: on_each(holding, release, gone)))

    def workers_gone(self):
        """Called once every worker has stopped: what they left in their inboxes runs on this thread."""
        self._workers_gone.set()
        with self._lock:  # an arrival in progress finishes first (it runs the inboxes itself meanwhile)
            self._closed = True
            for slot in self.slots:
                slot.inbox.drain()
        if self._callbacks is not None:  # not under _lock: a callback adding a task takes it, to be refused
            self._callbacks.close()


class _Callbacks:
    """Calls on_ended(result) for each task that ends, in turn, on a thread of its own. On a worker's thread a
    callback that adds a task would wait for that same worker to register it, and one that raises would end
    the worker and the run."""

    def __init__(self, on_ended):
        self._on_ended = on_ended
        self._results = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._call, name="hydra-on-ended", daemon=True)
        self._thread.start()

    def put(self, result):
        self._results.put(result)

    def close(self):
        """Every task has ended: returns once each one's callback has."""
        self._results.put(None)
        self._thread.join()

    def _call(self):
        while (result := self._results.get()) is not None:
            try:
                self._on_ended(result)
            except BaseException as error:  # here any error would only end this thread, and later callbacks with it
                warn_in_run(f"on_ended raised for task {result.name!r}: {error!r}; its result stands as it trained",
                            stacklevel=1)
