"""Optimizers hydra-torch runs natively on each shard's flat buffers.

They take torch.optim's arguments, defaults and semantics (a step is the same arithmetic as
torch.optim.AdamW/Adam/SGD on the same tensors) but hold no parameters: the engine applies them shard by
shard, on the host for spilled models (as soon as a shard's gradients arrive) or on the device for
resident ones. Arguments are checked when the optimizer is made, before any training state exists.
"""
from __future__ import annotations

from dataclasses import dataclass

from hydra_torch._loader import native as _C
from hydra_torch.recipe.param_groups import NO_WEIGHT_DECAY  # noqa: F401  (ht.optim.NO_WEIGHT_DECAY)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_adam(lr, betas, eps, weight_decay) -> None:
    _check(lr >= 0.0, f"invalid learning rate: {lr}")
    _check(eps >= 0.0, f"invalid epsilon value: {eps}")
    _check(len(betas) == 2, f"betas must be a pair, got {betas!r}")
    _check(0.0 <= betas[0] < 1.0, f"invalid beta parameter at index 0: {betas[0]}")
    _check(0.0 <= betas[1] < 1.0, f"invalid beta parameter at index 1: {betas[1]}")
    _check(weight_decay >= 0.0, f"invalid weight_decay value: {weight_decay}")


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam (L2 penalty added to the gradient)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        _check_adam(self.lr, self.betas, self.eps, self.weight_decay)

    def spec(self) -> _C.OptimizerSpec:
        spec = _C.OptimizerSpec()
        spec.kind = _C.OptimizerSpec.Kind.adam
        spec.lr, spec.eps, spec.weight_decay = float(self.lr), float(self.eps), float(self.weight_decay)
        spec.beta1, spec.beta2 = float(self.betas[0]), float(self.betas[1])
        spec.decoupled_weight_decay = False
        return spec


@dataclass(frozen=True)
class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay)."""

    weight_decay: float = 1e-2

    def spec(self) -> _C.OptimizerSpec:
        spec = super().spec()
        spec.decoupled_weight_decay = True
        return spec


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD with momentum, dampening, Nesterov and weight decay."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        _check(self.lr >= 0.0, f"invalid learning rate: {self.lr}")
        _check(self.momentum >= 0.0, f"invalid momentum value: {self.momentum}")
        _check(self.weight_decay >= 0.0, f"invalid weight_decay value: {self.weight_decay}")
        _check(not self.nesterov or (self.momentum > 0 and self.dampening == 0),
               "Nesterov momentum requires a momentum and zero dampening")

    def spec(self) -> _C.OptimizerSpec:
        spec = _C.OptimizerSpec()
        spec.kind = _C.OptimizerSpec.Kind.sgd
        spec.lr, spec.momentum = float(self.lr), float(self.momentum)
        spec.dampening, spec.weight_decay = float(self.dampening), float(self.weight_decay)
        spec.nesterov = bool(self.nesterov)
        return spec


OPTIMIZERS = (Adam, AdamW, SGD)
