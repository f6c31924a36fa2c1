"""Tensors a piece hands along to later pieces that take no gradient: a decoder's attention masks and rotary
tables, computed once per micro-batch by its first piece.

A shard's floating inputs become leaves that take a gradient (its backward sends their gradients to the shard
before it); a float attention mask or a rotary table would then be saved per shard and get a gradient computed
in every layer's backward, for nothing. Wrapped in `Carried`, they travel as they are: moved between devices and
counted in what a micro-batch holds like any tensor (a Carried is a pytree node), never made to require a
gradient (`hydra_torch.run.compute.requiring_grad` passes it by).
"""
from __future__ import annotations

from torch.utils._pytree import register_pytree_node


class Carried:
    __slots__ = ("values",)

    def __init__(self, values):
        self.values = values  # a pytree (tuples) of tensors or None

    def __repr__(self) -> str:
        return f"Carried({self.values!r})"


def is_carried(node) -> bool:
    return isinstance(node, Carried)


register_pytree_node(Carried, lambda c: ([c.values], None), lambda children, _: Carried(children[0]),
                     serialized_type_name="hydra_torch.models.carried.Carried")
