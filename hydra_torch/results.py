"""What ht.train returns: a result per task, and the devices' memory and copy statistics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TaskResult:
    name: str
    losses: list[float]          # one per optimizer step: the mean over its micro-batches
    steps: int
    epochs: int
    wall_time: float             # seconds
    resident: bool               # True: the whole training state stayed on the device
    shard_loads: list[int]       # copies of each shard to the device
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def final_loss(self) -> float:
        return self.losses[-1] if self.losses else float("nan")


@dataclass
class Results:
    tasks: list[TaskResult]
    device: str
    stats: dict = field(default_factory=dict)   # budget, arena capacity, high-water mark, bytes copied

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
        """The task with the lowest final training loss, among those that finished without error."""
        finished = [t for t in self.tasks if t.ok and t.losses]
        return min(finished, key=lambda t: t.final_loss) if finished else None
