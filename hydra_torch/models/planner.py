"""The automatic partitioner: measure each piece of a task once on the target device, then let the native
partitioner choose the shards (ht.plan, hydra_torch.planning, adds where each would live and step).

Probing never touches the user's modules: each piece runs through torch.func.functional_call on copies of
its parameters and buffers, so the model's weights, buffers and gradients stay bit-for-bit what they were
(rather than moving the parameters to the device and back, which a failure half-way would leave moved).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

from hydra_torch._loader import native as _C
from hydra_torch.models import saved_tensors, sharding
from hydra_torch.models.batch_tree import to_device
from hydra_torch.models.carried import as_shard_input
from hydra_torch.models.first_batch import first_batch
from hydra_torch.models.memory import format_bytes, parse_budget
from hydra_torch.models.lane_summary import describe as describe_lane_plan


@dataclass
class Plan:
    """Shards chosen for one task on one device: the shards' first pieces, their needs and their times."""

    starts: list[int]
    piece_ranges: list[tuple[int, int]]     # [first, end) piece indices of each shard
    shard_bytes: list[int]                  # 2 x weights + prefetch + slack in the arena, + the reserve, per shard
    shard_weight_bytes: list[int]
    shard_activation_bytes: list[int]
    shard_seconds: list[float]              # measured forward + backward time, summed over the shard's pieces
    prefetch_bytes: int                     # room for the next shard's weights: the largest shard's weights
    bottleneck_seconds: float               # the slowest shard
    ideal_seconds: float                    # max(total / shards, slowest piece): no plan of as many shards beats it
    budget_bytes: int
    min_budget_bytes: int                   # the smallest budget any plan of these pieces fits
    reserve_bytes: int                      # kept beside the arena: a unit's working set, a micro-batch's inputs
    device: str
    piece_weight_bytes: list[int]           # the measurements the plan was made from
    piece_activation_bytes: list[int]
    piece_seconds: list[float]
    piece_input_bytes: list[int]            # what each piece takes in: a shard's saved input, where it starts one
    # Where each shard would live and step were the task trained alone on the device (ht.plan's `placement`):
    # "resident", "device" (stepped there) or "host" (stepped on the host); None where not asked.
    placement: list[str] | None = None
    lane_plan: dict | None = None           # what the lane model was told and forecast, as Results.lane_plan

    @property
    def num_shards(self) -> int:
        return len(self.starts)

    def __str__(self) -> str:
        placed = self.placement is not None
        lines = [f"Plan: {self.num_shards} shards of {len(self.piece_seconds)} pieces on {self.device}, budget "
                 f"{format_bytes(self.budget_bytes)}, prefetch {format_bytes(self.prefetch_bytes)}",
                 f"{'shard':>5}  {'pieces':>9}  {'weights':>11}  {'activations':>11}  {'needs':>11}  {'ms':>9}"
                 + (f"  {'steps':>8}" if placed else ""),
                 ]
        for s, (a, b) in enumerate(self.piece_ranges):
            lines.append(f"{s:>5}  {f'{a}-{b - 1}':>9}  {format_bytes(self.shard_weight_bytes[s]):>11}  "
                         f"{format_bytes(self.shard_activation_bytes[s]):>11}  {format_bytes(self.shard_bytes[s]):>11}  "
                         f"{1e3 * self.shard_seconds[s]:>9.3f}" + (f"  {self.placement[s]:>8}" if placed else ""))
        lines.append(f"bottleneck {1e3 * self.bottleneck_seconds:.3f} ms, ideal {1e3 * self.ideal_seconds:.3f} ms "
                     f"({self.bottleneck_seconds / self.ideal_seconds:.2f}x)" if self.ideal_seconds > 0 else "")
        if self.lane_plan is not None:
            lines.append(describe_lane_plan(self.lane_plan))
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        """What IPython and Jupyter show for a plan alone in a cell: its table, as print() shows it."""
        printer.text(str(self))


