"""Which node trains which task: the largest estimated work first, each to the node with the least so far
(longest processing time first, within 4/3 of the best possible makespan)."""
from __future__ import annotations

from hydra_torch.run.steps import count_micro_batches


def estimated_work(task, after_steps: int = 0) -> float:
    """A task's remaining work in parameter-micro-batches: its units' compute grows with both."""
    params = sum(p.numel() for group in task.shard_params for p in group)
    return float(params) * count_micro_batches(task, after_steps)


def assign(works, nodes: int, loads=None) -> list[int]:
    """The node each work goes to, given the work `loads` the nodes already have (default none)."""
    if nodes < 1:
        raise ValueError(f"no node to place {len(works)} tasks on")
    loads = list(loads) if loads is not None else [0.0] * nodes
    if len(loads) != nodes:
        raise ValueError(f"{len(loads)} loads for {nodes} nodes")
    where = [0] * len(works)
    for i in sorted(range(len(works)), key=lambda i: (-works[i], i)):
        node = min(range(nodes), key=lambda n: (loads[n], n))
        where[i] = node
        loads[node] += works[i]
    return where
