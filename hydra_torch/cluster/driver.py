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
(`TaskResult.moves` says so); a task whose node died more than `max_retries` times stops with an error.
What crosses the network: the factories (to the nodes), and each task's result and trained weights (back).
"""
from __future__ import annotations

import itertools
import time
import warnings

from hydra_torch._loader import native as _C
from hydra_torch.cluster import placement
from hydra_torch.cluster import results as cluster_results
from hydra_torch.cluster.node import NodeTrainer, failed_result
from hydra_torch.recipe.reals import whole
from hydra_torch.report.results import Results
from hydra_torch.state import checkpoint, checkpoint_dirs
from hydra_torch.task import ModelTask

BALANCE_SECONDS = 1.0  # how often the driver looks for a node with nothing to do, at most
MOVE_BEFORE = 0.75     # a task further along than this share of its steps stays where it is


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
        (devices="auto": every GPU Ray gave the node's actor, else the CPU).
    nodes: how many nodes to use (default: every node alive). gpus_per_node: GPUs each node's actor takes
        (default: the fewest any node has). cpus_per_node: CPUs it takes (for Ray's accounting).
    max_retries: how many times a task starts again elsewhere after its node died.
    """
    ray = _ray()
    factories = list(factories)
    if not factories or not all(callable(f) for f in factories):
        raise TypeError("train() takes a non-empty list of task factories: callables that return a ModelTask")
    if not whole(max_retries):
        raise ValueError(f"max_retries must be a non-negative int, got {max_retries!r}")
    for label, value in (("cpus_per_node", cpus_per_node), ("gpus_per_node", gpus_per_node)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ValueError(f"{label} must be a non-negative number, got {value!r}")
    try:  # what can be checked here is, before any node is asked
        _C.parse_policy(schedule)
    except ValueError as error:
        raise ValueError(f"unknown schedule {schedule!r}: {error}") from None
    checkpoint.parse_every(checkpoint_every)
    tasks = [_build(factory, i) for i, factory in enumerate(factories)]
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique, got {names}")
    for name in names:  # each names a directory of checkpoint_dir, on every node
        checkpoint_dirs.check_name(name)
    _check_directory(checkpoint_dir)
    if not ray.is_initialized():
        ray.init()
    alive = [n for n in ray.nodes() if n.get("Alive")]
    count = len(alive) if nodes is None else nodes
    if not whole(count, 1) or count > len(alive):
        raise ValueError(f"nodes={nodes!r}: the cluster has {len(alive)} nodes alive")
    gpus = min(n["Resources"].get("GPU", 0) for n in alive) if gpus_per_node is None else gpus_per_node
    options = {"devices": devices, "memory_budget": memory_budget, "schedule": schedule, "seed": seed,
               "host_threads": host_threads, "checkpoint_dir": str(checkpoint_dir),
               "checkpoint_every": checkpoint_every}
    run = _ClusterRun(ray, factories, tasks, options, count, int(gpus), cpus_per_node, max_retries)
    try:
        return run.results()
    except KeyboardInterrupt as interrupt:  # the nodes' actors stop with the driver; the checkpoints stay
        interrupt.add_note(f"every task's last checkpoint is in {checkpoint_dir}: the same call continues them")
        raise
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
    task.check_trains_something()  # a node's ht.train would refuse it, and with it the node's other tasks
    return task


def _check_directory(checkpoint_dir):
    if checkpoint_dir is None:
        raise ValueError("checkpoint_dir is required: a directory every node sees, through which a task moves "
                         "when its node dies")
    checkpoint_dirs.prepare_directory(checkpoint_dir)


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
        # Calls at once: run() trains while progress() and release() ask about its tasks.
        actor = ray.remote(NodeTrainer)
        self.actors = [actor.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_concurrency=4,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(
                                         self.group, placement_group_bundle_index=i)).remote(f"node{i}")
                       for i in range(count)]
        self.start = time.time()
        self.work = [placement.estimated_work(t) for t in tasks]
        self.total_steps = [t.total_steps for t in tasks]
        self.outcomes: dict[int, tuple] = {}   # task index -> (node, result, weights)
        self.moves = [[] for _ in tasks]       # why and where each task moved
        self.deaths = [0] * len(tasks)         # how many of its nodes died under it
        self.runs: list[tuple[int, dict]] = []  # (node, payload) of every node run that came back
        self.dead: set[int] = set()
        self.running = {}    # future -> (node, run id, task indices): the node runs
        self.releasing = {}  # future -> (from node, to node, task index): a task asked to move
        self.queued: dict[int, list[int]] = {}  # node -> tasks it runs once it has nothing to do
        self.owner: dict[int, int | None] = {}  # task index -> the run training it (None: between nodes)
        self.run_ids = itertools.count()

    def results(self) -> Results:
        for node, indices in _groups(placement.assign(self.work, len(self.actors))).items():
            self.queued[node] = indices
        while True:
            self._launch_queued()
            self._balance()
            futures = list(self.running) + list(self.releasing)
            if not futures:
                break
            done, _ = self.ray.wait(futures, num_returns=1, timeout=BALANCE_SECONDS)
            # A release that came back is handled before its donor's end: a task it moved is no longer the
            # donor's to lose.
            for future in sorted(done, key=lambda f: f not in self.releasing):
                if future in self.releasing:
                    self._released(future)
                else:
                    self._run_ended(future)
        return cluster_results.assemble(self.tasks, self.outcomes, self.moves, self.runs, self.start)

    def _busy(self) -> set[int]:
        return {node for node, _, _ in self.running.values()} | {to for _, to, _ in self.releasing.values()}

    def _launch_queued(self):
        busy = self._busy()
        for node in [n for n, q in self.queued.items() if q and n not in busy and n not in self.dead]:
            indices = self.queued.pop(node)
            run = next(self.run_ids)
            for i in indices:
                self.owner[i] = run
            jobs = [(i, self.factories[i]) for i in indices]
            self.running[self.actors[node].run.remote(jobs, self.options)] = (node, run, indices)

    def _balance(self):
        """A node with nothing to do takes a task from the node with the most work left, at its next step
        boundary through its checkpoint, when that leaves both with less than the donor has now."""
        busy, donors = self._busy(), {frm for frm, _, _ in self.releasing.values()}
        idle = [n for n in range(len(self.actors)) if n not in busy and n not in self.dead and not self.queued.get(n)]
        for node in list(idle):  # first, tasks queued behind a busy node's run: they have not started there
            waiting = [(self.work[i], n, i) for n, q in self.queued.items() if n in busy and n != node for i in q]
            if waiting:
                _, n, i = max(waiting)
                self.queued[n].remove(i)
                self.queued[node] = [i]
                idle.remove(node)
        if not idle:
            return
        progress = self._progress()
        for node in idle:
            best = None
            for donor, run, indices in self.running.values():
                if donor in donors or donor not in progress:
                    continue
                left = {}
                for i in indices:
                    if self.owner.get(i) == run and i in progress[donor]:
                        done = progress[donor][i] / max(self.total_steps[i], 1)
                        if done < MOVE_BEFORE:  # not worth a move near its end
                            left[i] = self.work[i] * (1.0 - done)
                total = sum(left.values())
                movable = [i for i, w in left.items() if w <= total / 2]
                if movable and (best is None or total > best[0]):
                    best = (total, donor, max(movable, key=lambda i: left[i]))
            if best is not None:
                _, donor, i = best
                self.releasing[self.actors[donor].release.remote([i])] = (donor, node, i)
                donors.add(donor)

    def _progress(self) -> dict:
        """node -> {task index: steps taken} of the node runs in progress (those that answer in time)."""
        asked = {node: self.actors[node].progress.remote() for node, _, _ in self.running.values()}
        out = {}
        for node, future in asked.items():
            try:
                out[node] = self.ray.get(future, timeout=10)
            except (self.ray.exceptions.RayError, TimeoutError):
                pass  # dying or busy: not a donor this time
        return out

    def _released(self, future):
        donor, node, i = self.releasing.pop(future)
        try:
            released = self.ray.get(future)
        except self.ray.exceptions.RayError:  # the donor died: its run's end says what becomes of the task
            return
        if released and donor not in self.dead and self.owner.get(i) is not None:  # else its death moved it
            steps = checkpoint.steps_taken(self.options["checkpoint_dir"], self.tasks[i].name)  # written as it left
            self.moves[i].append(f"moved from node{donor} to node{node} at step {steps}, to balance the work")
            self.owner[i] = None  # its donor run's result for it is not the last word
            self.queued.setdefault(node, []).append(i)

    def _run_ended(self, future):
        node, run, indices = self.running.pop(future)
        try:
            payload = self.ray.get(future)
        except self.ray.exceptions.RayActorError as error:  # the node (or its actor process) died
            self.dead.add(node)
            # Those it was training count the death; those queued for it (or moving to it) just go elsewhere.
            orphans = [i for i in indices if self.owner.get(i) == run and self._retry(i, node, error)]
            orphans += self.queued.pop(node, [])
            alive = [n for n in range(len(self.actors)) if n not in self.dead]
            if not alive:
                for i in orphans:
                    error_ = RuntimeError(f"task {self.tasks[i].name!r}: every node that could train it died")
                    self.outcomes[i] = (None, failed_result(self.tasks[i].name, error_), None)
                return
            # They resume from their checkpoints: largest first, each queued on the node with the least work
            # (its run's and its queue's), which runs them once its run ends (at once if idle).
            loads = [sum(self.work[i] for n_, _, r in self.running.values() if n_ == n for i in r) +
                     sum(self.work[i] for i in self.queued.get(n, [])) for n in alive]
            for i, k in zip(orphans, placement.assign([self.work[i] for i in orphans], len(alive), loads=loads)):
                self.owner[i] = None
                self.queued.setdefault(alive[k], []).append(i)
        else:
            self._record(node, run, payload)

    def _retry(self, i, node, error) -> bool:
        """Notes that task i's node died under it; False (and a failed result) past max_retries."""
        self.deaths[i] += 1
        self.moves[i].append(f"node{node} died while it trained the task: {type(error).__name__}")
        if self.deaths[i] <= self.max_retries:
            return True
        error_ = RuntimeError(f"task {self.tasks[i].name!r}: its node died {self.deaths[i]} times; stopped after "
                              f"{self.max_retries} retries")
        self.outcomes[i] = (node, failed_result(self.tasks[i].name, error_), None)
        return False

    def _record(self, node, run, payload):
        for i, error in payload["failed"].items():
            if self.owner.get(i) == run:
                self.outcomes[i] = (node, failed_result(self.tasks[i].name, error), None)
        for i, result in payload["results"].items():
            if self.owner.get(i) == run:  # else it moved on: that run's result is the one that counts
                self.outcomes[i] = (node, result, payload["weights"][i])
        self.runs.append((node, payload))
        for message in payload["warnings"]:
            warnings.warn(f"node{node}: {message}", RuntimeWarning, stacklevel=5)

    def close(self):
        for actor in self.actors:
            self.ray.kill(actor)
        self.ray.util.remove_placement_group(self.group)


def _groups(where: list[int]) -> dict[int, list[int]]:
    groups: dict[int, list[int]] = {}
    for i, node in enumerate(where):
        groups.setdefault(node, []).append(i)
    return groups