@dataclass
class Probe:
    """One task's pieces as measured on a device: (weight bytes, activation bytes, seconds) each, and each
    piece's input bytes."""

    costs: list[tuple[int, int, float]]
    input_bytes: list[int]
    device: torch.device

    @property
    def reserve_bytes(self) -> int:
        """What the budget keeps beside the arena for this task: one unit's working set (its most demanding
        piece's activations) and one micro-batch's saved inputs, counted as if every piece began a shard (the
        most any plan keeps)."""
        return max((c[1] for c in self.costs), default=0) + sum(self.input_bytes)


def plan_shards(task, device="cpu", budget=None, sample_batch=None, *, max_shards: int | None = None,
                repeats: int = 3) -> Plan:
    """Shards for `task` on `device` under `budget` (what hydra_torch.models.memory.parse_budget accepts; None: 90%
    of free memory), measured on `sample_batch` (default: the task's first batch).

    Each piece of task.pieces runs forward + backward once to warm up, then `repeats` times; its time is the
    median. The shards minimise the slowest shard's time, then their number; with `max_shards` at most that
    many. The budget is all the device memory the task uses: beside the arena that holds the shards it keeps one
    unit's working set and one micro-batch's saved inputs (`Probe.reserve_bytes`), so the shards are cut for what
    those leave. ValueError names the smallest budget that would work when `budget` is too small.
    """
    device = torch.device(device)
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if max_shards is not None and (isinstance(max_shards, bool) or not isinstance(max_shards, int) or max_shards < 1):
        raise ValueError(f"max_shards must be a positive int or None, got {max_shards!r}")
    budget_bytes = parse_budget(budget, device)
    return cut(task, probe(task, device, sample_batch, repeats), budget_bytes, max_shards)


def probe(task, device, sample_batch=None, repeats: int = 3) -> Probe:
    """Measures every piece of `task` on `device` (see plan)."""
    if sample_batch is None:
        if len(task.data) == 0:
            raise ValueError("the task has no data to probe: pass sample_batch=")
        sample_batch = first_batch(task.data)
    input_bytes = []
    costs = probe_pieces(task, device, sample_batch, repeats, input_bytes)
    return Probe(costs, input_bytes, torch.device(device))


def cut(task, measured: Probe, budget_bytes: int, max_shards: int | None = None, reserve_bytes: int = 0) -> Plan:
    """The shards of a measured task under `budget_bytes`, the arena cut for the budget less what is kept beside
    it: the task's own reserve, or `reserve_bytes` where that is more (what the run keeps for all its tasks)."""
    costs = measured.costs
    reserve = max(reserve_bytes, measured.reserve_bytes)
    # The arena holds weights, gradients and the next shard's weights; activations are in the reserve.
    arena_costs = [(weight, 0, seconds) for weight, _, seconds in costs]
    minimum = _C.min_partition_budget(arena_costs) + reserve
    if budget_bytes < minimum:
        raise ValueError(f"memory budget {format_bytes(budget_bytes)} ({budget_bytes} bytes) is too small for "
                         f"{task.name}: the smallest budget that works is {minimum} bytes ({format_bytes(minimum)}), "
                         f"what its largest piece's weights and gradients need beside one unit's working set and "
                         f"one micro-batch's saved inputs ({format_bytes(reserve)})")
    native = _C.partition(arena_costs, budget_bytes - reserve, max_shards or 0)
    ends = list(native.starts[1:]) + [len(costs)]
    ranges = list(zip(native.starts, ends))
    return Plan(starts=list(native.starts), piece_ranges=ranges,
                shard_bytes=[b + reserve for b in native.shard_bytes], shard_weight_bytes=list(native.shard_weight_bytes),
                shard_activation_bytes=[max(c[1] for c in costs[a:b]) for a, b in ranges],
                shard_seconds=list(native.shard_seconds), prefetch_bytes=native.prefetch_bytes,
                bottleneck_seconds=native.bottleneck_seconds, ideal_seconds=native.ideal_seconds,
                budget_bytes=budget_bytes, min_budget_bytes=minimum, reserve_bytes=reserve,
                device=str(measured.device), piece_weight_bytes=[c[0] for c in costs],
                piece_activation_bytes=[c[1] for c in costs], piece_seconds=[c[2] for c in costs],
                piece_input_bytes=list(measured.input_bytes))


