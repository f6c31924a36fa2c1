"""One training micro-batch of a task in flight: its batch, what each shard's forward saved for the backward, and
the saved bytes it holds on the devices until then."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MicroBatch:
    batch: object
    x: object
    count: int                       # micro-batches in this optimizer step
    last: bool                       # the step's last micro-batch: its backward triggers the step
    saved: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)   # shard -> the task's generator states its forward started from
    grad: list | None = None
    loss: object = None              # its _C.LossReading: the loss on its way to the host, read at its end
    held: dict = field(default_factory=dict)  # shard -> (the device's SavedBytes, bytes its saved input holds)
    buffers: dict = field(default_factory=dict)  # shard -> {(id(module), name): a buffer as its forward read it}

    def let_go(self, shard=None):
        """The saved bytes of `shard` (None: of every shard still holding some) given back to their devices."""
        for s in list(self.held) if shard is None else [shard]:
            counter, nbytes = self.held.pop(s, (None, 0))
            if counter is not None:
                counter.release(nbytes)
