"""A task's evaluation pass through its shards, between two steps: E(0)..E(n-1) per validation batch, each
shard's forward under no_grad with its modules in eval mode, the last one computing the loss. It draws from no
training stream: a shuffled eval_data reads its order, and dropout-free modules draw nothing, under the task's
generator state without keeping what they leave, so training goes on exactly as without the evaluation."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_map

from hydra_torch.models.batch_tree import to_device
from hydra_torch.models.hf.adapter import check_drawn_batch
from hydra_torch.run.compute import floating, loss_value, run_shard
from hydra_torch.run.steps import END, DataLengthError


@contextmanager
def eval_mode(modules):
    """The modules in eval mode (no dropout, running statistics) for the block, each as it was afterwards."""
    modes = [(m, m.training) for module in modules for m in module.modules()]
    for module in modules:
        module.train(False)
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


class EvalPass:
    """One pass over the task's eval_data, run unit by unit."""

    def __init__(self, runner):
        self.count = len(runner.task.eval_data)
        with runner.rng.cpu_section(None, save=False):  # a shuffled loader's order, off the training stream
            self.batches = iter(runner.task.eval_data)
        self.batch = None      # the batch going through the shards
        self.x = None          # the next shard's input
        self.loss_sum = 0.0

    def run(self, runner, unit, slot) -> float | None:
        """E(s) of validation batch unit.micro_batch: reads the batch at shard 0, adds its loss at the last.
        Returns the pass's mean loss after its last unit, else None."""
        task, s, b, device = runner.task, unit.shard, unit.micro_batch, slot.device
        try:
            if s == 0:
                with runner.rng.cpu_section(None, save=False):
                    self.batch = next(self.batches, END)
                if self.batch is END:
                    raise DataLengthError(f"task {task.name!r}: eval_data ended after {b} batches, but "
                                          f"len(eval_data) is {self.count}")
                check_drawn_batch(task.adapter, self.batch)
                self.x = task.inputs(to_device(self.batch, device))
                if runner.compute_dtype != torch.float32:
                    self.x = tree_map(lambda t: t.to(runner.compute_dtype) if floating(t) else t, self.x)
            x = to_device(self.x, device)
            slot.loop.begin(unit)
            with eval_mode(task.modules[s]), torch.no_grad(), runner.rng.cpu_section(("evaluate", s), save=False), \
                    runner.rng.on_device(device, save=False):
                y = run_shard(task.modules[s], x)
                if s == runner.n - 1:
                    if runner.compute_dtype != torch.float32:
                        y = tree_map(lambda t: t.float() if floating(t) else t, y)
                    loss = task.loss_fn(y, to_device(self.batch, device))
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(f"task {task.name!r}: in the evaluation after step {runner.steps}, validation "
                               f"batch {b}, shard {s}")
            raise
        if s < runner.n - 1:
            self.x = y
            return None
        self.loss_sum += loss_value(loss, task.name)
        if b < self.count - 1:
            return None
        if next(self.batches, END) is not END:
            raise DataLengthError(f"task {task.name!r}: eval_data has more than len(eval_data) = {self.count} "
                                  "batches")
        return self.loss_sum / self.count
