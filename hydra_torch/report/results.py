"""What ht.train returns: a result per task, the schedule trace, and memory and copy statistics."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from hydra_torch.models.memory import format_bytes
from hydra_torch.models.lane_summary import describe as describe_lane_plan
from hydra_torch.task import ModelTask


def shard_list(shards: list[int]) -> str:
    """ "shard 3", "shards 0, 7", "shards 1-6": runs of three or more consecutive shards as a range."""
    runs: list[list[int]] = []
    for s in sorted(shards):
        if runs and s == runs[-1][-1] + 1:
            runs[-1].append(s)
        else:
            runs.append([s])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs)
    return ("shards " if len(shards) > 1 else "shard ") + text


@dataclass
class TaskResult:
    name: str
    losses: list[float]          # one per optimizer step: the mean over its micro-batches
    steps: int
    epochs: int                  # epochs completed
    wall_time: float             # seconds from the start of training to the task's last unit
    resident: bool               # True: the whole training state stayed on one device
    shard_loads: list[int]       # copies of each shard to a device, all devices together
    error: BaseException | None = None
    busy_time: float = 0.0       # seconds its units ran, all devices together: its own share of the run
    host_bytes: int = 0          # its training state in host memory at the end: fp32 master, optimizer state,
                                 # bf16 shadow, and fp32 gradient accumulators where a step sums gradients
    cut_short: str | None = None  # why it stopped at a step boundary before its last step (say "Ctrl-C")
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (steps taken, mean validation loss)
    stopped: str | None = None   # when and why a selection rule stopped it (say successive halving at a rung)
    replans: list[str] = field(default_factory=list)  # each re-plan after running out of device memory
    moves: list[str] = field(default_factory=list)  # on a cluster: each move to another node, and why
    node: str | None = None      # on a cluster: the node that trained it last
    total_steps: int = 0         # the steps it was to take: all its epochs' steps, or max_steps if fewer
    resident_shards: list[int] = field(default_factory=list)  # shards whose whole state stayed on the device and
                                 # stepped there: every shard of a resident task, a spilled one's resident ends
    device_shards: list[int] = field(default_factory=list)  # a spilled task's shards stepped on the device

    @property
    def placement(self) -> str:
        """Where its state lived: "resident", "spilled", "spilled, shards 0, 5 resident" or "spilled, shards 0, 5
        resident, shards 1-4 stepped on the device"."""
        if self.resident:
            return "resident"
        parts = ["spilled"]
        if self.resident_shards:
            parts.append(shard_list(self.resident_shards) + " resident")
        if self.device_shards:
            parts.append(shard_list(self.device_shards) + " stepped on the device")
        return ", ".join(parts)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    @property
    def final_eval_loss(self) -> float:
        return self.eval_losses[-1][1] if self.eval_losses else float("nan")

    def __repr__(self) -> str:
        # Short whatever the run's length: the losses, shard loads and the like stay in their fields.
        status = f"failed: {self.error!r}" if not self.ok else self.unfinished or "finished"
        evaluated = f", validation loss {self.final_eval_loss:.4f}" if self.eval_losses else ""
        return (f"TaskResult({self.name!r}: {status}, {self.steps} of {self.total_steps} steps, final loss "
                f"{self.final_loss:.4f}{evaluated}, {self.placement}, {self.wall_time:.1f} s)")

    @property
    def unfinished(self) -> str | None:
        """How it ended before its last step without an error (cut short, or stopped by a selection rule), or
        None."""
        if self.stopped is not None:
            return f"stopped: {self.stopped}"
        if self.cut_short is not None:
            return f"cut short at step {self.steps} of {self.total_steps}"
        return None


def _tier(task: TaskResult) -> int:
    """Where Results.best looks for it: 0 finished, 1 cut short, 2 stopped by a selection rule."""
    return 2 if task.stopped is not None else 1 if task.cut_short is not None else 0


