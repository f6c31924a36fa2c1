"""Callable arguments checked against the calls hydra-torch makes of them, when the task is made: a loss_fn that
takes the output alone failed at its task's first unit, after the run's planning and measuring."""
from __future__ import annotations

import inspect


def check_callable(value, label: str, form: str, arguments: int) -> None:
    """Raises TypeError, naming `form`, where `value` is not callable or cannot take `arguments` positional
    arguments. One without a signature to read (a builtin, an extension's function) is taken as it is."""
    if not callable(value):
        raise TypeError(f"{label} must be callable as {form}")
    try:
        signature = inspect.signature(value)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*[None] * arguments)
    except TypeError as error:
        raise TypeError(f"{label} must be callable as {form}: {error}") from None
