"""Each task's own random numbers, while worker threads of several devices share the process's generators.

A task draws from its own streams: what dropout, random data order or augmentation would draw if the task
trained alone from the same seed, whichever device runs its units and whatever runs beside it. A device's
CUDA generator is only touched by that device's worker, one unit at a time: each unit sets it to the task's
state and saves it back, holding the device's lock, which code outside any task that may draw from it takes too
(exclusive: measuring a task that joins the run). The CPU generator is one for the whole process, so every worker
thread would race on it: a section of a unit that may draw from it holds `_CPU` while it sets the task's state,
runs and saves it.

Most shards never draw from the CPU generator (on a GPU dropout draws from the CUDA one), and holding a lock
around every unit would run the devices of a CPU run one at a time. So each (phase, shard) section is first
run under the lock and watched: if the generator did not move, later runs skip the lock. Reading data always
holds it (a shuffled DataLoader draws a seed at each epoch's start). A section that draws only on some visits
and not on its first would race; whoever takes the lock next sees that the generator moved without it, and
from then on every section takes the lock, with a warning.
"""
from __future__ import annotations

import contextlib
import threading
from contextlib import contextmanager

import torch

from hydra_torch.state.run_warnings import warn_in_run


class _CpuGenerator:
    def __init__(self):
        self.lock = threading.Lock()
        self.left = None            # the state the last section holding the lock left behind
        self.always_lock = False
        self.exclusive_to = None    # the thread inside exclusive(), if any
        self.section_in = None      # the thread whose unit's section holds the lock, if any

    def reset(self):
        with self.lock:
            self.left = None
            self.always_lock = False


_CPU = _CpuGenerator()

# Per CUDA device index: held by the device's worker while a unit has the device's generator set to its task's
# state, and by code outside any task that may draw from it (exclusive). Uncontended but for those.
_DEVICE_LOCKS: dict[int, threading.Lock] = {}
_DEVICE_LOCKS_MADE = threading.Lock()


def _device_lock(index: int) -> threading.Lock:
    with _DEVICE_LOCKS_MADE:
        return _DEVICE_LOCKS.setdefault(index, threading.Lock())


def new_run():
    """Called as a run starts: what an earlier run left in the CPU generator is not a race."""
    _CPU.reset()


@contextmanager
def exclusive(devices=()):
    """The CPU generator to the calling thread alone for the block, while workers train, and each CUDA device's
    of `devices` too (its worker waits at its next unit): for code outside any task that draws from them, such as
    building a model that joins the run, or measuring it on a batch. Taken in the workers' order: the CPU's first."""
    if _CPU.exclusive_to == threading.get_ident():  # the lock is not reentrant: this would wait for itself
        raise RuntimeError("task_rng.exclusive() is already held by this thread (hydra_torch.optuna's build_task "
                           "runs inside it): build the model inside it, and call Arrivals.add (which takes it to "
                           "measure the task) outside it")
    if _CPU.section_in == threading.get_ident():
        raise RuntimeError("task_rng.exclusive() was called inside a task's unit (its loss_fn, inputs or a layer), "
                           "which holds the CPU generator: build models outside the run's tasks (on a thread of "
                           "the driver's own, or in Arrivals' on_ended)")
    indices = sorted({torch.device(d).index or 0 for d in devices if torch.device(d).type == "cuda"})
    with _CPU.lock, contextlib.ExitStack() as held:
        for index in indices:
            held.enter_context(_device_lock(index))
        _CPU.exclusive_to = threading.get_ident()
        try:
            yield
        finally:
            _CPU.exclusive_to = None
            _CPU.left = torch.get_rng_state()


class TaskRng:
    """A task's generator states: `cpu`, and `cuda` once it has run on a GPU (None: the CUDA state at the
    start). `draws[key]` is whether the section `key` draws from the CPU generator, once known."""

    def __init__(self, cpu: torch.Tensor, cuda: torch.Tensor | None):
        self.cpu = cpu
        self.cuda = cuda
        self.draws: dict[tuple, bool] = {}

    @classmethod
    def current(cls, device: torch.device) -> "TaskRng":
        return cls(torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)

    def snapshot(self) -> tuple:
        return self.cpu, self.cuda

    @contextmanager
    def on_device(self, device: torch.device, start: tuple | None = None, save: bool = True):
        """Sets `device`'s CUDA generator to the task's state (or to the `start` snapshot's) for the block,
        and keeps what the block leaves there as the task's state when `save`."""
        cuda = start[1] if start is not None else self.cuda
        if device.type != "cuda":
            yield
            return
        with _device_lock(device.index or 0):
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, device)
            yield
            if save:
                self.cuda = torch.cuda.get_rng_state(device)

    @contextmanager
    def cpu_section(self, key, start: tuple | None = None, save: bool = True):
        """Runs the block with the CPU generator set to the task's state (or the `start` snapshot's) when it
        may draw from it, and keeps what it leaves as the task's state when `save`. `key` None: always held."""
        known = self.draws.get(key) if key is not None else True
        if known is False and not _CPU.always_lock:
            yield
            return
        state = start[0] if start is not None else self.cpu
        with _CPU.lock:
            if _CPU.left is not None and not _CPU.always_lock and not torch.equal(torch.get_rng_state(), _CPU.left):
                _CPU.always_lock = True
                warn_in_run("a shard drew from the CPU random generator on some of its runs only; from now on "
                            "every unit takes the generator in turn (slower on several CPU devices)")
            torch.set_rng_state(state)
            _CPU.section_in = threading.get_ident()
            try:
                yield
            finally:
                _CPU.section_in = None
                after = torch.get_rng_state()
                _CPU.left = after
            if key is not None and known is None:
                self.draws[key] = not torch.equal(after, state)
            if save:
                self.cpu = after
