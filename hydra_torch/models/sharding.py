"""Cutting a model into shards: consecutive groups of layers that visit the device together."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def root_module(model, pieces) -> nn.Module:
    """The module whose parameter names name a task's parameters: the model, or its pieces in a ModuleList."""
    return model if isinstance(model, nn.Module) else nn.ModuleList(pieces)


def model_pieces(model) -> list[nn.Module]:
    """The ordered layers of `model`: an nn.Sequential's, or a list of modules. A module used at several places
    is a layer at each, as the model's forward runs it (its parameters then train as one tied weight)."""
    if not isinstance(model, (nn.Sequential, list, tuple, nn.ModuleList)):
        raise TypeError(
            f"cannot cut a {type(model).__name__} into shards: pass an nn.Sequential, a list of modules, "
            "or explicit shards=[[module, ...], ...]")
    pieces = list(model)  # not model.children(), which lists a reused module once
    for i, piece in enumerate(pieces):
        if not isinstance(piece, nn.Module):
            raise TypeError(f"layer {i} of the model is a {type(piece).__name__}, not an nn.Module")
    if not pieces:
        raise ValueError("the model is empty: it has no layers to train")
    return pieces


def _balanced_cuts(sizes: Sequence[int], count: int) -> list[int]:
    """Start indices of `count` contiguous groups minimising the largest group's total (linear partition)."""
    n = len(sizes)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: smallest possible largest group when the first i pieces form k groups.
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0
    for k in range(1, count + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(count, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def halved(groups: list[list[nn.Module]]) -> list[list[nn.Module]] | None:
    """`groups` with every shard of two or more modules cut in two, balanced by parameter count; None when
    every shard is a single module already."""
    out = []
    for group in groups:
        if len(group) == 1:
            out.append(list(group))
            continue
        _, cut = _balanced_cuts([sum(p.numel() for p in m.parameters()) for m in group], 2)
        out += [list(group[:cut]), list(group[cut:])]
    return out if len(out) > len(groups) else None


def starts_in(groups: list[list[nn.Module]], pieces: list[nn.Module]) -> list[int] | None:
    """The pieces the shards `groups` start at, where they cut `pieces` in order (None where they do not)."""
    starts, flat = [], []
    for group in groups:
        starts.append(len(flat))
        flat += group
    same = len(flat) == len(pieces) and all(a is b for a, b in zip(flat, pieces))
    return starts if same else None


def _leaves(modules) -> list[nn.Module]:
    """`modules` with every plain nn.Sequential (no forward of its own) replaced by its layers, recursively: what
    runs, one layer after another."""
    out = []
    for module in modules:
        out += _leaves(list(module)) if type(module) is nn.Sequential else [module]
    return out


def _out_of_order(groups: list[list[nn.Module]], pieces: list[nn.Module]) -> str | None:
    """What keeps `groups` from running `pieces` in order (None where they do): the first place that differs,
    plain nn.Sequential containers opened on both sides."""
    flat = _leaves(module for group in groups for module in group)
    layers = _leaves(pieces)

    def layer(index: int) -> str:
        return f"layer {index} ({type(layers[index]).__name__})"

    for place in range(max(len(flat), len(layers))):
        if place < len(flat) and place < len(layers) and flat[place] is layers[place]:
            continue
        if place >= len(flat):
            return f"{layer(place)} is missing"
        module = flat[place]
        at = [i for i, m in enumerate(layers) if m is module]  # a module the model runs at several places
        if not at:
            return f"place {place} holds a {type(module).__name__} that is not one of its layers"
        listed = sum(m is module for m in flat[:place])
        if listed >= len(at):
            return f"{layer(at[-1])} is there twice"
        if place < len(layers) and not any(m is layers[place] for m in flat):
            return f"{layer(place)} is missing"
        return f"{layer(at[listed])} is at place {place}" + (
            f", where {layer(place)} belongs" if place < len(layers) else "")
    return None


def is_explicit(shards) -> bool:
    """Whether `shards` lists the modules of each shard (rather than a count or start indices)."""
    return isinstance(shards, (list, tuple)) and bool(shards) and all(isinstance(g, (list, tuple)) for g in shards)


def split(model, shards=None) -> list[list[nn.Module]]:
    """Shards of `model`.

    shards: None (each layer is a shard), an int (that many shards balanced by parameter count), a list of
    start indices (``[0, 4, 8]``), or explicit groups of modules (``[[m0, m1], [m2]]``, any model).
    """
    if is_explicit(shards):
        groups = [list(group) for group in shards]
        for i, group in enumerate(groups):
            if not group or not all(isinstance(m, nn.Module) for m in group):
                raise TypeError(f"shard {i} must be a non-empty list of nn.Module")
        if isinstance(model, (nn.Sequential, list, tuple, nn.ModuleList)):  # else the groups alone say what runs
            pieces = model_pieces(model)
            wrong = _out_of_order(groups, pieces)
            if wrong:
                raise ValueError(f"shards: the groups must hold the model's {len(_leaves(pieces))} layers in order "
                                 f"(those of an nn.Sequential in it too), each at its place, as its forward runs "
                                 f"them: {wrong}; to cut its top-level layers, give start indices (e.g. "
                                 f"[0, {len(pieces) // 2}])")
        return groups
    pieces = model_pieces(model)
    if shards is None:
        return [[piece] for piece in pieces]
    if isinstance(shards, bool) or not isinstance(shards, (int, list, tuple)):
        raise TypeError(f"shards must be None, an int, a list of start indices or of module lists; got {shards!r}")
    if isinstance(shards, int):
        if not 1 <= shards <= len(pieces):
            raise ValueError(f"shards={shards} must be between 1 and the model's {len(pieces)} layers")
        sizes = [sum(p.numel() for p in piece.parameters()) for piece in pieces]
        starts = _balanced_cuts(sizes, shards)
    else:
        starts = list(shards)
        if (not starts or starts[0] != 0 or any(not isinstance(s, int) for s in starts)
                or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= len(pieces)):
            raise ValueError(f"shard start indices must be increasing ints from 0 below {len(pieces)}; got {shards!r}")
    ends = starts[1:] + [len(pieces)]
    return [pieces[a:b] for a, b in zip(starts, ends)]


def refuse_in_place_weights(groups: list[list[nn.Module]]) -> None:
    """Refuses a module whose forward changes its own weight in place (an Embedding with max_norm renormalises the
    rows it looks up): a spilled shard's weights on the device are a copy whose change the host's master, which
    the step starts from, never sees."""
    for group in groups:
        for module in group:
            for sub in module.modules():
                if isinstance(sub, nn.Embedding) and sub.max_norm is not None:
                    raise ValueError(f"{sub} renormalises its weight in place as it looks rows up "
                                     f"(max_norm={sub.max_norm}), which a spilled shard's host copy would not "
                                     "see: set max_norm=None")


def shard_parameters(groups: list[list[nn.Module]]) -> list[list[torch.nn.Parameter]]:
    """Each shard's parameters, each once; a parameter used by several shards (tied) is listed in each."""
    params = []
    for group in groups:
        seen: dict[int, nn.Parameter] = {}
        for module in group:
            for p in module.parameters():
                seen.setdefault(id(p), p)
        params.append(list(seen.values()))
    return params


def shard_costs(groups: list[list[nn.Module]]) -> list[float]:
    """Each shard's relative compute, for the scheduler's estimates before a shard has been timed: the
    parameters it multiplies activations by (a layer's compute per token is proportional to them). Embedding
    tables are lookups and do not count; a tied output head counts where it multiplies. Never zero, so a
    shard of lookups alone still costs something."""
    costs = []
    for group, params in zip(groups, shard_parameters(groups)):
        lookups = {id(p) for module in group for sub in module.modules() if isinstance(sub, nn.Embedding)
                   for p in sub.parameters(recurse=False)}
        costs.append(float(sum(p.numel() for p in params if id(p) not in lookups)))
    floor = 0.01 * max(costs) if costs and max(costs) > 0 else 1.0
    return [max(c, floor) for c in costs]