def apply_plan(task, plan_: Plan) -> None:
    """Re-cuts `task` (not yet training) into the plan's shards."""
    if plan_.piece_ranges[-1][1] != len(task.pieces):
        raise ValueError(f"the plan covers {plan_.piece_ranges[-1][1]} pieces, the task has {len(task.pieces)}")
    task.modules = sharding.split(task.pieces, plan_.starts)
    task.shard_params = sharding.shard_parameters(task.modules)
    keep_needs(task, plan_.piece_activation_bytes, plan_.piece_input_bytes, plan_.starts)
    # Each piece's forward + backward on the plan's device: the lane model's unit times (hydra_torch.run.lane_choice).
    task.piece_seconds = list(plan_.piece_seconds)


def keep_needs(task, activation_bytes: list[int], input_bytes: list[int], starts: list[int]) -> None:
    """Keeps on `task` what its training holds beside the arena, from its pieces' measured activations and inputs
    and the pieces its shards start at: one unit's working set (its most demanding piece's activations), and what
    one micro-batch holds from its first forward to its last backward: spilled, each shard's input; resident,
    every piece's autograd graph (the shards' inputs among it)."""
    task.working_set_bytes = max(activation_bytes, default=0)
    task.boundary_bytes = sum(input_bytes[start] for start in starts)
    task.graph_bytes = sum(activation_bytes)


def cut_like(task, other) -> None:
    """Re-cuts `task` (not yet training) where `other`, a model of the same layers, is cut: the tasks of a
    FrozenBase are cut alike. What the planner measured of `task` stays."""
    if len(task.pieces) != len(other.pieces):
        raise ValueError(f"tasks {other.name!r} and {task.name!r} share {other.base!r} but have {len(other.pieces)} "
                         f"and {len(task.pieces)} layers")
    starts = sharding.starts_in(other.modules, other.pieces)
    if starts is None:
        raise ValueError(f"tasks {other.name!r} and {task.name!r} share {other.base!r}, and the shards of "
                         f"{other.name!r} are not its layers in order: give {task.name!r} the same shards")
    task.modules = sharding.split(task.pieces, starts)
    task.shard_params = sharding.shard_parameters(task.modules)


def plan_for_devices(tasks, devices, budgets, reserve_bytes: int = 0) -> None:
    """Cuts the tasks whose shards are left to the planner (`auto_shards`) for the smallest budget among the
    devices (a spilled model may run on any of them). Every device's arena leaves out the largest working set
    and micro-batch of all the run's tasks, so each task is measured first and all are cut for the budget less
    the largest reserve among them (or `reserve_bytes`, what a running call kept, where that is more)."""
    planned = [task for task in tasks if task.auto_shards]
    if not planned:
        return
    smallest = min(range(len(devices)), key=lambda i: budgets[i])
    measured = [probe(task, devices[smallest]) for task in planned]
    reserve = max([reserve_bytes] + [m.reserve_bytes for m in measured])
    for task, m in zip(planned, measured):
        apply_plan(task, cut(task, m, budgets[smallest], reserve_bytes=reserve))
    # The tasks of a FrozenBase are cut alike (its shards are theirs): those left to the planner as its first is.
    first = {}
    for task in tasks:
        if task.base is not None:
            reference = first.setdefault(id(task.base), task)
            if task is not reference and task.auto_shards:
                cut_like(task, reference)


def piece_weight_bytes(piece: torch.nn.Module, bf16: bool) -> int:
    """Device bytes of a piece's parameters as the engine lays them out (ShardStore.device_bytes). A
    parameter tied across pieces counts in each, as the engine counts it in each shard that uses it; two
    pieces of one shard sharing it count it twice, which only overstates the need."""
    return _C.ShardStore.device_bytes([p.numel() for p in piece.parameters()], bf16)


