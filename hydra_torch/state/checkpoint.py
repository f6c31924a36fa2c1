"""Checkpoints: each task's whole training state at a step boundary, written beside training; resume.

One directory per task under `checkpoint_dir`, named after the task: `manifest.json` (position, losses,
optimizer, schedule, names, ties) and the tensors it names in a safetensors file (fp32 master weights, optimizer
moments, module buffers, generator states), keyed by parameter name, so a checkpoint resumes on other devices
or another shard plan. A new checkpoint is written under a new file name, flushed to disk, then the manifest is
replaced atomically: a crash in the middle of a write leaves the previous checkpoint whole. The state is taken
on the training thread after the task's pending steps (copied when its steps would go on rewriting it) and
written by a background thread while training goes on (checkpoint_writer.py), in directories a run holds
(checkpoint_dirs.py). A run removes only the tensor files it replaced (its own, and the one it resumed from),
and, once it holds a directory, what a write cut short there left.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path

import torch
from torch import nn

from hydra_torch.models import sharding
from hydra_torch.models.first_batch import own_generators
from hydra_torch.recipe.reals import whole
from hydra_torch.state.checkpoint_dirs import claim, task_dir
from hydra_torch.state.checkpoint_manifest import FORMAT, MANIFEST, check_fields
from hydra_torch.state.task_rng import TaskRng

CALLABLE = "<callable>"  # a callable lr_schedule's record: it cannot be compared by value, only told from a name
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
    elif whole(every, 1):
        return every, None
    elif isinstance(every, str) and (match := _DURATION.match(every)) and float(match[1]) > 0:
        return None, float(match[1]) * _SECONDS[match[2]]
    raise ValueError(f"checkpoint_every must be a number of steps (a positive int) or a duration such as '10min', "
                     f"'30s' or '1h', got {every!r}")


def steps_taken(root, name: str) -> int:
    """The steps of the task `name`'s last checkpoint under `root` (0 without one): its progress, as other
    processes see it."""
    return on_disk(task_dir(root, name))[0]


def on_disk(directory: Path) -> tuple[int, str | None]:
    """(steps, tensor file) of the checkpoint in `directory`; (0, None) without a readable one."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        return int(manifest["steps"]), manifest["tensors"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0, None


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


def _parameters(task) -> dict[str, nn.Parameter]:
    """What a checkpoint holds a state of: the task's own parameters, not those its FrozenBase holds (frozen, they
    are the pretrained weights the resumed tasks are built from again)."""
    names, _ = named_parameters(task)
    return {names[id(p)]: p for group in task.shard_params for p in group if id(p) not in task.base_weights}


def _base_name(task) -> str | None:
    return task.base.name if task.base is not None else None


def _check_fits(manifest: dict, task, where: str):
    """Refuses a checkpoint of another task, model, optimizer, schedule, clipping or data length, or of more steps
    than the task now takes."""
    if manifest["task"] != task.name:
        raise ValueError(f"{where} holds the checkpoint of task {manifest['task']!r}, not of task {task.name!r}")
    if manifest.get("base") != _base_name(task):
        recorded, now = manifest.get("base"), _base_name(task)
        raise ValueError(f"{where} was written " + (f"sharing the frozen base {recorded!r}" if recorded else
                         "without a shared base") + ", and the task now " +
                         (f"shares {now!r}" if now else "shares none") +
                         ": resume it as it was built (base=ht.FrozenBase(name=...) with the same name), or use "
                         "another checkpoint_dir")
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
    if manifest.get("clip_grad_norm", task.clip_grad_norm) != task.clip_grad_norm:  # older checkpoints lack it
        raise ValueError(f"{where} was trained with clip_grad_norm={manifest['clip_grad_norm']!r}, not "
                         f"{task.clip_grad_norm!r}: resume with the same clipping, or use another checkpoint_dir")
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
    kept, own = len(_indexed(tensors, "rng/loader")), len(own_generators(task.data))
    if kept and kept != own:  # a checkpoint written before they were kept has none
        raise ValueError(f"{where} was taken reading data whose loader draws its order from {kept} generators of its "
                         f"own, and the task's data now has {own}: its position in the data would mean something else")
    return tensors


