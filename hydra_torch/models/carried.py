"""Tensors a piece hands along to later pieces that take no gradient: a decoder's attention masks and rotary
tables, computed once per micro-batch by its first piece.

A shard's floating inputs become leaves that take a gradient (its backward sends their gradients to the shard
before it); a float attention mask or a rotary table would then be saved per shard and get a gradient computed
in every layer's backward, for nothing. Wrapped in `Carried`, they travel as they are: moved between devices and
counted in what a micro-batch holds like any tensor (a Carried is a pytree node), never made to require a
gradient (`hydra_torch.run.compute.requiring_grad` passes it by).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import register_pytree_node, tree_map


class Carried:
    __slots__ = ("values",)

    def __init__(self, values):
        self.values = values  # a pytree (tuples) of tensors or None

    def __repr__(self) -> str:
        return f"Carried({self.values!r})"


def is_carried(node) -> bool:
    return isinstance(node, Carried)


def as_shard_input(x, requires_grad: bool):
    """`x` cut from its graph, its floating tensors as leaves that take a gradient or not as `requires_grad` says,
    but for what is Carried, which passes by as it is."""
    return tree_map(lambda t: t if is_carried(t) else
                    t.detach().requires_grad_(requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
                    else t, x, is_leaf=is_carried)


register_pytree_node(Carried, lambda c: ([c.values], None), lambda children, _: Carried(children[0]),
                     serialized_type_name="hydra_torch.models.carried.Carried")
