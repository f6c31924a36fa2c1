"""The training loop of one task on one device: shards in order, boundary checkpoints, native memory.

Forward runs shards 0..n-1 under no_grad, keeping only each shard's input. The last shard runs with
autograd and its loss is back-propagated at once (it is never recomputed). Backward then visits shards
n-2..0, re-running each one's forward from its saved input with the RNG state it had the first time (so
dropout draws the same mask), and hands the input gradient down. Everything about memory and copies is the
engine's: one native call per shard visit.
"""
from __future__ import annotations

import math

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hydra_torch.task import ModelTask


class NonFiniteLossError(RuntimeError):
    pass


def _run_shard(modules, x):
    for module in modules:
        x = module(x)
    return x


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


class _RngState:
    """The global generators a shard's forward may draw from: the CPU one, and the device's."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


class TaskRunner:
    def __init__(self, task: ModelTask, engine, model_id: int, device: torch.device):
        self.task = task
        self.engine = engine
        self.id = model_id
        self.device = device
        self.compute_dtype = torch.bfloat16 if task.precision == "bf16" else torch.float32
        self.losses: list[float] = []
        self.steps = 0
        self.epochs_done = 0

    # -- data --------------------------------------------------------------------------------------------
    def _to_device(self, batch):
        return tree_map(lambda t: t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)

    def step_groups(self):
        """Lists of `accumulate` batches, each one optimizer step; a shorter last group is a step too."""
        for epoch in range(self.task.epochs):
            group = []
            for batch in self.task.data:
                group.append(batch)
                if len(group) == self.task.accumulate:
                    yield group
                    group = []
            if group:
                yield group
            self.epochs_done = epoch + 1

    def run(self):
        for group in self.step_groups():
            if self.task.max_steps is not None and self.steps >= self.task.max_steps:
                break
            self.train_step(group)

    # -- one optimizer step --------------------------------------------------------------------------------
    def train_step(self, group):
        n, engine = self.task.num_shards, self.engine
        visits = list(range(n)) + list(range(n - 2, -1, -1))
        engine.plan(self.id, visits * len(group))
        clip = self.task.clip_grad_norm
        total = 0.0
        try:
            for j, batch in enumerate(group):
                last = j == len(group) - 1
                total += self._micro_batch(batch, len(group), step=last and clip is None)
            if clip is not None:
                engine.clip_and_step(self.id, float(clip))
        except BaseException:
            engine.discard_grads(self.id)
            raise
        self.steps += 1
        self.losses.append(total / len(group))

    def _micro_batch(self, batch, count: int, step: bool) -> float:
        n, engine, modules = self.task.num_shards, self.engine, self.task.modules
        batch = self._to_device(batch)
        x = self.task.inputs(batch)
        if self.compute_dtype != torch.float32:
            x = tree_map(lambda t: t.to(self.compute_dtype) if _floating(t) else t, x)
        saved, rng = [], []
        for s in range(n - 1):
            engine.acquire(self.id, s, with_grads=False)
            try:
                engine.prefetch(self.id, s + 1)
                rng.append(_RngState(self.device))
                with torch.no_grad():
                    y = _run_shard(modules[s], x)
            finally:
                engine.release(self.id, s)
            saved.append(x)
            x = y

        grad = None
        engine.acquire(self.id, n - 1, with_grads=True)
        try:
            if n > 1:
                engine.prefetch(self.id, n - 2)
            x_in = self._requires_grad(x)
            with torch.enable_grad():
                out = _run_shard(modules[n - 1], x_in)
                if self.compute_dtype != torch.float32:
                    out = tree_map(lambda t: t.float() if _floating(t) else t, out)
                loss = self.task.loss_fn(out, batch)
                value = self._check_loss(loss)
            after_forward = _RngState(self.device)
            (loss / count).backward()
            grad = self._input_grads(x_in)
            engine.backward_done(self.id, n - 1, step=step)
        finally:
            engine.release(self.id, n - 1)

        for s in range(n - 2, -1, -1):
            engine.acquire(self.id, s, with_grads=True)
            try:
                if s > 0:
                    engine.prefetch(self.id, s - 1)
                rng[s].restore()
                x_in = self._requires_grad(saved[s])
                with torch.enable_grad():
                    y = _run_shard(modules[s], x_in)
                    outputs, _ = tree_flatten(y)
                    pairs = [(o, g) for o, g in zip(outputs, grad) if g is not None and o.requires_grad]
                    if pairs:
                        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                grad = self._input_grads(x_in) if s > 0 else None
                engine.backward_done(self.id, s, step=step)
            finally:
                engine.release(self.id, s)
        after_forward.restore()
        return value

    @staticmethod
    def _requires_grad(x):
        return tree_map(lambda t: t.detach().requires_grad_(True) if _floating(t) else t, x)

    @staticmethod
    def _input_grads(x_in):
        leaves, _ = tree_flatten(x_in)
        return [t.grad if _floating(t) else None for t in leaves]

    def _check_loss(self, loss) -> float:
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"task {self.task.name!r}: loss_fn must return a scalar tensor, got {shape}")
        value = float(loss.detach())
        if not math.isfinite(value):
            raise NonFiniteLossError(f"task {self.task.name!r}: the loss is {value} at step {self.steps}; "
                                     "training stopped and the weights of the last good step were kept")
        return value
