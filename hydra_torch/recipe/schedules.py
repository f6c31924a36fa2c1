"""Learning-rate schedules: the multiplier of the optimizer's learning rate at each step of a task.

The names and semantics are `transformers.get_scheduler`'s (a LambdaLR stepped after every optimizer step):
step k, counting from 0, trains with lr * multiplier(k), so with warmup the first step's rate is 0. "linear",
"cosine", "constant" and "constant_with_warmup" are computed here; any other name get_scheduler knows is
taken from transformers when it is installed. A callable step -> multiplier is used as LambdaLR would.
"""
from __future__ import annotations

import functools
import math
from typing import Callable

from hydra_torch.recipe.callables import check_callable
from hydra_torch.recipe.reals import whole


def _warmup(step: int, warmup_steps: int) -> float:
    return float(step) / float(max(1, warmup_steps))


def _constant(step: int, warmup_steps: int, total_steps: int) -> float:
    return _warmup(step, warmup_steps) if step < warmup_steps else 1.0


def _linear(step: int, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    return max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))


def _cosine(step: int, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return _warmup(step, warmup_steps)
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # half a cycle, as get_scheduler's default


_NATIVE = {"linear": _linear, "cosine": _cosine, "constant": _constant, "constant_with_warmup": _constant}


def check(schedule, warmup_steps) -> None:
    """Refuses a schedule ModelTask cannot use, when the task is made."""
    if not whole(warmup_steps):
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if schedule is None or callable(schedule):
        if warmup_steps and schedule is not None:
            raise ValueError("warmup_steps is for a named lr_schedule; a callable lr_schedule has its own warmup")
        if schedule is not None:
            check_callable(schedule, "lr_schedule", "lr_schedule(step) -> multiplier", 1)
        return
    if not isinstance(schedule, str):
        raise TypeError(f"lr_schedule must be a name such as 'linear' or 'cosine', or a callable step -> "
                        f"multiplier, got {type(schedule).__name__}")
    if schedule == "constant" and warmup_steps:
        raise ValueError("lr_schedule='constant' has no warmup: use 'constant_with_warmup'")
    if schedule in _NATIVE:
        return
    try:
        from transformers import SchedulerType
    except ImportError:
        raise ValueError(f"unknown lr_schedule {schedule!r}: use one of {sorted(_NATIVE)} or a callable "
                         "(other transformers.get_scheduler names need transformers installed)") from None
    names = {t.value for t in SchedulerType} - {"reduce_lr_on_plateau", "greedy"}  # not a function of the step
    if schedule not in names:
        raise ValueError(f"unknown lr_schedule {schedule!r}: use one of {sorted(names | set(_NATIVE))} or a "
                         "callable step -> multiplier")
    try:  # some need arguments of their own (cosine_with_min_lr: a minimum), which ModelTask does not take
        _from_transformers(schedule, warmup_steps, max(warmup_steps, 1) + 1)
    except (TypeError, ValueError) as error:
        raise ValueError(f"lr_schedule {schedule!r} cannot be used here: {error}; pass a callable "
                         "step -> multiplier instead") from None


def multipliers(schedule, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The function step -> multiplier for a task of `total_steps` steps."""
    if schedule is None:
        return lambda step: 1.0
    if callable(schedule):
        return schedule
    if schedule in _NATIVE:
        return functools.partial(_NATIVE[schedule], warmup_steps=warmup_steps, total_steps=total_steps)
    return _from_transformers(schedule, warmup_steps, total_steps)


def _from_transformers(name: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    import torch
    from transformers import get_scheduler

    # get_scheduler builds a LambdaLR around an optimizer; its lambda is all that is kept.
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup_steps, num_training_steps=total_steps).lr_lambdas[0]


def multiplier_at(function: Callable[[int], float], step: int, task_name: str) -> float:
    """The multiplier for `step`, checked: a finite number >= 0."""
    value = function(step)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"task {task_name!r}: lr_schedule({step}) returned {value!r}, not a number") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"task {task_name!r}: lr_schedule({step}) = {value}: a learning-rate multiplier must be "
                         "finite and >= 0")
    return value