def _lowest(tasks: list[TaskResult]) -> TaskResult | None:
    """The task with the lowest finite final validation loss when every one was evaluated, else the lowest
    finite final training loss; None if none is finite."""
    evaluated = all(t.eval_losses for t in tasks)
    metric = (lambda t: t.final_eval_loss) if evaluated else (lambda t: t.final_loss)
    return min((t for t in tasks if math.isfinite(metric(t))), key=metric, default=None)


def _loss(measured: list, last: float) -> str:
    """A summary's loss column: "-" where none was measured (a task never evaluated, or that took no step)."""
    return f"{last:.4f}" if measured else "-"


def _budget_split(stats: dict) -> str:
    """How a device's budget was shared out, and what the micro-batches in flight held at most."""
    if "saved_allowance_bytes" not in stats:
        return ""
    return (f"; budget {format_bytes(stats['budget_bytes'])} = arena {format_bytes(stats['capacity_bytes'])} + "
            f"a unit's working set {format_bytes(stats['working_set_bytes'])} + saved activations "
            f"{format_bytes(stats['saved_allowance_bytes'])} "
            f"(held at most {format_bytes(stats['saved_high_water_bytes'])})")


def _device_lanes(lanes: dict) -> str:
    """A device's lanes' busy shares: computing, and its copy lanes where they are measured."""
    computing = f"computing {100 * lanes['compute']:.0f}%"
    if lanes["copies_in"] is None:
        return computing
    return f"{computing}, copies in {100 * lanes['copies_in']:.0f}% and out {100 * lanes['copies_out']:.0f}%"


def _step_places(steps: list[StepEntry]) -> str:
    """ "24 on the host (median 3.10 ms), 72 on the device, 24 resident": how many steps ran where, and how long a
    host step took (on a GPU a device's step times are when it was issued: no median of theirs is shown)."""
    parts = []
    for place, where in (("host", "on the host"), ("device", "on the device"), ("resident", "resident")):
        times = [e.end - e.start for e in steps if e.place == place]
        if times:
            median = f" (median {1e3 * statistics.median(times):.2f} ms)" if place == "host" else ""
            parts.append(f"{len(times)} {where}{median}")
    return ", ".join(parts)


@dataclass
class TraceEntry:
    device: int
    task: int
    task_name: str
    unit: int                    # the unit's index in its task's chain
    shard: int
    phase: str                   # forward, forward_backward, backward or evaluate
    start: float                 # perf_counter seconds
    end: float
    bytes_copied: int            # host-to-device bytes the unit's device copied meanwhile (prefetches too)


@dataclass
class StepEntry:
    """One optimizer step of one shard: where it ran and when. `place`: "host" (a host-step thread), "device" (a
    spilled task's shard stepped on the device) or "resident" (a shard whose whole state lives on the device: every
    shard of a resident task, a spilled task's resident shards). `step`: the shard's step count with this step
    (a resumed task goes on counting). Times are perf_counter seconds, as the units'; a host step's are its own
    (the emulated host bandwidth's pace included, its wait for copies still reading its buffers left out), as are a
    step's on a CPU device, while on a GPU they are when the step was issued (the device runs it later, on its
    stream)."""

    device: int                  # the device whose engine ran it or handed it to the host
    task: int
    task_name: str
    shard: int
    step: int
    place: str
    start: float
    end: float


