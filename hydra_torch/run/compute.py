"""What a unit computes with: its inputs moved to the device, a shard's modules run in order, the loss read."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from hydra_torch.models.carried import as_shard_input


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
