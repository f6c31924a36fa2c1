"""One node of a Ray cluster (see hydra_torch.cluster): builds its share of the tasks there, from their
factories, and trains them with ht.train on the node's devices. What it sends back is small and plain: each
task's result, its trained weights (a state dict on the CPU), and the run's trace, devices and statistics."""
from __future__ import annotations

import socket
import threading
import time
import warnings

import torch

from hydra_torch.report.results import TaskResult


class NodeTrainer:
    """The body of one Ray actor per node; hydra_torch.cluster wraps it with ray.remote."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._training: dict = {}  # task index -> ModelTask, while run() trains it

    def progress(self) -> dict:
        """Steps taken so far by each task run() trains."""
        with self._lock:
            return {i: task.steps_done for i, task in self._training.items()}

    def release(self, indices: list) -> list:
        """Stops the tasks `indices` of the running run() at their next step boundary, their checkpoints
        written, so that another node continues them; returns those stopped so (not those that ended first).
        It waits as long as that takes: a request left pending would cut the task later, unseen."""
        with self._lock:
            tasks = [(i, self._training[i]) for i in indices if i in self._training]
        for _, task in tasks:
            task.request_stop("moved to another node")
        released = []
        for i, task in tasks:
            task.ended.wait()
            if task.stopped_on_request:
                released.append(i)
        return released

    def where(self) -> str:
        return socket.gethostname()

    def run(self, jobs: list, options: dict) -> dict:
        """Trains the tasks `jobs` [(index, factory)] in one ht.train call with `options` (its keyword
        arguments, and "seed": the generator state every task's random streams start from)."""
        from hydra_torch.task import ModelTask

        tasks, failed = [], {}
        for index, factory in jobs:
            try:
                task = factory()
                if not isinstance(task, ModelTask):
                    raise TypeError(f"a task factory must return a ModelTask, got {type(task).__name__}")
                tasks.append((index, task))
            except Exception as error:  # that task fails; the node's others train
                failed[index] = _portable(error)
        options = dict(options)
        if options.get("devices") == "auto" and torch.cuda.is_available():
            # Every GPU Ray gave this actor (CUDA_VISIBLE_DEVICES), not just the first as on one machine.
            options["devices"] = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
        torch.manual_seed(options["seed"])  # and ht.train's own seed (the random policy) is the same
        with self._lock:
            self._training = dict(tasks)
        try:
            return self._train(tasks, failed, options)
        finally:
            with self._lock:
                self._training = {}

    def _train(self, tasks, failed, options) -> dict:
        from hydra_torch import api
        from hydra_torch.models.sharding import root_module

        out = {"results": {}, "weights": {}, "trace": [], "steps": [], "devices": [], "stats": [], "warnings": [],
               "failed": failed}
        if not tasks:
            return out
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = api.train([task for _, task in tasks], progress=False, **options)
        # perf_counter is per process: the trace goes home in wall-clock seconds.
        offset = time.time() - time.perf_counter()
        indices = [index for index, _ in tasks]
        for (index, task), result in zip(tasks, results):
            if result.error is not None:
                result.error = _portable(result.error)
            out["results"][index] = result
            out["weights"][index] = {k: v.detach().to("cpu", copy=True)
                                     for k, v in root_module(task.model, task.pieces).state_dict().items()}
        out["trace"] = [(e.device, indices[e.task], e.unit, e.shard, e.phase, e.start + offset, e.end + offset,
                         e.bytes_copied) for e in results.trace]
        out["steps"] = [(e.device, indices[e.task], e.shard, e.step, e.place, e.start + offset, e.end + offset)
                        for e in results.steps]
        out["devices"], out["stats"] = results.devices, results.stats
        out["warnings"] = [str(w.message) for w in caught]
        return out


def _portable(error: BaseException) -> BaseException:
    """The error as a RuntimeError (with its notes) when its own type might not unpickle on the driver."""
    if type(error).__module__.split(".")[0] in ("builtins", "torch", "hydra_torch"):
        return error
    portable = RuntimeError(f"{type(error).__name__}: {error}")
    for note in getattr(error, "__notes__", ()):
        portable.add_note(note)
    return portable


def failed_result(name: str, error: BaseException) -> TaskResult:
    return TaskResult(name, [], 0, 0, 0.0, False, [], error)
