"""Saved activations on a device: what the micro-batches in flight hold there, measured, and the room the budget
leaves them.

A spilled task's micro-batch keeps each shard's input from its forward until that shard's backward; a resident
task's keeps the shard's whole autograd graph. The scheduler starts a new micro-batch on a device only while those
in flight there leave room for it (core/saved_bytes_gate.h); each slot's counter here is what they really held,
for the results and the tests."""
from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_flatten


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
    return _distinct_bytes(t for t in leaves if isinstance(t, torch.Tensor))


def _distinct_bytes(tensors) -> int:
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


@contextmanager
def graph_tensors(out: list, modules):
    """Within it, the tensors autograd saves for the backward are appended to `out`, but for those of the modules'
    parameters (views of the arena, which holds them anyway)."""
    weights = {p.untyped_storage().data_ptr() for m in modules for p in m.parameters()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def allowance(budget: int, arena: int, working_set: int) -> int:
    """The bytes a device's budget leaves the saved activations: what neither the arena (the training state) nor
    one unit's working set takes. At least one micro-batch always runs (the scheduler's rule)."""
    return max(0, budget - arena - working_set)
