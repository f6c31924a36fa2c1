"""Checkpoints: each task's whole training state at a step boundary, written beside training; resume.

One directory per task under `checkpoint_dir`: `manifest.json` (position, losses, optimizer, names, ties) and
the tensors it names in a safetensors file (fp32 master weights, optimizer moments, module buffers, generator
states), keyed by parameter name, so a checkpoint resumes on other devices or another shard plan. A new
checkpoint is written under a new file name, flushed to disk, then the manifest is replaced atomically: a crash
in the middle of a write leaves the previous checkpoint whole. The state is taken on the training thread
after the task's pending steps (copied when its steps would go on rewriting it) and written by a background
thread while training goes on.
"""
from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import threading
import time
import urllib.parse
import warnings
from pathlib import Path

import torch
from torch import nn

from hydra_torch import sharding
from hydra_torch.task_rng import TaskRng

FORMAT = 1
MANIFEST = "manifest.json"
DEFAULT_EVERY_SECONDS = 600.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|min|m|h)\s*$")
_SECONDS = {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}


def parse_every(every) -> tuple[int | None, float | None]:
    """`checkpoint_every`: a number of steps (an int), or a duration ("10min", "30s", "1h", a timedelta);
    None: every 10 minutes."""
    if every is None:
        return None, DEFAULT_EVERY_SECONDS
    if hasattr(every, "total_seconds"):
        every = every.total_seconds()
        if every > 0:
            return None, float(every)
    elif isinstance(every, int) and not isinstance(every, bool) and every >= 1:
        return every, None
    elif isinstance(every, str) and (match := _DURATION.match(every)) and float(match[1]) > 0:
        return None, float(match[1]) * _SECONDS[match[2]]
    raise ValueError(f"checkpoint_every must be a number of steps (a positive int) or a duration such as '10min', "
                     f"'30s' or '1h', got {every!r}")


def prepare_directory(root):
    """Creates the checkpoint directory if needed; ValueError if it cannot be created or written."""
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"checkpoint_dir {str(root)!r} cannot be created: {error}") from None
    if not os.access(root, os.W_OK):
        raise ValueError(f"checkpoint_dir {str(root)!r} is not writable")