def probe_pieces(task, device: torch.device, sample_batch, repeats: int = 3,
                 input_bytes: list | None = None) -> list[tuple[int, int, float]]:
    """(weight bytes, activation bytes, seconds) of each piece of `task` on `device`, in order, the seconds the median
    of `repeats` timed passes (0 where `repeats` is 0: memory alone, without the passes that warm up and time);
    `input_bytes`, when given, receives the bytes of each piece's input."""
    dtype = task.compute_dtype
    batch = to_device(sample_batch, device, non_blocking=False)
    x = task.inputs(batch)
    if dtype != torch.float32:
        x = tree_map(lambda t: t.to(dtype) if _floating(t) else t, x)
    # Dropout and other random layers must not advance the generators the training run will start from.
    forked = rng_devices(device)
    costs = []
    with torch.random.fork_rng(devices=forked):
        # Where pieces are timed, one untimed pass over the whole chain first: a process's first kernels (thread
        # pools, allocator growth, CUDA context and autotuning) run several times slower and would inflate the
        # first pieces.
        warm = x
        for index, piece in enumerate(task.pieces if repeats else ()):
            _, _, warm = _probe_piece(piece, warm, device, dtype, None, needs_input_grad=index > 0)
        for index, piece in enumerate(task.pieces):
            if input_bytes is not None:
                input_bytes.append(saved_tensors.distinct_bytes(t for t in tree_leaves(x) if isinstance(t, torch.Tensor)))
            seconds, activation_bytes, x = _probe_piece(piece, x, device, dtype, repeats, needs_input_grad=index > 0)
            costs.append((piece_weight_bytes(piece, dtype == torch.bfloat16), activation_bytes, seconds))
    return costs


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _probe_piece(piece, x, device, dtype, repeats, needs_input_grad):
    """(median seconds of `repeats` timed passes, activation bytes, detached output) of one piece's forward +
    backward; repeats=None only warms up, 0 times nothing."""
    params = {name: p.detach().to(device=device, dtype=dtype if p.is_floating_point() else p.dtype, copy=True)
              .requires_grad_(p.requires_grad) for name, p in piece.named_parameters()}
    buffers = {name: b.detach().to(device=device, copy=True) for name, b in piece.named_buffers()}
    state = {**params, **buffers}

    def inputs():
        return as_shard_input(x, requires_grad=needs_input_grad)

    def forward_backward():
        out = torch.func.functional_call(piece, state, (inputs(),))
        grads_from = [t for t in tree_leaves(out) if _floating(t) and t.requires_grad]
        if grads_from:
            torch.autograd.backward(grads_from, [torch.ones_like(t) for t in grads_from])
        return out

    # The warm-up also allocates the parameter gradients, so the measured peak below is activations only.
    detached = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, forward_backward())
    if repeats is None:
        return 0.0, 0, detached
    activation_bytes = _activation_bytes(forward_backward, params, device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        forward_backward()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) if times else 0.0, activation_bytes, detached


def synchronize(device) -> None:
    """Waits for `device`'s queued work (a CUDA device's; a CPU runs it in line): what a timing needs."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rng_devices(device) -> list[int]:
    """The CUDA devices whose generators torch.random.fork_rng must fork for work on `device`."""
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def _activation_bytes(forward_backward, params, device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        forward_backward()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - base)
    # Elsewhere no allocator reports a peak: count what autograd keeps for backward (each storage once, the
    # weights excluded: they are budgeted already) plus the output the next piece takes.
    saved = []
    with saved_tensors.saved_tensors(saved, params.values()):
        out = forward_backward()
    kept = {t.untyped_storage().data_ptr() for t in saved}
    output_bytes = sum(t.untyped_storage().nbytes() for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                       and t.untyped_storage().data_ptr() not in kept)
    return saved_tensors.distinct_bytes(saved) + output_bytes
