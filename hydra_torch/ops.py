"""Fused optimizer updates as torch ops (torch.ops.hydra.*), usable eagerly and under torch.compile.

Each call performs one optimizer step on one flat parameter in place: param, its state and the optional
bfloat16 shadow copy are read once and written once. Arithmetic matches torch.optim's single-tensor
implementations, so swapping them changes no result beyond float rounding of a few ulps at most.
"""
from typing import Optional

import torch
from torch import Tensor

from hydra_torch._loader import native  # noqa: F401  (defines the hydra ops the fakes below register for)


def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, shadow: Optional[Tensor] = None, *,
              lr: float, step: int, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
              weight_decay: float = 0.0, grad_scale: float = 1.0, decoupled: bool = True) -> None:
    """One Adam (decoupled=False) or AdamW (decoupled=True) step. `step` counts this update (first is 1);
    `grad_scale` multiplies the gradient first (e.g. a global-norm clipping coefficient); `shadow`, a
    bfloat16 tensor like param, receives the updated param rounded to bfloat16."""
    torch.ops.hydra.adam_step(param, grad, exp_avg, exp_avg_sq, shadow, lr, beta1, beta2, eps, weight_decay, step,
                              grad_scale, decoupled)


def sgd_step(param: Tensor, grad: Tensor, momentum_buffer: Optional[Tensor] = None, shadow: Optional[Tensor] = None,
             *, lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
             nesterov: bool = False, first_step: bool = False, grad_scale: float = 1.0) -> None:
    """One SGD step. With momentum, `first_step=True` initialises momentum_buffer from the gradient as
    torch.optim.SGD does on its first step (the buffer's old contents are ignored)."""
    torch.ops.hydra.sgd_step(param, grad, momentum_buffer, shadow, lr, momentum, dampening, weight_decay, nesterov,
                             first_step, grad_scale)


# The ops mutate their inputs and return nothing, so tracing needs no output metadata.
@torch.library.register_fake("hydra::adam_step")
def _adam_step_fake(param, grad, exp_avg, exp_avg_sq, shadow, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
                    decoupled):
    return None


@torch.library.register_fake("hydra::sgd_step")
def _sgd_step_fake(param, grad, momentum_buffer, shadow, lr, momentum, dampening, weight_decay, nesterov, first_step,
                   grad_scale):
    return None
