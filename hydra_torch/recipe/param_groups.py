"""Parameter groups: a learning rate and weight decay for some parameters other than the optimizer's, as
torch.optim's param_groups, chosen by what a parameter is rather than by listing tensors.

A group is a dict: "params" selects (a name pattern such as "*.bias", a module type such as nn.LayerNorm, a
callable (name, parameter) -> bool, `NO_WEIGHT_DECAY`, or a list of these, any of which may match), and "lr" and
"weight_decay" override the optimizer's. A parameter takes the first group that selects it; the others keep
the optimizer's settings. Names are the model's `named_parameters()` names (a tied parameter matches by any
of its names).
"""
from __future__ import annotations

import fnmatch
import math
import re

from torch import nn

from hydra_torch.recipe.callables import check_callable
from hydra_torch.recipe.reals import real

_KEYS = {"params", "lr", "weight_decay"}


class _NoWeightDecay:
    """transformers.Trainer's rule for parameters that take no weight decay: those of nn.LayerNorm modules and
    those whose (lower-case) name has bias, layernorm, rmsnorm or a norm component (Trainer.get_decay_parameter_names)."""

    _NAMES = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]

    def matches(self, name: str, module: nn.Module) -> bool:
        return isinstance(module, nn.LayerNorm) or any(p.search(name.lower()) for p in self._NAMES)

    def __repr__(self):
        return "NO_WEIGHT_DECAY"


NO_WEIGHT_DECAY = _NoWeightDecay()


def _named(root: nn.Module):
    """(name, parameter, the module that holds it) for every name of every parameter."""
    for module_name, module in root.named_modules(remove_duplicate=False):
        for attribute, param in module._parameters.items():
            if param is not None:
                yield (f"{module_name}.{attribute}" if module_name else attribute), param, module


def _selects(selector, name: str, param, module) -> bool:
    if isinstance(selector, str):
        return fnmatch.fnmatchcase(name, selector)
    if isinstance(selector, _NoWeightDecay):
        return selector.matches(name, module)
    if isinstance(selector, type) or (isinstance(selector, tuple) and all(isinstance(t, type) for t in selector)):
        return isinstance(module, selector)
    if isinstance(selector, list):
        return any(_selects(s, name, param, module) for s in selector)
    return bool(selector(name, param))


def _check_group(index: int, group) -> None:
    where = f"param_groups[{index}]"
    if not isinstance(group, dict) or "params" not in group:
        raise TypeError(f"{where} must be a dict with 'params' (a name pattern, a module type, a callable "
                        "(name, parameter) -> bool, or a list of these) and 'lr' and/or 'weight_decay'")
    unknown = set(group) - _KEYS
    if unknown:
        raise ValueError(f"{where} has {sorted(unknown)}: a group sets only 'lr' and 'weight_decay'")
    selector = group["params"]
    selectors = selector if isinstance(selector, list) else [selector]
    for s in selectors:
        if not (isinstance(s, (str, _NoWeightDecay, type, tuple)) or callable(s)):
            raise TypeError(f"{where}['params'] = {s!r}: use a name pattern, a module type or a callable")
        if callable(s) and not isinstance(s, (_NoWeightDecay, type)):
            check_callable(s, f"{where}['params']", "select(name, parameter) -> bool", 2)
    for key in ("lr", "weight_decay"):
        value = group.get(key, 0.0)
        try:
            number = real(f"{where}['{key}']", value)
        except TypeError:
            number = math.nan
        if not math.isfinite(number) or number < 0:
            raise ValueError(f"{where}['{key}'] must be a finite number >= 0, got {value!r}")


def resolve(groups, root: nn.Module, optimizer) -> dict[int, tuple]:
    """id(parameter) -> (parameter, lr, weight_decay) for every parameter a group selects. Raises before
    anything is trained: a malformed group, or one that selects no parameter."""
    if groups is None:
        return {}
    if not isinstance(groups, (list, tuple)):
        raise TypeError("param_groups must be a list of dicts")
    for index, group in enumerate(groups):
        _check_group(index, group)
    chosen: dict[int, tuple] = {}
    selected = [False] * len(groups)
    for name, param, module in _named(root):
        for index, group in enumerate(groups):
            if _selects(group["params"], name, param, module):
                selected[index] = True
                chosen.setdefault(id(param), (param, real("lr", group.get("lr", optimizer.lr)),
                                              real("weight_decay", group.get("weight_decay", optimizer.weight_decay))))
                break
    for index, hit in enumerate(selected):
        if not hit:
            raise ValueError(f"param_groups[{index}] selects no parameter: {groups[index]['params']!r} matches "
                             "none of the model's parameter names or modules")
    return chosen
