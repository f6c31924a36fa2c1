"""The modes a training call runs in, whatever its caller's: autograd's and autocast's modes are the calling
thread's, and that thread runs the first device's units and every measurement (a notebook cell under
torch.no_grad(), say). Under no_grad every task failed and the planner measured no activations; under autocast the
first device's units alone computed in its dtype."""
from __future__ import annotations

import contextlib
import warnings

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def training_modes(call: str, stacklevel: int):
    """Gradients on, inference mode and any autocast off, for the `call` (its name in a warning); the caller's modes
    come back as they were. An autocast that was on is warned of, where the user's code calls: `stacklevel` 1 where
    that is the call's caller, 2 where one more frame lies between (Arrivals.add's run handle)."""
    on = [device for device in AUTOCAST_DEVICES if torch.amp.is_autocast_available(device)
          and torch.is_autocast_enabled(device)]
    if on:
        warnings.warn(f"{call} is called under torch.autocast({', '.join(map(repr, on))}), which it does not apply: "
                      "a task's precision='bf16' computes in bf16 (autocast is the calling thread's: it would reach "
                      "some units alone)", UserWarning, stacklevel=stacklevel + 3)  # + this, contextlib, the call
    with contextlib.ExitStack() as modes:
        modes.enter_context(torch.inference_mode(False))
        modes.enter_context(torch.enable_grad())
        for device in on:
            modes.enter_context(torch.autocast(device, enabled=False))
        yield
