"""Checkpoints: each task's whole training state at a step boundary, written beside training; resume.

One directory per task under `checkpoint_dir`, named after the task: `manifest.json` (position, losses,
optimizer, schedule, names, ties) and the tensors it names in a safetensors file (fp32 master weights, optimizer
moments, module buffers, generator states), keyed by parameter name, so a checkpoint resumes on other devices
or another shard plan. A new checkpoint is written under a new file name, flushed to disk, then the manifest is
replaced atomically: a crash in the middle of a write leaves the previous checkpoint whole. The state is taken
on the training thread after the task's pending steps (copied when its steps would go on rewriting it) and
written by a background thread while training goes on.

A run holds each of its tasks' directories (`claim`: a lock the OS lets go of when the process ends, however
it ends) while it reads the checkpoint, and from just before training until it ends (or the task stops at its
own request), so a second run of the same task is refused instead of deleting the first one's files. It
removes only the tensor files it replaced (its own, and the one it resumed from), and, once it holds a
directory, what a write cut short there left.
"""
from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import queue
import re
import socket
import threading
import time
import urllib.parse
import warnings
from pathlib import Path

import torch
from torch import nn

from hydra_torch.models import sharding
from hydra_torch.state.task_rng import TaskRng
from hydra_torch.task import PRECISIONS

FORMAT = 1
MANIFEST = "manifest.json"
LOCK = "lock"
CALLABLE = "<callable>"  # a callable lr_schedule's record: it cannot be compared by value, only told from a name
_STATE_FILE = re.compile(r"state-\d+-\d+\.safetensors")
_NAME_MAX = 255  # bytes in a file name on the usual filesystems
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
    return _on_disk(_task_dir(Path(root), name))[0]


def _on_disk(directory: Path) -> tuple[int, str | None]:
    """(steps, tensor file) of the checkpoint in `directory`; (0, None) without a readable one."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return int(manifest["steps"]), manifest["tensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0, None


def check_name(name) -> str:
    """The name of the task's directory: the name quoted, so that "a/b" stays one name, and a leading "."
    (which quote keeps) escaped too, so that ".", ".." and ".x" are directories of their own inside
    checkpoint_dir, apart from any other. Other names map as they always have. ValueError for a name that
    cannot be a directory's."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"task name {name!r} cannot name a checkpoint directory: give the task a non-empty str name")
    quoted = urllib.parse.quote(name, safe="")
    if quoted.startswith("."):
        quoted = "%2E" + quoted[1:]
    if len(quoted) > _NAME_MAX:
        raise ValueError(f"task name {name[:40]!r}... is too long for a checkpoint directory: {len(quoted)} bytes "
                         f"quoted, at most {_NAME_MAX}")
    return quoted


def _task_dir(root: Path, name) -> Path:
    return root / check_name(name)


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


class Claim:
    """A run's hold on one task's checkpoint directory: an exclusive flock on its lock file, which names the
    run's process. Not `held` where the filesystem has no locks."""

    def __init__(self, fd: int | None):
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # also where a forked process (a loader's worker) shares the file
            os.close(self._fd)
            self._fd = None


