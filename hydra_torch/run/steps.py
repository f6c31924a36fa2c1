"""A task's plan of optimizer steps: which batches make each step (read as the steps need them), how many
micro-batches each has, and after which steps the task is evaluated. Torch-light: the scheduler's chain is
planned from these counts."""
from __future__ import annotations

import torch

from hydra_torch.models.first_batch import own_generators
from hydra_torch.task import ModelTask


class DataLengthError(ValueError):
    pass


def step_groups(task: ModelTask, on_epoch=None, start: int = 0, epoch_rng: torch.Tensor | None = None,
                epoch_loader: list | tuple = ()):
    """(epoch, batches, last of its epoch) for each optimizer step, `accumulate` batches each. Batches are read
    as the steps need them (one step's worth is held at a time), and each epoch must yield exactly len(data)
    batches: the scheduler planned the task from that length. An epoch is found longer only once its last step
    has trained, when the generator is resumed after it (for the next step, or at the task's end): every step
    len(data) promised is kept.

    Called where the CPU generator holds the task's state. `on_epoch(state, loader_states)` learns the
    generator's state as each epoch begins (what a shuffled loader draws its order from), and those of the
    loader's own generators (models.first_batch.own_generators). Resuming after `start` steps in the middle of an
    epoch replays that epoch's beginning from `epoch_rng` and `epoch_loader`, their states then, so the order is
    the same, and skips the batches its steps took; the generators then go on from where they were."""
    own = own_generators(task.data)
    expected = len(task.data)
    per_epoch = _epoch_step_sizes(expected, task.accumulate)
    steps = start
    first_epoch, skip = divmod(start, len(per_epoch))
    # Up to the epoch of the last step: resumed after that step (the end's length check), the generator must not
    # begin another epoch, reading data and drawing a shuffled order, where max_steps ends the run at an epoch's end.
    epochs = -(-task.total_steps // len(per_epoch))
    for epoch in range(first_epoch, epochs):
        replay = epoch == first_epoch and skip > 0
        if replay:
            current, current_loader = torch.get_rng_state(), [g.get_state() for g in own]
            torch.set_rng_state(epoch_rng)
            if len(epoch_loader) == len(own):  # else a checkpoint written before they were kept
                for g, state in zip(own, epoch_loader):
                    g.set_state(state)
        if on_epoch is not None:
            on_epoch(torch.get_rng_state(), [g.get_state() for g in own])
        batches = iter(task.data)
        read = 0
        for i, size in enumerate(per_epoch):
            if task.max_steps is not None and steps >= task.max_steps:
                return
            group = []
            for _ in range(size):
                try:
                    group.append(next(batches))
                except StopIteration:
                    raise DataLengthError(f"task {task.name!r}: epoch {epoch + 1} of data ended after {read} batches, "
                                          f"but len(data) is {expected}") from None
                read += 1
            if replay and i < skip:  # taken by the steps before the checkpoint
                if i == skip - 1:
                    torch.set_rng_state(current)
                    for g, state in zip(own, current_loader):
                        g.set_state(state)
                continue
            last = i == len(per_epoch) - 1
            # The epoch's end is read with its last group, not as the next step asks: a shuffling sampler draws
            # as it ends, so the loader's generators then stand where the next epoch starts them, and a checkpoint
            # at this boundary keeps them there.
            longer = last and next(batches, END) is not END
            steps += 1
            yield epoch, group, last
            if longer:
                raise DataLengthError(f"task {task.name!r}: epoch {epoch + 1} of data has more than len(data) = "
                                      f"{expected} batches; training stopped once it had trained those {expected}")


END = object()


def _epoch_step_sizes(batches: int, accumulate: int) -> list[int]:
    return [accumulate] * (batches // accumulate) + ([batches % accumulate] if batches % accumulate else [])


def step_sizes(task: ModelTask) -> list[int]:
    """Micro-batches in each optimizer step of the whole run, as step_groups will make them."""
    groups = _epoch_step_sizes(len(task.data), task.accumulate) * task.epochs
    return groups[:task.max_steps] if task.max_steps is not None else groups


def count_micro_batches(task: ModelTask, after_steps: int = 0) -> int:
    return sum(step_sizes(task)[after_steps:])


def eval_steps(task: ModelTask, extra=()) -> list[int]:
    """The steps after which the task is evaluated: every eval_every, the last, and `extra` (rungs of a
    selection rule) within the run."""
    if task.eval_data is None:
        return []
    total = task.total_steps
    steps = {total, *(s for s in extra if 0 < s <= total)}
    if task.eval_every is not None:
        steps.update(range(task.eval_every, total + 1, task.eval_every))
    return sorted(steps)
