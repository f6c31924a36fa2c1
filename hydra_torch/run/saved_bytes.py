"""Saved activations on a device: what the micro-batches in flight hold there, measured, and the room the budget
leaves them.

A spilled task's micro-batch keeps each shard's input from its forward until that shard's backward; a resident
task's keeps the shard's whole autograd graph. The scheduler starts a new micro-batch on a device only while those
in flight there leave room for it (core/saved_bytes_gate.h); each slot's counter here is what they really held,
for the results and the tests."""
from __future__ import annotations

import threading

import torch
from torch.utils._pytree import tree_flatten

from hydra_torch.models.saved_tensors import distinct_bytes


class SavedBytes:
    """One device's saved bytes now and at most; charged and released from any device's thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.now = 0
        self.high_water = 0

    def charge(self, nbytes: int):
        with self._lock:
            self.now += nbytes
            self.high_water = max(self.high_water, self.now)

    def release(self, nbytes: int):
        with self._lock:
            self.now -= nbytes


def tensor_bytes(tree) -> int:
    """Bytes of the distinct tensors in `tree` (views of one storage count once)."""
    leaves, _ = tree_flatten(tree)
    return distinct_bytes(t for t in leaves if isinstance(t, torch.Tensor))


def kept_outside_arena(tasks) -> tuple[int, int]:
    """What each device's budget keeps outside the arena before any model is placed: one unit's working set
    and one spilled micro-batch's saved inputs, the largest of any task's as the planner measured them."""
    return (max((t.working_set_bytes for t in tasks), default=0), max((t.boundary_bytes for t in tasks), default=0))


def graphs_beyond_inputs(tasks) -> list[int]:
    """Per task, what a resident micro-batch of it (its whole autograd graph) holds beyond the spilled
    micro-batch kept_outside_arena counts: the placement keeps that outside the arena where it is resident."""
    inputs = max((t.boundary_bytes for t in tasks), default=0)
    return [max(0, t.graph_bytes - inputs) for t in tasks]


def allowance(budget: int, arena: int, working_set: int) -> int:
    """The bytes a device's budget leaves the saved activations: what neither the arena (the training state) nor
    one unit's working set takes. At least one micro-batch always runs (the scheduler's rule)."""
    return max(0, budget - arena - working_set)