def claim(root, name: str) -> Claim:
    """Takes the task's checkpoint directory under `root`, which exists, for this run. Raises ValueError,
    touching nothing, while another run holds it, in this process or another. flock's lock belongs to the open
    file: two in one process conflict as two processes do, and the OS lets go of it when the process ends."""
    directory = _task_dir(Path(root), name)
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ValueError(f"task {name!r}: cannot open the lock of its checkpoints: {error}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip()
        os.close(fd)
        who = ("another ht.train call in this process" if holder.startswith(_holder() + ",")
               else f"another run ({holder or 'which has not named itself yet'})")
        raise ValueError(f"task {name!r}: its checkpoints in {directory} are in use by {who}: let it end, or use "
                         "another checkpoint_dir") from None
    except OSError as error:  # a filesystem without locks (NFS mounted with nolock, say)
        os.close(fd)
        warnings.warn(f"checkpoint_dir {str(root)!r} cannot be locked ({error}): a second run of the same tasks "
                      "on it would not be refused", RuntimeWarning)
        return Claim(None)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{_holder()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    except OSError:
        pass  # a full disk: the lock holds all the same, without the note of who holds it
    return Claim(fd)


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


def _schedule_record(task) -> dict:
    """The learning-rate schedule as the manifest holds it: a callable one only as CALLABLE."""
    return {"lr_schedule": CALLABLE if callable(task.lr_schedule) else task.lr_schedule,
            "warmup_steps": task.warmup_steps}


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pairs(value) -> bool:
    return isinstance(value, list) and all(isinstance(pair, list) and len(pair) == 2 and _count(pair[0]) and
                                           _number(pair[1]) for pair in value)


def _param_entry(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and all(map(_count, entry["shape"]))
            and _count(entry.get("steps")))


# Each field of a manifest: what it must be, and the test of it.
_FIELDS = {
    "task": ("a str", lambda v: isinstance(v, str)),
    "steps": ("an int >= 0", _count),
    "epochs_done": ("an int >= 0", _count),
    "losses": ("a list of numbers", lambda v: isinstance(v, list) and all(map(_number, v))),
    "params": ("an object of {shape: [int >= 0, ...], steps: int >= 0} by parameter name",
               lambda v: isinstance(v, dict) and all(map(_param_entry, v.values()))),
    "ties": ("an object of parameter names by parameter name",
             lambda v: isinstance(v, dict) and all(isinstance(first, str) for first in v.values())),
    "optimizer": ("an object", lambda v: isinstance(v, dict)),
    "precision": (f"one of {PRECISIONS}", lambda v: v in PRECISIONS),
    "data_length": ("an int >= 1", lambda v: _count(v) and v >= 1),
    "accumulate": ("an int >= 1", lambda v: _count(v) and v >= 1),
    "time": ("a number", _number),
    "tensors": ("the name of a state-*.safetensors file beside it",
                lambda v: isinstance(v, str) and _STATE_FILE.fullmatch(v) is not None),
}
# Fields a checkpoint written before they were recorded lacks.
_OPTIONAL = {
    "eval_losses": ("a list of [steps, loss] pairs", _pairs),
    "stopped": ("null or a str", lambda v: v is None or isinstance(v, str)),
    "rung_reports": ("a list of [rung, metric] pairs", _pairs),
    "lr_schedule": ("null or a str", lambda v: v is None or isinstance(v, str)),
    "warmup_steps": ("an int >= 0", _count),
}


def _check_fields(manifest, where: str):
    """Refuses a manifest (edited or damaged by hand) with a field missing, of the wrong type or range, or at
    odds with the others, naming the field."""
    if not isinstance(manifest, dict):
        raise ValueError(f"{where} does not hold a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{where} has format {manifest.get('format')!r}; this version reads format {FORMAT}")
    for key, (what, valid) in {**_FIELDS, **_OPTIONAL}.items():
        if key not in manifest and key in _FIELDS:
            raise ValueError(f"{where} lacks the field {key!r}")
        if key in manifest and not valid(manifest[key]):
            raise ValueError(f"{where}: field {key!r} must be {what}, got {json.dumps(manifest[key])[:80]}")
    steps = manifest["steps"]
    if len(manifest["losses"]) != steps:
        raise ValueError(f"{where}: field 'losses' holds {len(manifest['losses'])} losses for {steps} steps")
    per_epoch = -(-manifest["data_length"] // manifest["accumulate"])
    if manifest["epochs_done"] != steps // per_epoch:
        raise ValueError(f"{where}: field 'epochs_done' is {manifest['epochs_done']}, but {steps} steps of "
                         f"{per_epoch} an epoch complete {steps // per_epoch}")
    ahead = [name for name, entry in manifest["params"].items() if entry["steps"] > steps]
    if ahead:
        raise ValueError(f"{where}: field 'params' gives {ahead[0]!r} more steps than the task's {steps}")
    if any(at > steps for at, _ in manifest.get("eval_losses", ())):
        raise ValueError(f"{where}: field 'eval_losses' holds an evaluation after step {steps}")


def _parameters(task) -> dict[str, nn.Parameter]:
    names, _ = named_parameters(task)
    return {names[id(p)]: p for group in task.shard_params for p in group}


def _check_fits(manifest: dict, task, where: str):
    """Refuses a checkpoint of another task, model, optimizer, schedule or data length, or of more steps than
    the task now takes."""
    if manifest["task"] != task.name:
        raise ValueError(f"{where} holds the checkpoint of task {manifest['task']!r}, not of task {task.name!r}")
    shapes = {name: list(p.shape) for name, p in _parameters(task).items()}
    theirs = {name: entry["shape"] for name, entry in manifest["params"].items()}
    if theirs != shapes:
        differ = sorted(n for n in set(theirs) | set(shapes) if theirs.get(n) != shapes.get(n))
        raise ValueError(f"{where} is of another model: parameters {differ[:5]} differ in name or shape")
    _, ties = named_parameters(task)
    if manifest["ties"] != ties:
        raise ValueError(f"{where} ties {manifest['ties']}, but the model ties {ties}")
    optimizer = _optimizer_record(task)
    if manifest["optimizer"] != optimizer:
        raise ValueError(f"{where} was trained with {manifest['optimizer']}, not {optimizer}: "
                         "resume with the same optimizer, or use another checkpoint_dir")
    schedule = _schedule_record(task)
    recorded = {key: manifest[key] for key in schedule if key in manifest}
    if recorded != {key: schedule[key] for key in recorded}:
        raise ValueError(f"{where} was trained with {recorded}, not {schedule}: resume with the same lr_schedule "
                         f"and warmup_steps, or use another checkpoint_dir (a callable lr_schedule is recorded as "
                         f"{CALLABLE!r}, so any callable passes for another)")
    if manifest["data_length"] != len(task.data) or manifest["accumulate"] != task.accumulate:
        raise ValueError(f"{where} was taken with len(data) = {manifest['data_length']} and accumulate = "
                         f"{manifest['accumulate']}, now {len(task.data)} and {task.accumulate}: its position "
                         "in the data would mean something else")
    total = task.total_steps
    if manifest["steps"] > total:
        raise ValueError(f"{where} has taken {manifest['steps']} steps, more than the {total} the task now takes "
                         f"(max_steps={task.max_steps}, epochs={task.epochs}, len(data)={len(task.data)}, "
                         f"accumulate={task.accumulate}): ask for at least {manifest['steps']} steps to resume it, "
                         "or use another checkpoint_dir")


def _read_tensors(directory: Path, manifest: dict, task, where: str) -> dict:
    """The tensors the manifest names, checked against the task's parameters and optimizer."""
    from safetensors.torch import load_file

    name = manifest["tensors"]
    if not (directory / name).is_file():
        raise ValueError(f"{where}: field 'tensors' names {name}, which does not exist")
    try:
        tensors = load_file(str(directory / name))
    except Exception as error:  # a damaged file: safetensors raises its own types
        raise ValueError(f"{where}: cannot read {name}, the file its field 'tensors' names: {error}") from None
    states = task.optimizer.spec().num_states
    for param_name, p in _parameters(task).items():
        shape = list(p.shape)
        keys = [f"param/{param_name}"] + [f"state{k}/{param_name}" for k in range(states if p.requires_grad else 0)]
        for key in keys:
            if key not in tensors or list(tensors[key].shape) != shape or tensors[key].dtype != torch.float32:
                raise ValueError(f"{where}: {name} lacks {key} as fp32 of shape {shape}")
    if "rng/cpu" not in tensors:
        raise ValueError(f"{where}: {name} lacks the random generator's state")
    return tensors


@dataclasses.dataclass
class Loaded:
    """A task's checkpoint, read and checked against the task before anything is allocated."""
    manifest: dict
    tensors: dict


def load(root, task) -> Loaded | None:
    """The task's checkpoint under `root`, or None if it has none. Raises ValueError, touching nothing, while
    another run holds it (see claim), when it is damaged, or when it does not fit the task (see _check_fits)."""
    directory = _task_dir(Path(root), task.name)
    if not directory.is_dir():
        return None
    held = claim(root, task.name)  # no other run rewrites it while it is read
    try:
        return _read(directory, task)
    finally:
        held.release()


def _read(directory: Path, task) -> Loaded | None:
    where = f"task {task.name!r}: checkpoint {directory / MANIFEST}"
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except OSError as error:
        raise ValueError(f"{where} cannot be read: {error}") from None
    except ValueError as error:
        raise ValueError(f"{where} is not JSON: {error}") from None
    _check_fields(manifest, where)
    _check_fits(manifest, task, where)
    return Loaded(manifest, _read_tensors(directory, manifest, task, where))


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
                "stopped": runner.stopped, "rung_reports": [list(r) for r in runner.rung_reports], "params": params,
                "ties": ties, "optimizer": _optimizer_record(task), **_schedule_record(task),
                "precision": task.precision, "data_length": len(task.data), "accumulate": task.accumulate,
                "time": time.time()}
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


def _save(tensors: dict, path: Path):
    from safetensors.torch import save_file

    tensors = {key: t.contiguous() for key, t in tensors.items()}
    try:
        save_file(tensors, str(path))  # straight to disk from the tensors' memory
    except RuntimeError as error:  # safetensors before 0.8 refuses views of one buffer: copies, on this thread
        if "share memory" not in str(error):
            raise
        save_file({key: t.clone() for key, t in tensors.items()}, str(path))


def write(root, tensors: dict, manifest: dict, replaces: str | None = None) -> str:
    """Writes one task's checkpoint atomically: a fresh tensor file, then the manifest that names it; then
    removes `replaces`, the tensor file of the checkpoint it replaced. Returns the new tensor file's name. A
    write that fails removes what it wrote."""
    directory = _task_dir(Path(root), manifest["task"])
    directory.mkdir(parents=True, exist_ok=True)
    name = f"state-{manifest['steps']:08d}-{time.time_ns()}.safetensors"
    temporary, staged = directory / (name + ".tmp"), directory / (MANIFEST + ".tmp")
    try:
        _save(tensors, temporary)
        _fsync(temporary)
        os.replace(temporary, directory / name)
        _fsync_write(staged, lambda f: f.write(json.dumps({**manifest, "tensors": name}, indent=1).encode()))
    except BaseException:  # the manifest still names the previous checkpoint, whole
        for path in (temporary, directory / name, staged):
            path.unlink(missing_ok=True)
        raise
    os.replace(staged, directory / MANIFEST)
    _fsync_dir(directory)
    if replaces is not None:
        (directory / replaces).unlink(missing_ok=True)
    return name


class Checkpointer:
    """When each task is due a checkpoint, and the background thread that writes them. It holds the tasks'
    directories (see claim) from its start until it is closed (see submit for a task stopped at its request);
    a write that fails is counted (`failures`) and warned of once, until one succeeds again."""

    def __init__(self, root, every, runners):
        self.root = Path(root)
        self.every_steps, self.every_seconds = parse_every(every)
        self._last: dict[int, tuple[int, float]] = {}   # task -> (steps, time) at its last checkpoint
        self._files: dict[int, str | None] = {}         # task -> the tensor file its manifest on disk names
        self._claims: dict[int, Claim] = {}
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._queue: queue.Queue = queue.Queue()
        self.failures = 0          # checkpoints that could not be written
        self._failing = False      # the last write failed
        self._news: list[str] = []  # warnings for a training thread to give
        try:
            for runner in runners:
                self._take(runner)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._write_loop, name="hydra-checkpoints", daemon=True)
        self._thread.start()

    def _take(self, runner):
        """Holds the task's directory for the run, once sure its checkpoint is still the one the task resumed
        from; then removes the files there its manifest does not name, which only a write cut short (a killed
        run's) can have left, since no other run holds the directory."""
        name = runner.task.name
        directory = _task_dir(self.root, name)
        directory.mkdir(exist_ok=True)
        held = self._claims[runner.index] = claim(self.root, name)
        steps, tensors = _on_disk(directory)
        if steps != runner.steps:
            raise ValueError(f"task {name!r}: its checkpoint in {directory} changed after this call read it (another "
                             f"run wrote its step {steps} meanwhile): call again to resume from that one")
        if held.held:
            for leftover in directory.glob("state-*.safetensors*"):
                if leftover.name != tensors:
                    leftover.unlink(missing_ok=True)
        self._files[runner.index] = tensors
        self._last[runner.index] = (runner.steps, time.monotonic())

    def due(self, runner) -> bool:
        self._report()  # a write that failed is told of at the next step boundary
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
        copies the device state home, which waits for this write: `due`, `wait`). Otherwise, copies.

        A task stopped at its own request trains no more in this call, and another call may go on with it at
        once (a cluster moves tasks so): its directory is let go as soon as this checkpoint is written."""
        if final and self._last[runner.index][0] == runner.steps:
            return
        tensors, manifest = snapshot(runner, copy=not (final or resident))
        self._last[runner.index] = (runner.steps, time.monotonic())
        with self._lock:
            self._pending.add(runner.index)
        self._queue.put((runner.index, tensors, manifest, runner.task.stopped_on_request))

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
            index, tensors, manifest, last = item
            try:
                self._files[index] = write(self.root, tensors, manifest, self._files[index])
                self._failing = False
            except Exception as error:  # a full disk must not stop training
                self._failed(manifest, error)
            finally:
                if last:
                    self._claims.pop(index).release()
                with self._lock:
                    self._pending.discard(index)
                    self._written.notify_all()

    def _failed(self, manifest: dict, error: Exception):
        """Counts a write that failed; the first of a series is warned of (a full disk fails them all)."""
        with self._lock:
            self.failures += 1
            if not self._failing:
                self._news.append(f"checkpoints could not be written to {_task_dir(self.root, manifest['task'])}: "
                                  f"{error} (task {manifest['task']!r} at step {manifest['steps']}); training goes "
                                  "on, and further failures are only counted (Results.checkpoint_failures) until "
                                  "a checkpoint is written again")
            self._failing = True

    def _report(self):
        # On a training thread, not the writer's: a warnings filter that raises must not stop the writer.
        with self._lock:
            news, self._news = self._news, []
        for message in news:
            warnings.warn(message, RuntimeWarning)

    def _release(self):
        for held in self._claims.values():
            held.release()
        self._claims.clear()

    def close(self):
        """Waits for every write, gives the warnings not given yet, and lets go of the tasks' directories."""
        self._queue.put(None)
        self._thread.join()
        self._release()
        self._report()
