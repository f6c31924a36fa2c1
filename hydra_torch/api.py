"""ht.train: the one call that trains a list of tasks."""
from __future__ import annotations

import time
import warnings

import torch

from hydra_torch import _C
from hydra_torch.memory import parse_budget
from hydra_torch.results import Results, TaskResult
from hydra_torch.runner import TaskRunner
from hydra_torch.task import ModelTask

SCHEDULES = ("lrtf",)


def resolve_devices(devices) -> list[torch.device]:
    if devices == "auto":
        return [torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")]
    if isinstance(devices, (str, torch.device)):
        devices = [devices]
    try:
        resolved = [torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"cannot read devices={devices!r}: {error}") from None
    if not resolved:
        raise ValueError("devices is empty")
    for device in resolved:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device} was asked for but CUDA is not available")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"unsupported device {device}: use CPU or CUDA devices")
    if len(resolved) > 1:
        raise ValueError("training across several devices at once is not available yet: pass one device")
    return [torch.device("cuda", torch.cuda.current_device()) if d.type == "cuda" and d.index is None else d
            for d in resolved]


def _pin(pin_memory, device: torch.device) -> bool:
    if pin_memory == "auto":
        return device.type != "cpu"  # a CPU device copies host to host: pinning buys nothing
    return bool(pin_memory)


def train(tasks, devices="auto", memory_budget=None, schedule: str = "lrtf", pin_memory="auto") -> Results:
    """Trains every task and returns their results; the user's modules hold the trained weights.

    devices: "auto" (the first GPU, else the CPU), or a device such as "cuda:0" or "cpu".
    memory_budget: bytes of training state the device may hold: an int, "8GiB", "512MB", or a fraction of
    free memory ("0.8", "80%"). A model whose whole training state fits stays resident; otherwise its
    shards are spilled to host memory and visit the device in turn.
    pin_memory: "auto" (pin host buffers for accelerator devices), True or False.

    Tasks run one after another here. A task that fails (say a NaN loss) keeps its last good weights and
    records its error in its result; the others still run.
    """
    if isinstance(tasks, ModelTask):
        tasks = [tasks]
    tasks = list(tasks)
    if not tasks or not all(isinstance(t, ModelTask) for t in tasks):
        raise TypeError("train() takes a non-empty list of ModelTask")
    if len({t.name for t in tasks}) != len(tasks):
        raise ValueError("task names must be unique")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}: use one of {SCHEDULES}")
    (device,) = resolve_devices(devices)
    budget = parse_budget(memory_budget, device)
    pin = _pin(pin_memory, device)

    engine = _C.DeviceEngine(str(device), budget)
    stores, ids = [], []
    for task in tasks:
        store = _C.ShardStore(task.shard_params, task.optimizer.spec(), task.precision == "bf16", pin)
        if pin and not store.pinned:
            warnings.warn("pinned host memory is unavailable; using pageable memory, so host-device copies are "
                          "synchronous and slower", RuntimeWarning, stacklevel=2)
        try:
            ids.append(engine.add_model(store))
        except RuntimeError as error:
            raise ValueError(f"task {task.name!r}: {error}") from None
        stores.append(store)

    results = []
    for task, model_id in zip(tasks, ids):
        results.append(_train_one(task, engine, model_id, device))
    return Results(results, str(device), engine.stats())


def _train_one(task: ModelTask, engine, model_id: int, device: torch.device) -> TaskResult:
    runner = TaskRunner(task, engine, model_id, device)
    buffers = task.buffers()
    originals = [getattr(module, name).device for module, name in buffers]
    start = time.perf_counter()
    error = None
    try:
        for module, name in buffers:
            module._buffers[name] = module._buffers[name].to(device)
        runner.run()
    except Exception as caught:  # the task ends; its last good weights are kept and written back below
        error = caught
        warnings.warn(f"task {task.name!r} stopped: {caught}", RuntimeWarning, stacklevel=3)
    finally:
        engine.finish(model_id)
        for (module, name), where in zip(buffers, originals):
            module._buffers[name] = module._buffers[name].to(where)
    return TaskResult(task.name, runner.losses, runner.steps, runner.epochs_done, time.perf_counter() - start,
                      engine.resident(model_id), list(engine.shard_loads(model_id)), error)
