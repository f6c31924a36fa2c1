"""Optimizers hydra-torch runs natively on each shard's flat buffers.

They take torch.optim's arguments, defaults and semantics (a step is the same arithmetic as
torch.optim.AdamW/Adam/SGD on the same tensors) but hold no parameters: the engine applies them shard by
shard, on the host for spilled models (as soon as a shard's gradients arrive) or on the device for
resident ones. Arguments are checked when the optimizer is made, before any training state exists.

torch.optim's keyword arguments that choose its implementation (foreach, fused, capturable) are taken and change
nothing: the step is always hydra-torch's own fused kernel. Those that change what a step computes (amsgrad,
maximize, differentiable) are refused when set, naming what is missing; they are not kept, so a checkpoint's
record of its optimizer is what it was.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, InitVar, dataclass

from hydra_torch._loader import native as _C
from hydra_torch.recipe.param_groups import NO_WEIGHT_DECAY  # noqa: F401  (ht.optim.NO_WEIGHT_DECAY)
from hydra_torch.recipe.reals import real


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _as_reals(optimizer, *names: str) -> None:
    for name in names:
        object.__setattr__(optimizer, name, real(name, getattr(optimizer, name)))


def _check_adam(lr, betas, eps, weight_decay) -> None:
    _check(lr >= 0.0, f"invalid learning rate: {lr}")
    _check(eps >= 0.0, f"invalid epsilon value: {eps}")
    _check(0.0 <= betas[0] < 1.0, f"invalid beta parameter at index 0: {betas[0]}")
    _check(0.0 <= betas[1] < 1.0, f"invalid beta parameter at index 1: {betas[1]}")
    _check(weight_decay >= 0.0, f"invalid weight_decay value: {weight_decay}")


# What each refused torch.optim argument would need of the native step.
_REFUSED = {"amsgrad": "AMSGrad's running maximum of the second moment",
            "maximize": "maximizing (negate the loss instead)",
            "differentiable": "autograd through the step"}


def _check_torch_arguments(optimizer, **arguments) -> None:
    """torch.optim's arguments beyond the arithmetic this optimizer keeps (see the module)."""
    for name, value in arguments.items():
        if name in _REFUSED and value:
            raise ValueError(f"{type(optimizer).__name__}({name}={value!r}) is not supported: hydra-torch's native "
                             f"step has no {_REFUSED[name]}")
    if arguments.get("decoupled_weight_decay") and type(optimizer) is Adam:
        raise ValueError("Adam(decoupled_weight_decay=True) is AdamW: use ht.optim.AdamW")


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam (L2 penalty added to the gradient)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    _: KW_ONLY
    amsgrad: InitVar[bool] = False
    maximize: InitVar[bool] = False
    foreach: InitVar[bool | None] = None
    capturable: InitVar[bool] = False
    differentiable: InitVar[bool] = False
    fused: InitVar[bool | None] = None
    decoupled_weight_decay: InitVar[bool] = False

    def __post_init__(self, amsgrad, maximize, foreach, capturable, differentiable, fused, decoupled_weight_decay):
        _check_torch_arguments(self, amsgrad=amsgrad, maximize=maximize, differentiable=differentiable,
                               decoupled_weight_decay=decoupled_weight_decay)
        _as_reals(self, "lr", "eps", "weight_decay")
        try:
            pair = tuple(self.betas)  # a tuple, a list, an array or a tensor of two
        except TypeError:
            pair = ()
        if len(pair) != 2:
            raise ValueError(f"betas must be a pair, got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(real("betas", beta) for beta in pair))
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
    _: KW_ONLY
    maximize: InitVar[bool] = False
    foreach: InitVar[bool | None] = None
    differentiable: InitVar[bool] = False
    fused: InitVar[bool | None] = None

    def __post_init__(self, maximize, foreach, differentiable, fused):
        _check_torch_arguments(self, maximize=maximize, differentiable=differentiable)
        _as_reals(self, "lr", "momentum", "dampening", "weight_decay")
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
