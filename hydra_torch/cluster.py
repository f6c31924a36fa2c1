"""Many models on many nodes: ht.train on every node of a Ray cluster, each over its share of the tasks.

    import ray, hydra_torch.cluster
    ray.init(address="auto")                      # a cluster started with `ray start --head` / `ray start --address`
    results = hydra_torch.cluster.train([make_task_a, make_task_b, ...], checkpoint_dir="/shared/sweep")

Tasks are given as factories: picklable callables that return a ModelTask. The driver calls each once, to
learn its name and size and to hold the model that receives the trained weights; each node calls the factories
of its share again and trains those tasks there, so optimizer state and master weights exist only on the nodes.
One Ray actor per node (a placement group, one bundle per node, strictly spread) owns the node's GPUs and runs
SHARP over its tasks; tasks go to nodes by estimated work, the largest first, each to the least-loaded node.

Every task keeps checkpoints in `checkpoint_dir`, a directory every node sees. When a node dies, its tasks are
queued on the nodes left, the largest first on the node with the least work, and each node runs its queue once
its run ends (at once if idle): they resume from their last checkpoints and end as they would have
(`TaskResult.restarts` says so); a task whose node died more than `max_retries` times stops with an error.
What crosses the network: the factories (to the nodes), and each task's result and trained weights (back).
"""
from __future__ import annotations

import time
import warnings

from hydra_torch import checkpoint, placement
from hydra_torch.node_trainer import NodeTrainer, failed_result
from hydra_torch.results import Results, TraceEntry
from hydra_torch.sharding import root_module
from hydra_torch.task import ModelTask

_KEPT_MAX = ("budget_bytes", "capacity_bytes", "high_water_bytes", "staging_bytes")  # summed otherwise


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError("hydra_torch.cluster needs Ray: pip install 'hydra-torch[ray]' (or pip install ray)") from None
    return ray


def train(factories, *, checkpoint_dir, devices="auto", memory_budget=None, schedule: str = "lrtf", seed: int = 0,
          host_threads: int | None = None, checkpoint_every=None, nodes: int | None = None,
          gpus_per_node: int | None = None, cpus_per_node: int = 1, max_retries: int = 2) -> Results:
    """Trains the tasks the `factories` make across the nodes of the Ray cluster this process is connected to
    (ray.init() first; without it, a local one-node cluster is started). The driver's copies of the tasks'
    models hold the trained weights at the end: `results.models[name]`.

    checkpoint_dir: a directory every node can read and write (a shared filesystem), required: it is how a
        task moves when its node dies.
    devices, memory_budget, schedule, seed, host_threads, checkpoint_every: as ht.train's, on every node
        (devices="auto": the GPUs Ray gave the node's actor, else the CPU).
    nodes: how many nodes to use (default: every node alive). gpus_per_node: GPUs each node's actor takes
        (default: the fewest any node has). cpus_per_node: CPUs it takes (for Ray's accounting).
    max_retries: how many times a task starts again elsewhere after its node died.
    """
    ray = _ray()
    factories = list(factories)
    if not factories or not all(callable(f) for f in factories):
        raise TypeError("train() takes a non-empty list of task factories: callables that return a ModelTask")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")
    tasks = [_build(factory, i) for i, factory in enumerate(factories)]
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique, got {names}")
    _check_directory(checkpoint_dir)
    if not ray.is_initialized():
        ray.init()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    count = len(alive) if nodes is None else nodes
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(alive):
        raise ValueError(f"nodes={nodes!r}: the cluster has {len(alive)} nodes alive")
    gpus = min(n["Resources"].get("GPU", 0) for n in alive) if gpus_per_node is None else gpus_per_node
    options = {"devices": devices, "memory_budget": memory_budget, "schedule": schedule, "seed": seed,
               "host_threads": host_threads, "checkpoint_dir": str(checkpoint_dir),
               "checkpoint_every": checkpoint_every}
    run = _ClusterRun(ray, factories, tasks, options, count, int(gpus), cpus_per_node, max_retries)
    try:
        return run.results()
    finally:
        run.close()


def _build(factory, index) -> ModelTask:
    try:
        task = factory()
    except Exception as error:
        raise ValueError(f"task factory {index} ({getattr(factory, '__name__', factory)!r}) failed on the driver: "
                         f"{type(error).__name__}: {error}") from error
    if not isinstance(task, ModelTask):
        raise TypeError(f"task factory {index} returned a {type(task).__name__}, not a ModelTask")
    return task


def _check_directory(checkpoint_dir):
    if checkpoint_dir is None:
        raise ValueError("checkpoint_dir is required: a directory every node sees, through which a task moves "
                         "when its node dies")
    checkpoint.prepare_directory(checkpoint_dir)