def steps_taken(root, name: str) -> int:
    """The steps of the task `name`'s last checkpoint under `root` (0 without one): its progress, as other
    processes see it."""
    try:
        return int(json.loads((_task_dir(Path(root), name) / MANIFEST).read_text())["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _task_dir(root: Path, name: str) -> Path:
    return root / urllib.parse.quote(name, safe="")


def named_parameters(task) -> tuple[dict[int, str], dict[str, str]]:
    """Each parameter's name (by id) and the ties: every further name of a parameter -> its first name."""
    model = sharding.root_module(task.model, task.pieces)
    names, ties = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        first = names.setdefault(id(p), name)
        if first != name:
            ties[name] = first
    return names, ties


def _named_buffers(task) -> dict[str, tuple[nn.Module, str]]:
    model = sharding.root_module(task.model, task.pieces)
    found = {}
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                found.setdefault(f"{module_name}.{name}" if module_name else name, (module, name))
    return found


def _optimizer_record(task) -> dict:
    """The optimizer's kind and arguments and each grouped parameter's (lr, weight_decay), as the manifest holds
    them (JSON: tuples become lists)."""
    names, _ = named_parameters(task)
    groups = {names[key]: [lr, weight_decay] for key, (_, lr, weight_decay) in task.param_options.items()}
    return json.loads(json.dumps({"kind": type(task.optimizer).__name__, **dataclasses.asdict(task.optimizer),
                                  "param_groups": dict(sorted(groups.items()))}))


@dataclasses.dataclass
class Loaded:
    """A task's checkpoint, read and checked against the task before anything is allocated."""
    manifest: dict
    tensors: dict


def load(root, task) -> Loaded | None:
    """The task's checkpoint under `root`, or None if it has none. Raises ValueError, touching nothing, when
    the checkpoint does not fit the task (another model, optimizer or data length)."""
    directory = _task_dir(Path(root), task.name)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as error:
        raise ValueError(f"task {task.name!r}: cannot read its checkpoint {directory / MANIFEST}: {error}") from None
    where = f"task {task.name!r}: the checkpoint in {directory}"
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{where} has format {manifest.get('format')!r}; this version reads format {FORMAT}")
    names, ties = named_parameters(task)
    shapes = {names[id(p)]: list(p.shape) for group in task.shard_params for p in group}
    theirs = {name: entry["shape"] for name, entry in manifest["params"].items()}
    if theirs != shapes:
        differ = sorted(n for n in set(theirs) | set(shapes) if theirs.get(n) != shapes.get(n))
        raise ValueError(f"{where} is of another model: parameters {differ[:5]} differ in name or shape")
    if manifest["ties"] != ties:
        raise ValueError(f"{where} ties {manifest['ties']}, but the model ties {ties}")
    optimizer = _optimizer_record(task)
    if manifest["optimizer"] != optimizer:
        raise ValueError(f"{where} was trained with {manifest['optimizer']}, not {optimizer}: "
                         "resume with the same optimizer, or use another checkpoint_dir")
    if manifest["data_length"] != len(task.data) or manifest["accumulate"] != task.accumulate:
        raise ValueError(f"{where} was taken with len(data) = {manifest['data_length']} and accumulate = "
                         f"{manifest['accumulate']}, now {len(task.data)} and {task.accumulate}: its position "
                         "in the data would mean something else")
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(directory / manifest["tensors"]))
    except Exception as error:  # a missing or damaged file: safetensors raises its own types
        raise ValueError(f"{where}: cannot read {manifest['tensors']}: {error}") from None
    trainable = {names[id(p)]: p.requires_grad for group in task.shard_params for p in group}
    states = task.optimizer.spec().num_states
    for name, shape in shapes.items():
        keys = [f"param/{name}"] + [f"state{k}/{name}" for k in range(states if trainable[name] else 0)]
        for key in keys:
            if key not in tensors or list(tensors[key].shape) != shape or tensors[key].dtype != torch.float32:
                raise ValueError(f"{where}: {manifest['tensors']} lacks {key} as fp32 of shape {shape}")
    if "rng/cpu" not in tensors:
        raise ValueError(f"{where}: {manifest['tensors']} lacks the random generator's state")
    return Loaded(manifest, tensors)


def restore(loaded: Loaded, runner):
    """Puts a loaded checkpoint into the task's host state (its ShardStore) and position, before training."""
    manifest, tensors = loaded.manifest, loaded.tensors
    names, _ = named_parameters(runner.task)
    for param, master, states, _steps in runner.store.param_states():
        name = names[id(param)]
        master.copy_(tensors[f"param/{name}"])
        for k, state in enumerate(states):
            state.copy_(tensors[f"state{k}/{name}"])
        runner.store.set_param_steps(param, manifest["params"][name]["steps"])
    runner.store.refresh_shadow()
    buffers = _named_buffers(runner.task)
    for name, (module, attribute) in buffers.items():
        if f"buffer/{name}" in tensors:
            module._buffers[attribute].copy_(tensors[f"buffer/{name}"])
    cuda = tensors.get("rng/cuda")
    runner.resume(manifest["steps"], manifest["losses"], manifest["epochs_done"],
                  TaskRng(tensors["rng/cpu"], cuda), tensors.get("rng/epoch"), manifest.get("eval_losses", ()),
                  manifest.get("stopped"), manifest.get("rung_reports", ()))


def snapshot(runner, copy: bool = True) -> tuple[dict, dict]:
    """The task's state now (its store must be up to date: pending steps done, resident state home). `copy`:
    clones of the store's buffers, for a task whose steps go on rewriting them; else views of them."""
    task = runner.task
    names, ties = named_parameters(task)
    tensors, params = {}, {}
    keep = (lambda t: t.clone()) if copy else (lambda t: t)
    for param, master, states, steps in runner.store.param_states():
        name = names[id(param)]
        tensors[f"param/{name}"] = keep(master)
        for k, state in enumerate(states):
            tensors[f"state{k}/{name}"] = keep(state)
        params[name] = {"shape": list(param.shape), "steps": steps}
    for name, (module, attribute) in _named_buffers(task).items():
        tensors[f"buffer/{name}"] = module._buffers[attribute].detach().to("cpu", copy=True)
    rng = runner.rng
    tensors["rng/cpu"] = rng.cpu.clone()
    if rng.cuda is not None:
        tensors["rng/cuda"] = rng.cuda.clone()
    if runner.epoch_rng is not None:
        tensors["rng/epoch"] = runner.epoch_rng.clone()
    manifest = {"format": FORMAT, "task": task.name, "steps": runner.steps, "epochs_done": runner.epochs_done,
                "losses": list(runner.losses), "eval_losses": [list(e) for e in runner.eval_losses],
                "stopped": runner.stopped, "rung_reports": [list(r) for r in runner.rung_reports], "params": params, "ties": ties,
                "optimizer": _optimizer_record(task), "precision": task.precision, "data_length": len(task.data),
                "accumulate": task.accumulate, "time": time.time()}
    return tensors, manifest


def _fsync(path: Path):
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_write(path: Path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # a platform without directory handles
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root, tensors: dict, manifest: dict):
    """Writes one task's checkpoint atomically: a fresh tensor file, then the manifest that names it."""
    from safetensors.torch import save_file

    directory = _task_dir(Path(root), manifest["task"])
    directory.mkdir(parents=True, exist_ok=True)
    name = f"state-{manifest['steps']:08d}-{time.time_ns()}.safetensors"
    temporary = directory / (name + ".tmp")
    tensors = {key: t.contiguous() for key, t in tensors.items()}
    try:
        save_file(tensors, str(temporary))  # straight to disk from the tensors' memory
    except RuntimeError as error:  # safetensors before 0.8 refuses views of one buffer: copies, on this thread
        if "share memory" not in str(error):
            raise
        save_file({key: t.clone() for key, t in tensors.items()}, str(temporary))
    _fsync(temporary)
    os.replace(temporary, directory / name)
    manifest = {**manifest, "tensors": name}
    _fsync_write(directory / (MANIFEST + ".tmp"), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    os.replace(directory / (MANIFEST + ".tmp"), directory / MANIFEST)
    _fsync_dir(directory)
    for old in directory.glob("state-*.safetensors*"):  # older checkpoints, and leftovers of a crashed write
        if old.name != name:
            old.unlink(missing_ok=True)


class Checkpointer:
    """When each task is due a checkpoint, and the background thread that writes them."""

    def __init__(self, root, every):
        self.root = Path(root)
        self.every_steps, self.every_seconds = parse_every(every)
        self._last: dict[int, tuple[int, float]] = {}   # task -> (steps, time) at its last checkpoint
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._queue: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._write_loop, name="hydra-checkpoints", daemon=True)
        self._thread.start()

    def started(self, runner):
        self._last[runner.index] = (runner.steps, time.monotonic())

    def due(self, runner) -> bool:
        steps, at = self._last[runner.index]
        if runner.steps == steps or runner.index in self._pending:  # nothing new, or the last one still writing
            return False
        if self.every_steps is not None:
            return runner.steps - steps >= self.every_steps
        return time.monotonic() - at >= self.every_seconds

    def submit(self, runner, final: bool = False, resident: bool = False):
        """Hands the task's state to the writer. `final`: as the run ends, its weights home; skipped when its
        last checkpoint (or the one it resumed from) already holds this step. The writer reads the store's
        buffers themselves when nothing rewrites them before it is done: after the run, or for a `resident`
        task, whose steps run on the device (its store changes only when DeviceEngine::snapshot or finish
        copies the device state home, which waits for this write: `due`, `wait`). Otherwise, copies."""
        if final and self._last[runner.index][0] == runner.steps:
            return
        tensors, manifest = snapshot(runner, copy=not (final or resident))
        self._last[runner.index] = (runner.steps, time.monotonic())
        with self._lock:
            self._pending.add(runner.index)
        self._queue.put((runner.index, tensors, manifest))

    def wait(self, runner):
        """Until the task's checkpoint being written, if any, is on disk."""
        with self._lock:
            while runner.index in self._pending:
                self._written.wait()

    def _write_loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            index, tensors, manifest = item
            try:
                write(self.root, tensors, manifest)
            except Exception as error:  # a full disk must not stop training: reported when the run ends
                self.errors.append(f"task {manifest['task']!r} at step {manifest['steps']}: {error}")
            finally:
                with self._lock:
                    self._pending.discard(index)
                    self._written.notify_all()

    def close(self):
        """Waits for every write; warns about the ones that failed."""
        self._queue.put(None)
        self._thread.join()
        for error in self.errors:
            warnings.warn(f"a checkpoint could not be written: {error}", RuntimeWarning, stacklevel=3)
