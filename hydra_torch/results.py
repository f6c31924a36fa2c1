"""What ht.train returns: a result per task, the schedule trace, and memory and copy statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")

    @property
    def final_eval_loss(self) -> float:
        return self.eval_losses[-1][1] if self.eval_losses else float("nan")


def _nan_last(value: float) -> float:
    return float("inf") if value != value else value


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
class Results:
    tasks: list[TaskResult]
    devices: list[str]
    stats: list[dict] = field(default_factory=list)   # per device: budget, arena, high-water, bytes copied
    trace: list[TraceEntry] = field(default_factory=list)
    wall_time: float = 0.0
    interrupted: str | None = None  # the signal that stopped every task at a step boundary ("Ctrl-C", "SIGTERM")
    models: dict = field(default_factory=dict)  # on a cluster: name -> the driver's model, holding the trained weights

    def __iter__(self):
        return iter(self.tasks)

    def __len__(self):
        return len(self.tasks)

    def __getitem__(self, key):
        if isinstance(key, str):
            for task in self.tasks:
                if task.name == key:
                    return task
            raise KeyError(key)
        return self.tasks[key]

    @property
    def best(self) -> TaskResult | None:
        """Among the tasks that ran without error and were not stopped by a selection rule, the one with the
        lowest final validation loss when every one of them was evaluated, else the lowest final training loss."""
        finished = [t for t in self.tasks if t.ok and t.losses]
        finished = [t for t in finished if t.stopped is None] or finished
        if not finished:
            return None
        if all(t.eval_losses for t in finished):
            return min(finished, key=lambda t: _nan_last(t.final_eval_loss))
        return min(finished, key=lambda t: _nan_last(t.final_loss))

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

    def summary(self) -> str:
        lines = [f"{'task':<16} {'steps':>6} {'final loss':>11} {'eval loss':>10} {'seconds':>8}  status"]
        for t in self.tasks:
            status = (f"failed: {t.error}" if not t.ok else f"cut short by {t.cut_short}" if t.cut_short
                      else f"stopped: {t.stopped}" if t.stopped else "ok")
            if t.replans:
                status += f" (re-planned {len(t.replans)}x after running out of memory)"
            if t.moves:
                status += f" (moved {len(t.moves)}x between nodes)"
            lines.append(f"{t.name:<16} {t.steps:>6} {t.final_loss:>11.4f} {t.final_eval_loss:>10.4f} "
                         f"{t.wall_time:>8.1f}  {status}")
        for device, share in self.utilisation().items():
            lines.append(f"device {device}: busy {100 * share:.0f}% of {self.wall_time:.1f} s")
        best = self.best
        if best is not None:
            measure = (f"validation loss {best.final_eval_loss:.4f}" if best.eval_losses
                       else f"final loss {best.final_loss:.4f}")
            lines.append(f"best: {best.name} ({measure})")
        return "\n".join(lines)

    def plot_curves(self, path=None):
        """Training and validation loss against steps, one colour per task (a stopped task's curve ends where
        it stopped). Saved to `path` if given; returns the matplotlib figure."""
        from hydra_torch.plotting import curves_figure

        figure = curves_figure(self)
        if path is not None:
            figure.savefig(path, dpi=120, bbox_inches="tight")
        return figure

    def plot_schedule(self, path=None):
        """A Gantt chart of the trace: one row per device, one colour per task. Saved to `path` if given;
        returns the matplotlib figure."""
        from hydra_torch.plotting import schedule_figure

        figure = schedule_figure(self)
        if path is not None:
            figure.savefig(path, dpi=120, bbox_inches="tight")
        return figure
