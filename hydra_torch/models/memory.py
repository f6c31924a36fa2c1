"""Memory budgets: bytes, strings with a unit, or a fraction of the device's free memory."""
from __future__ import annotations

import collections
import math
import numbers
import os
import re

import torch

from hydra_torch.models import frozen_base

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation could get on `device` now."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    raise ValueError(f"no free-memory query for device type {device.type!r}")


# Far above any machine, and below what the native engine's 64-bit byte counts can hold with room to add.
LARGEST_BUDGET = 2**60

_HOW = "use bytes (4096, '8GiB', '512MB') or a fraction of free memory (0.8, '0.8', '80%')"


def parse_budget(budget, device: torch.device, sharing: int = 1) -> int:
    """Bytes for `budget`. One rule: a whole number is bytes ("4096", 8e9), a number in (0, 1] written with a
    fraction part is a fraction of the device's free memory (0.8, "0.8", "1.0", "80%"), as a Python value or
    a string; a string may carry a unit ("8GiB", "1.5 KiB", "512MB"). None means 90% of free memory.
    `sharing` devices draw on the same memory (virtual CPU devices): each gets its share of the free memory."""
    if budget is None:
        return int(0.9 * free_bytes(device) / sharing)
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Real, str)):
        raise TypeError(f"memory_budget {budget!r} is not a budget: {_HOW}")
    if isinstance(budget, numbers.Integral):
        return _bytes(int(budget), budget)
    if not isinstance(budget, str):
        return _real(float(budget), device, budget, sharing)
    text = budget.strip()
    if text.endswith("%"):
        return _fraction(_number(text[:-1], budget) / 100.0, device, budget, sharing)
    match = _PATTERN.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory_budget {budget!r}: {_HOW}")
    number, unit = match.group(1), match.group(2).lower()
    if unit == "":
        try:
            return _bytes(int(number), budget)
        except ValueError:
            return _real(_number(number, budget), device, budget, sharing)
    value = _number(number, budget) * _UNITS[unit]
    if unit == "b" and value != int(value):
        raise ValueError(f"memory_budget {budget!r} is a fractional number of bytes")
    return _bytes(int(value) if value < 2 * LARGEST_BUDGET else 2 * LARGEST_BUDGET, budget)


def _number(text: str, budget) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"cannot read memory_budget {budget!r}: {_HOW}") from None
    if not math.isfinite(value):
        raise ValueError(f"memory_budget {budget!r} is not a finite number")
    return value


def _real(value: float, device: torch.device, budget, sharing: int) -> int:
    """A number that is not an integer literal: a fraction when at most 1, else whole bytes ("8e9"), which,
    as bytes written as an integer, are not split between devices."""
    if math.isfinite(value) and value > 1 and value == int(value):
        return _bytes(int(value), budget)
    return _fraction(value, device, budget, sharing)


def _bytes(n: int, budget) -> int:
    if n <= 0:
        raise ValueError(f"memory_budget must be positive, got {budget!r}")
    if n > LARGEST_BUDGET:
        raise ValueError(f"memory_budget {budget!r} is more than any device holds (at most {LARGEST_BUDGET} bytes)")
    return n


def _fraction(fraction: float, device: torch.device, budget, sharing: int) -> int:
    """`sharing` devices' share each of `fraction` of the free memory."""
    if not math.isfinite(fraction) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory_budget {budget!r}: a fraction of free memory must be in (0, 1] (write bytes as an "
                         "integer or with a unit, e.g. '8GiB')")
    share = int(fraction * free_bytes(device)) // sharing
    if share < 1:
        raise ValueError(f"memory_budget {budget!r} is {fraction:g} of the free memory, less than one byte for each "
                         "device: write bytes as an integer or with a unit, e.g. '8GiB'")
    return share


def available_host_bytes() -> int:
    """Memory the host can give without swapping: MemAvailable (free plus reclaimable caches) where the kernel
    reports it, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_state_bytes(task) -> int:
    """What a task's host training state (the engine's ShardStore) will take: per trainable parameter, an fp32
    master and the optimizer's fp32 states, a bf16 shadow in bf16, and where a step waits for more than one gradient
    its gradient: an fp32 accumulator with micro-batches (or clipping in fp32), the bf16 gradient as it landed
    with clipping in bf16. A shard owning a parameter that another shard uses (a tied embedding) sums both
    shards' gradients: in bf16 with one micro-batch a step and no clipping, the borrower's waits as it landed
    where every parameter has at most one borrower, else in an fp32 accumulator. A tied parameter counts once. A
    frozen parameter (requires_grad=False: a LoRA model's base) holds its master (and bf16 shadow) alone; one its
    FrozenBase holds is counted once for all its tasks, by base_bytes."""
    owner, numel, tied_owners, trainable = {}, {}, set(), set()
    borrowers = collections.Counter()
    for s, shard in enumerate(task.shard_params):
        for p in {id(p): p for p in shard if id(p) not in task.base_weights}.values():
            owner.setdefault(id(p), s)
            numel[id(p)] = p.numel()
            if p.requires_grad:
                trainable.add(id(p))
            if owner[id(p)] != s:
                tied_owners.add(owner[id(p)])
                if p.requires_grad:
                    borrowers[id(p)] += 1
    bf16 = task.precision == "bf16"
    per_element = 4 + 4 * task.optimizer.spec().num_states + (2 if bf16 else 0)
    if task.accumulate > 1 or (task.clip_grad_norm is not None and not bf16):
        gradient, tied = 4, 4
    elif task.clip_grad_norm is not None:
        gradient, tied = 2, 4
    else:
        gradient, tied = 0, (2 if bf16 and all(n == 1 for n in borrowers.values()) else 4)
    frozen = 4 + (2 if bf16 else 0)  # the master (and its bf16 shadow): no optimizer state, no gradient
    return sum(n * ((per_element + (tied if owner[key] in tied_owners else gradient)) if key in trainable else frozen)
               for key, n in numel.items())


def base_bytes(task) -> int:
    """What the task's FrozenBase holds on the host, once for all its tasks: each weight's fp32 master, and
    its bf16 shadow in bf16 (a tied weight once)."""
    numel = sum(p.numel() for p in frozen_base.weights_by_name(task).values())
    return numel * (6 if task.precision == "bf16" else 4)


def _one_per_base(tasks, held) -> list:
    """A task of each base the tasks share that is not among `held` (the bases a running call holds already)."""
    held = {id(base) for base in held}
    return list({id(task.base): task for task in tasks if task.base is not None and id(task.base) not in held}.values())


def check_host_memory(tasks, bases_held=()) -> None:
    """Refuses, before anything is allocated, tasks whose host state together exceeds what the host has; the
    FrozenBases in `bases_held` are held already."""
    need = sum(host_state_bytes(task) for task in tasks)
    need += sum(base_bytes(task) for task in _one_per_base(tasks, bases_held))
    available = available_host_bytes()
    if need > available:
        raise MemoryError(f"the tasks' host training state needs {format_bytes(need)} (fp32 masters, optimizer "
                          f"state, shadows) but the host has {format_bytes(available)} available; train fewer or "
                          "smaller models in one call")


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