class _ClusterRun:
    def __init__(self, ray, factories, tasks, options, count, gpus, cpus, max_retries):
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray, self.factories, self.tasks, self.options = ray, factories, tasks, options
        self.max_retries = max_retries
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.group = placement_group([bundle] * count, strategy="STRICT_SPREAD")
        try:
            ray.get(self.group.ready(), timeout=120)
        except Exception as error:
            ray.util.remove_placement_group(self.group)
            raise RuntimeError(f"Ray could not place one actor on each of {count} nodes with {bundle}: "
                               f"{type(error).__name__}: {error}") from None
        actor = ray.remote(NodeTrainer)
        self.actors = [actor.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=
                                     PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=i))
                       .remote(f"node{i}") for i in range(count)]
        self.start = time.time()
        self.outcomes: dict[int, tuple] = {}   # task index -> (node, result, weights)
        self.restarts = [[] for _ in tasks]
        self.runs: list[tuple[int, dict]] = []   # (node, payload) of every node run that came back
        self.dead: set[int] = set()

    def results(self) -> Results:
        ray = self.ray
        work = [placement.estimated_work(t) for t in self.tasks]
        running = {}

        def launch(node, indices):
            jobs = [(i, self.factories[i]) for i in indices]
            running[self.actors[node].run.remote(jobs, self.options)] = (node, indices)

        queued = {node: indices for node, indices in _groups(placement.assign(work, len(self.actors))).items()}
        while True:
            busy = {n for n, _ in running.values()}
            for node in [n for n in queued if n not in busy and n not in self.dead]:
                launch(node, queued.pop(node))
            if not running:
                break
            (done,), _ = ray.wait(list(running), num_returns=1)
            node, indices = running.pop(done)
            try:
                payload = ray.get(done)
            except ray.exceptions.RayActorError as error:  # the node (or its actor process) died
                self.dead.add(node)
                orphans = [i for i in indices + queued.pop(node, []) if self._retry(i, node, error)]
                alive = [n for n in range(len(self.actors)) if n not in self.dead]
                if not alive:
                    for i in orphans:
                        error_ = RuntimeError(f"task {self.tasks[i].name!r}: every node that could train it died")
                        self.outcomes[i] = (None, failed_result(self.tasks[i].name, error_), None)
                    continue
                # They resume from their checkpoints: largest first, each queued on the node with the least
                # work (its run's and its queue's), which runs them once its run ends (at once if idle).
                loads = [sum(work[i] for r in running.values() if r[0] == n for i in r[1]) +
                         sum(work[i] for i in queued.get(n, [])) for n in alive]
                where = placement.assign([work[i] for i in orphans], len(alive), loads=loads)
                for i, k in zip(orphans, where):
                    queued.setdefault(alive[k], []).append(i)
            else:
                self._record(node, payload)
        return self._assemble()

    def _retry(self, i, node, error) -> bool:
        """Notes that task i's node died under it; False (and a failed result) past max_retries."""
        self.restarts[i].append(f"node{node} died while it trained the task: {type(error).__name__}")
        if len(self.restarts[i]) <= self.max_retries:
            return True
        error_ = RuntimeError(f"task {self.tasks[i].name!r}: its node died {len(self.restarts[i])} times; stopped "
                              f"after {self.max_retries} retries")
        self.outcomes[i] = (node, failed_result(self.tasks[i].name, error_), None)
        return False

    def _record(self, node, payload):
        for i, error in payload["failed"].items():
            self.outcomes[i] = (node, failed_result(self.tasks[i].name, error), None)
        for i, result in payload["results"].items():
            self.outcomes[i] = (node, result, payload["weights"][i])
        self.runs.append((node, payload))
        for message in payload["warnings"]:
            warnings.warn(f"node{node}: {message}", RuntimeWarning, stacklevel=4)

    def _assemble(self) -> Results:
        devices, stats, index = [], [], {}
        for node, payload in self.runs:
            for d, (name, stat) in enumerate(zip(payload["devices"], payload["stats"])):
                key = (node, name)
                if key not in index:
                    index[key] = len(devices)
                    devices.append(f"node{node}/{name}")
                    stats.append(dict(stat))
                else:
                    merged = stats[index[key]]
                    for k, v in stat.items():
                        if isinstance(v, (int, float)):
                            merged[k] = max(merged[k], v) if k in _KEPT_MAX else merged[k] + v
        trace = []
        for node, payload in self.runs:
            for device, task, unit, shard, phase, start, end, copied in payload["trace"]:
                trace.append(TraceEntry(index[(node, payload["devices"][device])], task, self.tasks[task].name, unit,
                                        shard, phase, start - self.start, end - self.start, copied))
        trace.sort(key=lambda e: e.start)
        results, models = [], {}
        for i, task in enumerate(self.tasks):
            node, result, weights = self.outcomes[i]
            if weights is not None:
                root_module(task.model, task.pieces).load_state_dict(weights)
            result.restarts = list(self.restarts[i])
            result.node = f"node{node}" if node is not None else None
            results.append(result)
            models[task.name] = task.model
        return Results(results, devices, stats, trace, time.time() - self.start, models=models)

    def close(self):
        for actor in self.actors:
            self.ray.kill(actor)
        self.ray.util.remove_placement_group(self.group)


def _groups(where: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, node in enumerate(where):
        groups.setdefault(node, []).append(i)
    return groups
