"""FrozenBase: frozen weights that several tasks declare they share (the pretrained base of a sweep), and the
checks that they really are one base, made before anything runs.

Tasks built with the same ``base=ht.FrozenBase()`` hold the frozen weights they have in common once on the host
and once on a device (hydra_torch.run.bases). Weights are matched by name within the model's layers, with the
wrappers peft puts around a base layer left out of the name (``base_layer``, ``original_module``): a LoRA model
of any rank and target modules names a base weight as the plain model does.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

# Path segments peft inserts around a wrapped base module: LoRA's layer holds it as `base_layer`, and a module
# in modules_to_save keeps its frozen original as `original_module` beside the trained copy.
_WRAPPERS = ("base_layer", "original_module")


class FrozenBase:
    """Frozen weights several tasks share: pass one to each ``ModelTask(..., base=base)``.

    Every task of a base must have the same frozen weights, by name, shape, dtype and value (a LoRA sweep over
    one pretrained model: each task its own ``copy.deepcopy`` of it, adapters and all), train in the same
    precision and be cut into the same shards (``shards="auto"`` cuts them alike). ht.train then holds those
    weights once on the host and copies each shard of them to a device once for every task that computes on it
    while it stays there; each task's own weights (its adapters, a trained head) are its own as before, and it
    trains exactly as it would alone. After the call the tasks' base parameters share one host copy. Anything
    else is refused, naming the task and the weight, before training starts.

    name: how checkpoints and results name it (default: base0, base1, ...). A task resumed from a checkpoint
    needs a base of the same name.
    """

    _names = itertools.count()

    def __init__(self, name: str | None = None):
        if name is not None and (not isinstance(name, str) or not name):
            raise TypeError(f"a FrozenBase's name must be a non-empty str, got {name!r}")
        self.name = name if name is not None else f"base{next(self._names)}"

    def __repr__(self) -> str:
        return f"FrozenBase(name={self.name!r})"


def canonical_name(name: str) -> str:
    """A parameter's name with peft's wrapper segments left out."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def base_weights(pieces, shard_params) -> dict[int, str]:
    """id -> canonical name of each frozen parameter the shards use (a tied one once)."""
    names = {}
    for name, p in nn.ModuleList(pieces).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), canonical_name(name))
    weights = {id(p): names[id(p)] for shard in shard_params for p in shard if not p.requires_grad}
    if len(set(weights.values())) < len(weights):  # a name is how its tasks' copies of a weight are matched
        twice = next(n for n in weights.values() if list(weights.values()).count(n) > 1)
        raise ValueError(f"two frozen weights of the model are both named {twice} once peft's wrappers are left "
                         "out: a FrozenBase cannot tell them apart")
    return weights


def weights_by_name(task) -> dict[str, torch.Tensor]:
    """The task's own parameters of its base, by name."""
    params = {id(p): p for shard in task.shard_params for p in shard}
    return {name: params[key] for key, name in task.base_weights.items()}


def check(tasks) -> None:
    """Raises ValueError, touching nothing, unless the tasks of each base agree on its weights (see FrozenBase)."""
    groups: dict[int, list] = {}
    for task in tasks:
        if task.base is not None:
            groups.setdefault(id(task.base), []).append(task)
    named = {}
    for members in groups.values():
        base = members[0].base
        other = named.setdefault(base.name, base)
        if other is not base:
            raise ValueError(f"two FrozenBase objects are named {base.name!r}: checkpoints tell bases by name")
        _check_members(base, members)


def _check_members(base, members) -> None:
    first = members[0]
    reference = weights_by_name(first)
    for task in members:
        check_task(base, task, first, reference)


def check_task(base, task, first, reference) -> None:
    """Raises ValueError unless `task` holds the weights of `base` that `reference` (name -> tensor) holds, frozen
    and equal, in the precision of its first task `first`."""
    weights = weights_by_name(task)
    trained = sorted(name for name, p in weights.items() if p.requires_grad)
    if trained:  # frozen when the task was built, trainable now
        raise ValueError(f"task {task.name!r} trains {trained[0]}, a weight of {base!r}, which its tasks share "
                         "frozen: freeze it again, or build the task without base=")
    if task.precision != first.precision:
        raise ValueError(f"tasks {first.name!r} and {task.name!r} share {base!r} but train in {first.precision} "
                         f"and {task.precision}: the tasks of a base train in one precision")
    if task is first:
        return
    own = _named(task)
    for name in sorted(set(reference) | set(weights)):
        if name not in weights:
            if name in own:
                raise ValueError(f"task {task.name!r} trains {name}, a weight of {base!r} that task "
                                 f"{first.name!r} holds frozen: the tasks of a base freeze the same weights")
            raise ValueError(f"task {task.name!r} has no weight {name}, which task {first.name!r} holds frozen "
                             f"in {base!r}: the tasks of a base freeze the same weights of the same model")
        if name not in reference:
            which = "trains" if name in _named(first) else "has no"
            raise ValueError(f"task {task.name!r} holds {name} frozen, which task {first.name!r} {which}: the "
                             f"tasks of {base!r} freeze the same weights of the same model")
        mine, theirs = weights[name], reference[name]
        if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
            raise ValueError(f"{base!r}: weight {name} is {tuple(mine.shape)} {mine.dtype} in task {task.name!r} "
                             f"but {tuple(theirs.shape)} {theirs.dtype} in task {first.name!r}")
        if mine is not theirs and not torch.equal(mine.detach(), theirs.detach()):
            raise ValueError(f"{base!r}: weight {name} differs in value between tasks {first.name!r} and "
                             f"{task.name!r}: the tasks of a base start from the same pretrained weights")


def _named(task) -> dict[str, torch.Tensor]:
    """Every parameter of the task's layers by canonical name."""
    return {canonical_name(name): p for name, p in nn.ModuleList(task.pieces).named_parameters()}


def check_cuts(members) -> None:
    """Raises ValueError unless every task of a base holds each of its weights in the same shard."""
    first = members[0]
    expected = shard_names(first)
    for task in members[1:]:
        names = shard_names(task)
        if len(names) != len(expected):
            raise ValueError(f"tasks {first.name!r} and {task.name!r} share {first.base!r} but are cut into "
                             f"{len(expected)} and {len(names)} shards: give them the same shards")
        for s, (mine, theirs) in enumerate(zip(names, expected)):
            if mine != theirs:
                raise ValueError(f"tasks {first.name!r} and {task.name!r} share {first.base!r} but their shard {s} "
                                 f"holds different base weights: give them the same shards")


def shard_names(task) -> list[list[str]]:
    """The canonical names of the base weights in each shard of the task, sorted."""
    return [sorted(task.base_weights[id(p)] for p in shard if id(p) in task.base_weights)
            for shard in task.shard_params]
