"""What autograd keeps for the backward, counted in device bytes: each storage once, the weights aside (they are
budgeted already). The planner counts a piece's activations this way where no allocator reports a peak, and the
runner what each micro-batch in flight holds."""
from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def saved_tensors(out: list, parameters):
    """Within it, the tensors autograd saves for the backward are appended to `out`, but for views of
    `parameters`' storages."""
    weights = {p.untyped_storage().data_ptr() for p in parameters}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            out.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def distinct_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each counted once (views of one storage share it)."""
    storages = {}
    for t in tensors:
        storage = t.untyped_storage()
        storages[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
