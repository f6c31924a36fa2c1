"""Task factories for the cluster tests: importable by the nodes' worker processes (the tests put this
directory on their PYTHONPATH), deterministic in their models, data and order."""
from __future__ import annotations

import time

import hydra_torch as ht
from models import lm_loss, tied_transformer, token_batches


class SlowBatches:
    """A list of batches read at a set pace: long enough runs for a node to die in the middle of one."""

    def __init__(self, batches, seconds: float):
        self.batches, self.seconds = batches, seconds

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            time.sleep(self.seconds)
            yield batch


def make_task(name: str, seed: int, steps: int = 8, blocks: int = 2, seconds_per_batch: float = 0.0):
    model = tied_transformer(seed=seed, blocks=blocks)
    data = token_batches(steps, seed=seed + 100)
    if seconds_per_batch:
        data = SlowBatches(data, seconds_per_batch)
    return ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=3e-3, weight_decay=0.01), loss_fn=lm_loss, data=data,
                        name=name)


class NanAfter:
    """The language-model loss, NaN from its `calls`-th call on: a task that fails by itself."""

    def __init__(self, calls: int):
        self.calls, self.seen = calls, 0

    def __call__(self, output, batch):
        self.seen += 1
        loss = lm_loss(output, batch)
        return loss * float("nan") if self.seen >= self.calls else loss


def make_frozen_task(name: str, seed: int):
    task = make_task(name, seed)
    task.model.requires_grad_(False)
    return task


def make_failing_task(name: str, seed: int):
    task = make_task(name, seed)
    task.loss_fn = NanAfter(3)
    return task


class BuildsOnce:
    """A factory that works where it is first called (the driver) and raises on any later call (a node): a
    task that cannot be built where it would train."""

    def __init__(self, name: str, seed: int):
        self.name, self.seed, self.calls = name, seed, 0

    def __call__(self):
        self.calls += 1
        if self.calls > 1:
            raise OSError(f"{self.name}: its data is not on this node")
        return make_task(self.name, self.seed)