@dataclass
class Results:
    tasks: list[TaskResult]
    devices: list[str]
    stats: list[dict] = field(default_factory=list)   # per device: budget, arena, high-water, bytes copied
    trace: list[TraceEntry] = field(default_factory=list)
    wall_time: float = 0.0
    interrupted: str | None = None  # the signal that stopped every task at a step boundary ("Ctrl-C", "SIGTERM")
    models: dict = field(default_factory=dict)  # on a cluster: name -> the driver's model, holding the trained weights
    checkpoint_failures: int = 0  # checkpoints that could not be written (a full disk, say); training went on
    # FrozenBase name -> {"tasks": its tasks' names, "host_bytes": what it holds once for all of them,
    # "copied_bytes": what was copied of it to the devices}
    bases: dict = field(default_factory=dict)
    # placement "auto" on a device whose lanes are apart: the lanes' rates measured at the start ("rates": copies_in,
    # copies_out, host_steps, device_steps, bytes/s), the device bytes it placed in ("room") beyond the rule's
    # placement ("start": per task, per shard) and the lane model's forecast busy share of each lane ("busy":
    # compute, copies_in, copies_out, host) for the placement it asked (the engine grants what the budget holds);
    # None where the lane model was not asked
    lane_plan: dict | None = None
    steps: list[StepEntry] = field(default_factory=list)  # every shard's optimizer steps, in order of their start

    def __iter__(self):
        return iter(self.tasks)

    def __repr__(self) -> str:
        # Short whatever the run's length: its trace holds an entry per unit, millions in a long sweep, which a
        # notebook cell, a log line or a debugger would otherwise print whole.
        best = self.best
        return (f"<Results: {len(self.tasks)} tasks on {', '.join(self.devices)} in {self.wall_time:.1f} s, best "
                f"{None if best is None else repr(best.name)}; .summary() tabulates them, .trace holds "
                f"{len(self.trace)} units, .steps {len(self.steps)} shard steps>")

    def __str__(self) -> str:
        return self.summary()

    def _repr_pretty_(self, printer, cycle):
        """What IPython and Jupyter show for `results` alone in a cell: the summary table."""
        printer.text(self.summary())

    def __len__(self):
        return len(self.tasks)

    def __getitem__(self, key):
        """A task's result: by position, by name, or by its ModelTask."""
        if isinstance(key, ModelTask):
            key = key.name
        if isinstance(key, str):
            for task in self.tasks:
                if task.name == key:
                    return task
            raise KeyError(f"no task named {key!r} in these results: "
                           + ", ".join(repr(task.name) for task in self.tasks))
        return self.tasks[key]

    def __contains__(self, key) -> bool:
        """Whether a task's result is here: by name, by its ModelTask, or the TaskResult itself."""
        if isinstance(key, TaskResult):
            return any(task is key for task in self.tasks)
        if isinstance(key, ModelTask):
            key = key.name
        return isinstance(key, str) and any(task.name == key for task in self.tasks)

    @property
    def best(self) -> TaskResult | None:
        """The task with the lowest final validation loss, or the lowest final training loss where not every
        task compared was evaluated; a loss that is not finite never counts, and a task that failed is never best.

        The tasks that finished come first: one cut short (by request_stop or a signal) is compared only if none
        of them has a finite loss, since its loss is that of fewer steps. Last come the tasks a selection rule
        stopped: it judged them worse than the others at a rung, so any task that ran on ranks before them,
        finished or cut short. None if no task has a finite loss of the kind compared (every validation loss NaN
        counts as none, whatever the training losses were). Results.summary says when the best did not finish."""
        for tier in range(3):
            best = _lowest(self._ranked(tier))
            if best is not None:
                return best
        return None

    def _ranked(self, tier: int) -> list[TaskResult]:
        """The tasks Results.best compares in `tier` (see _tier)."""
        return [t for t in self.tasks if t.ok and t.losses and _tier(t) == tier]

    def utilisation(self) -> dict[str, float]:
        """Per device, the fraction of the run's wall time it spent running units."""
        if not self.trace:
            return {device: 0.0 for device in self.devices}
        start = min(e.start for e in self.trace)
        span = max(e.end for e in self.trace) - start
        busy = [0.0] * len(self.devices)
        for e in self.trace:
            busy[e.device] += e.end - e.start
        return {device: (busy[i] / span if span > 0 else 0.0) for i, device in enumerate(self.devices)}

    def lanes(self) -> dict:
        """Where the run's time went: each lane's busy share of the call's wall time. Per device, "compute" (its
        units running, less the time they waited for their weights to come in or for room, which `utilisation`
        counts as busy), "copies_in" and "copies_out" (its copy lanes' threads copying; None on a GPU, whose lane
        threads only issue the copies the link then carries); and "host", the host-step threads' busy share, all
        devices' steps together, over the threads (None where the run did not say how many). The busiest lane is
        the one a faster run needs relieved first (see docs/architecture.md, "The lane model")."""
        wall = self.wall_time
        units = [0.0] * len(self.devices)  # seconds of units run, per device
        for e in self.trace:
            units[e.device] += e.end - e.start
        devices = {}
        for i, device in enumerate(self.devices):
            stats = self.stats[i] if i < len(self.stats) else {}
            computing = max(0.0, units[i] - stats.get("acquire_wait_seconds", 0.0))
            copies = not device.startswith("cuda") and wall > 0
            devices[device] = {
                "compute": computing / wall if wall > 0 else 0.0,
                "copies_in": stats.get("weight_copy_seconds", 0.0) / wall if copies else None,
                "copies_out": stats.get("grad_copy_seconds", 0.0) / wall if copies else None,
            }
        threads = max((s.get("host_threads", 0) for s in self.stats), default=0)
        host = sum(s.get("host_step_seconds", 0.0) for s in self.stats)
        return {"devices": devices, "host": host / (wall * threads) if wall > 0 and threads > 0 else None}

    def summary(self) -> str:
        lines = [f"{'task':<16} {'steps':>6} {'final loss':>11} {'eval loss':>10} {'seconds':>8}  status"]
        for t in self.tasks:
            status = (f"failed: {t.error}" if not t.ok else f"cut short by {t.cut_short}" if t.cut_short
                      else f"stopped: {t.stopped}" if t.stopped else "ok")
            status += f" ({t.placement})"
            if t.replans:
                status += f" (re-planned {len(t.replans)}x after running out of memory)"
            if t.moves:
                status += f" (moved {len(t.moves)}x between nodes)"
            lines.append(f"{t.name:<16} {t.steps:>6} {_loss(t.losses, t.final_loss):>11} "
                         f"{_loss(t.eval_losses, t.final_eval_loss):>10} {t.wall_time:>8.1f}  {status}")
        lanes = self.lanes()
        for i, (device, share) in enumerate(self.utilisation().items()):
            split = _budget_split(self.stats[i]) if i < len(self.stats) else ""
            lines.append(f"device {device}: busy {100 * share:.0f}% of {self.wall_time:.1f} s "
                         f"({_device_lanes(lanes['devices'][device])}){split}")
        if lanes["host"] is not None and any(s.get("host_steps", 0) for s in self.stats):
            lines.append(f"host steps: busy {100 * lanes['host']:.0f}% of {self.stats[0].get('host_threads', 0)} "
                         f"threads")
        if any(e.place != "resident" for e in self.steps):
            lines.append("shard steps: " + _step_places(self.steps))
        if self.lane_plan is not None:
            lines.append(describe_lane_plan(self.lane_plan))
        if self.checkpoint_failures:
            lines.append(f"{self.checkpoint_failures} checkpoints could not be written (see the warnings)")
        best = self.best
        if best is not None:
            # The loss it was chosen by: validation only where every task of its tier was evaluated.
            measure = (f"validation loss {best.final_eval_loss:.4f}"
                       if all(t.eval_losses for t in self._ranked(_tier(best))) else f"final loss {best.final_loss:.4f}")
            unfinished = f"; {best.unfinished}" if best.unfinished else ""
            lines.append(f"best: {best.name} ({measure}{unfinished})")
        return "\n".join(lines)

    def plot_curves(self, path=None):
        """Training and validation loss against steps, one colour per task (a stopped task's curve ends where
        it stopped). Saved to `path` if given; returns the matplotlib figure."""
        from hydra_torch.report.plotting import curves_figure

        figure = curves_figure(self)
        if path is not None:
            figure.savefig(path, dpi=120, bbox_inches="tight")
        return figure

    def plot_schedule(self, path=None):
        """A Gantt chart of the trace: one row per device, one colour per task. Saved to `path` if given;
        returns the matplotlib figure."""
        from hydra_torch.report.plotting import schedule_figure

        figure = schedule_figure(self)
        if path is not None:
            figure.savefig(path, dpi=120, bbox_inches="tight")
        return figure
