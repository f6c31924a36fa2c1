"""What a unit computes with: its inputs moved to the device, a shard's modules run in order, the loss read."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten, tree_leaves

from hydra_torch.models.carried import as_shard_input, is_carried


class NonFiniteLossError(RuntimeError):
    pass


class NonFiniteGradNormError(RuntimeError):
    """A clipped step's global gradient norm was not finite (the loss was): no shard stepped."""


def run_shard(modules, x):
    for module in modules:
        x = module(x)
    return x


def floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def requiring_grad(x):
    """`x` cut from its graph, its floating tensors as leaves that take a gradient (a shard's input), but for
    what is Carried along (masks, rotary tables), which takes none."""
    return as_shard_input(x, requires_grad=True)


def input_grads(x_in) -> list:
    """The gradients of a shard's input leaves (see requiring_grad), None for what is not floating."""
    leaves, _ = tree_flatten(x_in)
    return [t.grad if floating(t) else None for t in leaves]


def check_loss(loss, task_name: str):
    """A scalar tensor, checked without reading its value (which would wait for the device)."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"task {task_name!r}: loss_fn must return a scalar tensor, got {shape}")


def loss_value(loss, task_name: str) -> float:
    check_loss(loss, task_name)
    return float(loss.detach())


IN_PLACE_ON_LEAF = "a leaf Variable that requires grad is being used in an in-place operation"


@contextlib.contextmanager
def in_place_refused(task_name: str, s: int, modules):
    """Autograd's error for a shard that changes its input (a leaf that takes a gradient) in place, said as what
    to do about it."""
    try:
        yield
    except RuntimeError as error:
        if IN_PLACE_ON_LEAF in str(error):
            raise in_place_error(task_name, s, modules) from error
        raise


def in_place_error(task_name: str, s: int, modules) -> ValueError:
    first = type(modules[0]).__name__ if len(modules) else "its first module"
    return ValueError(f"task {task_name!r}: shard {s} changes its input in place ({first} at its start: an "
                      "inplace=True activation, say), and a shard's input is kept for its backward, which runs its "
                      "forward again from it. Cut the model elsewhere (shards=[...] without a boundary just before "
                      "it) or make the operation out of place")


def input_versions(x) -> list[tuple[torch.Tensor, int]]:
    """A shard's input tensors and their version counters, which an in-place change moves (Carried ones aside)."""
    return [(t, t._version) for t in tree_leaves(x, is_leaf=is_carried) if isinstance(t, torch.Tensor)]


def check_handed_on(task_name: str, s: int, modules, params, versions, y) -> None:
    """Refuses, before any step, what a shard's forward did that its backward's recompute or the later shards
    cannot follow: its input changed in place, its own parameter handed on (a spilled shard's weights leave the
    device once it has run, and later shards would read memory others reuse), an object holding tensors that is
    no pytree node handed on (its tensors would get no gradient). `params`: the shard's (ModelTask.shard_params)."""
    if any(t._version != version for t, version in versions):
        raise in_place_error(task_name, s, modules)
    own = {id(p) for p in params}
    for leaf in tree_leaves(y, is_leaf=is_carried):
        if isinstance(leaf, torch.Tensor):
            if id(leaf) in own or (leaf._base is not None and id(leaf._base) in own):
                raise ValueError(f"task {task_name!r}: shard {s} hands on its own parameter (of shape "
                                 f"{tuple(leaf.shape)}): use it in the shard that holds it, or hand on a copy "
                                 "(.clone())")
        elif not is_carried(leaf) and _holds_tensors(leaf):
            raise TypeError(f"task {task_name!r}: shard {s} hands on a {type(leaf).__name__}, which holds tensors but "
                            "is no pytree node, so they would get no gradient: hand on a tuple, dict or namedtuple, "
                            "or register the type (torch.utils._pytree.register_dataclass)")


def _holds_tensors(obj) -> bool:
    fields = vars(obj).values() if hasattr(obj, "__dict__") else \
        [getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ())]
    return any(isinstance(value, torch.Tensor) for value in fields)