def check_selection(root, tasks, loaded, selection) -> None:
    """Refuses a resume under another selection rule than the checkpoint's (or with one where it had none, or the
    reverse): a task's reports are kept by rung, and under rungs at other steps they would stand for judgements
    never made, the task going on unjudged. A checkpoint written before rules were recorded is taken as it is."""
    now = selection.record() if selection is not None else None
    for task, checkpoint in zip(tasks, loaded):
        if checkpoint is None or "selection" not in checkpoint.manifest:
            continue
        recorded = checkpoint.manifest["selection"]
        if recorded != now:
            where = f"task {task.name!r}: checkpoint {task_dir(root, task.name) / MANIFEST}"
            raise ValueError(f"{where} was trained under selection={recorded}, now {now}: resume under the same rule, "
                             "or use another checkpoint_dir")


@dataclasses.dataclass
class Loaded:
    """A task's checkpoint, read and checked against the task before anything is allocated."""
    manifest: dict
    tensors: dict


def load(root, task) -> Loaded | None:
    """The task's checkpoint under `root`, or None if it has none. Raises ValueError, touching nothing, while
    another run holds it (see claim), when it is damaged, or when it does not fit the task (see _check_fits)."""
    directory = task_dir(root, task.name)
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
    check_fields(manifest, where)
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
    runner.store.set_steps_taken(manifest["steps"])  # the steps the trace numbers (Results.steps) go on from there
    buffers = _named_buffers(runner.task)
    for name, (module, attribute) in buffers.items():
        if f"buffer/{name}" in tensors:
            module._buffers[attribute].copy_(tensors[f"buffer/{name}"])
    cuda = tensors.get("rng/cuda")
    runner.resume(manifest["steps"], manifest["losses"], manifest["epochs_done"],
                  TaskRng(tensors["rng/cpu"], cuda), tensors.get("rng/epoch"), manifest.get("eval_losses", ()),
                  manifest.get("stopped"), manifest.get("rung_reports", ()), _indexed(tensors, "rng/loader"),
                  _indexed(tensors, "rng/loader_epoch"))


def _indexed(tensors: dict, prefix: str) -> list:
    """tensors[prefix + "0"], tensors[prefix + "1"], ... while there are."""
    found = []
    while f"{prefix}{len(found)}" in tensors:
        found.append(tensors[f"{prefix}{len(found)}"])
    return found


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
    for k, generator in enumerate(own_generators(task.data)):  # a shuffling loader's own, beside torch's
        tensors[f"rng/loader{k}"] = generator.get_state()
    for k, state in enumerate(runner.epoch_loader):
        tensors[f"rng/loader_epoch{k}"] = state.clone()
    manifest = {"format": FORMAT, "task": task.name, "steps": runner.steps, "epochs_done": runner.epochs_done,
                "losses": list(runner.losses), "eval_losses": [list(e) for e in runner.eval_losses],
                "stopped": runner.stopped, "rung_reports": [list(r) for r in runner.rung_reports],
                "selection": _selection_record(runner), "params": params,
                "ties": ties, "base": _base_name(task), "optimizer": _optimizer_record(task), **_schedule_record(task),
                "precision": task.precision, "clip_grad_norm": task.clip_grad_norm, "data_length": len(task.data),
                "accumulate": task.accumulate, "time": time.time()}
    return tensors, manifest


def _selection_record(runner) -> dict | None:
    """The rule the task is judged by: the run's object of a SuccessiveHalving holds it as `rule`, others are it."""
    if runner.selection is None:
        return None
    return getattr(runner.selection, "rule", runner.selection).record()


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
    directory = task_dir(root, manifest["task"])
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
