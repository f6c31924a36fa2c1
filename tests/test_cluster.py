"""hydra_torch.cluster on a Ray cluster of 3 nodes on this machine (ray.cluster_utils.Cluster: each node has
one logical CPU for Ray's accounting, and trains on 2 virtual CPU devices)."""
import functools
import json
import os
import threading
import time

import pytest
import torch

import hydra_torch as ht
from cluster_tasks import BuildsOnce, make_failing_task, make_frozen_task, make_task
from hydra_torch.cluster import placement

ray = pytest.importorskip("ray", reason="Ray is an optional dependency: pip install 'hydra-torch[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils", reason="this Ray has no ray.cluster_utils.Cluster")

TESTS = os.path.dirname(__file__)
DEVICES = ["cpu", "cpu"]
BUDGET = "64MiB"  # every task resident on its node, as in the one-node run it is compared with


@pytest.fixture
def cluster():
    from hydra_torch import cluster as hydra_cluster

    nodes = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(2):
        nodes.add_node(num_cpus=1)
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    ray.init(address=nodes.address, runtime_env={"env_vars": {"PYTHONPATH": path}}, log_to_driver=False)
    try:
        yield nodes, hydra_cluster
    finally:
        ray.shutdown()
        nodes.shutdown()


def one_machine(factories):
    tasks = [factory() for factory in factories]
    torch.manual_seed(0)
    results = ht.train(tasks, devices=DEVICES, memory_budget=BUDGET, progress=False)
    return results, {t.name: t.model for t in tasks}


def same_weights(a, b):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_placement_puts_the_largest_work_first_on_the_least_loaded_node():
    assert placement.assign([5, 1, 4, 3, 3], 2) == [0, 1, 1, 1, 0]
    assert placement.assign([2, 2], 3, loads=[0, 1, 0]) == [0, 2]
    with pytest.raises(ValueError, match="no node"):
        placement.assign([1], 0)


def test_a_cluster_run_equals_the_same_tasks_on_one_machine(cluster, tmp_path):
    _, hydra_cluster = cluster
    factories = [functools.partial(make_task, f"t{i}", seed=i, blocks=1 + i % 3) for i in range(5)]
    results = hydra_cluster.train(factories, checkpoint_dir=tmp_path, devices=DEVICES, memory_budget=BUDGET)
    reference, models = one_machine(factories)
    assert {r.node for r in results} == {"node0", "node1", "node2"}  # every node trained some
    assert len(results.devices) == 6 and all(d.startswith("node") for d in results.devices)
    for result, expected in zip(results, reference):
        assert result.ok and result.losses == expected.losses  # also where a task moved to balance the work
        same_weights(results.models[result.name], models[result.name])
    assert {e.task_name for e in results.trace} == {f"t{i}" for i in range(5)}
    assert {results.devices[e.device].split("/")[0] for e in results.trace} == {"node0", "node1", "node2"}
    # Every step of every shard came home too, in its task's and device's names (resident: the budget holds all).
    assert {e.task_name for e in results.steps} == {f"t{i}" for i in range(5)}
    assert {e.place for e in results.steps} == {"resident"}
    assert sorted((e.task_name, e.shard, e.step) for e in results.steps) == \
        sorted((e.task_name, e.shard, e.step) for e in reference.steps)
    results.plot_schedule(tmp_path / "schedule.png")  # a row per node and device
    assert (tmp_path / "schedule.png").stat().st_size > 0


def test_when_a_node_dies_its_tasks_resume_elsewhere_and_end_as_undisturbed(cluster, tmp_path):
    nodes, hydra_cluster = cluster
    factories = [functools.partial(make_task, f"t{i}", seed=i, steps=30, seconds_per_batch=0.05) for i in range(3)]

    def kill_a_node_once_all_have_checkpoints():
        deadline = time.time() + 120
        while time.time() < deadline:
            steps = []
            for i in range(3):
                try:
                    steps.append(json.loads((tmp_path / f"t{i}" / "manifest.json").read_text())["steps"])
                except (OSError, ValueError, KeyError):
                    steps.append(0)
            if min(steps) >= 4:
                nodes.remove_node(nodes.list_all_nodes()[-1])  # a worker node, with one task on it
                return
            time.sleep(0.05)
    killer = threading.Thread(target=kill_a_node_once_all_have_checkpoints, daemon=True)
    killer.start()
    results = hydra_cluster.train(factories, checkpoint_dir=tmp_path, devices=DEVICES, memory_budget=BUDGET,
                                  checkpoint_every=1)
    killer.join()
    reference, models = one_machine(factories)
    restarted = [r for r in results if any("died" in m for m in r.moves)]
    assert len(restarted) == 1
    for result, expected in zip(results, reference):
        assert result.ok, result.error
        assert result.steps == 30 and result.losses == expected.losses
        same_weights(results.models[result.name], models[result.name])


def test_a_node_with_nothing_left_takes_a_task_from_a_busy_one(cluster, tmp_path):
    """3 tasks on 2 nodes of one device: node 1 trains one, node 0 two side by side and so twice as long.
    Once node 1 is done it takes one of node 0's at a step boundary, through its checkpoint."""
    _, hydra_cluster = cluster
    # Slow enough that node 0's tasks are near half-way, well inside the window a move is made in (at most 75 %
    # done), when node 1 is done, whatever the actors' start-up times.
    factories = [functools.partial(make_task, f"t{i}", seed=i, steps=40, seconds_per_batch=0.06) for i in range(3)]
    results = hydra_cluster.train(factories, checkpoint_dir=tmp_path, devices=["cpu"], memory_budget=BUDGET,
                                  checkpoint_every=1, nodes=2)
    tasks = [factory() for factory in factories]
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as Ray's one-CPU actors run (OMP_NUM_THREADS=1): the same sums in the same order
    try:
        reference = ht.train(tasks, devices=["cpu"], memory_budget=BUDGET, progress=False)
    finally:
        torch.set_num_threads(threads)
    moved = [r for r in results if r.moves]
    assert len(moved) == 1 and "to balance the work" in moved[0].moves[0], [r.moves for r in results]
    assert moved[0].node == "node1"
    assert {e.task_name for e in results.trace if results.devices[e.device].startswith("node1")} >= {moved[0].name}
    for result, expected, task in zip(results, reference, tasks):
        assert result.ok and result.steps == 40 and result.cut_short is None
        assert result.losses == expected.losses
        same_weights(results.models[result.name], task.model)


def test_a_task_failing_by_itself_is_not_retried_and_the_same_call_again_returns_the_same(cluster, tmp_path):
    _, hydra_cluster = cluster
    factories = [functools.partial(make_task, f"t{i}", seed=i) for i in range(3)]
    factories.append(functools.partial(make_failing_task, "nan", seed=7))
    with pytest.warns(RuntimeWarning, match="nan"):
        first = hydra_cluster.train(factories, checkpoint_dir=tmp_path, devices=DEVICES, memory_budget=BUDGET)
    failed = first["nan"]
    assert isinstance(failed.error, ht.NonFiniteLossError) and failed.moves == [] and failed.steps == 2
    assert all(first[f"t{i}"].ok for i in range(3))
    # A task that cannot be built on its node fails alone, with the node's error.
    built = hydra_cluster.train([BuildsOnce("elsewhere", 3), factories[0]], checkpoint_dir=tmp_path / "other",
                                devices=DEVICES, memory_budget=BUDGET)
    assert isinstance(built["elsewhere"].error, OSError) and "not on this node" in str(built["elsewhere"].error)
    assert built["t0"].ok and built["t0"].steps == 8
    # Again with the same checkpoints: every task is past its last step, so nothing trains and the weights
    # come from the checkpoints.
    second = hydra_cluster.train(factories[:3], checkpoint_dir=tmp_path, devices=DEVICES, memory_budget=BUDGET)
    for i in range(3):
        assert second[f"t{i}"].losses == first[f"t{i}"].losses
        same_weights(second.models[f"t{i}"], first.models[f"t{i}"])


def test_bad_input_is_refused_before_the_cluster_is_touched(tmp_path):
    from hydra_torch import cluster as hydra_cluster

    with pytest.raises(ValueError, match="checkpoint_dir is required"):
        hydra_cluster.train([functools.partial(make_task, "a", 0)], checkpoint_dir=None)
    with pytest.raises(TypeError, match="factories"):
        hydra_cluster.train([], checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="unique"):
        hydra_cluster.train([functools.partial(make_task, "a", 0)] * 2, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown schedule"):
        hydra_cluster.train([functools.partial(make_task, "a", 0)], checkpoint_dir=tmp_path, schedule="fastest")
    with pytest.raises(ValueError, match="checkpoint_every"):
        hydra_cluster.train([functools.partial(make_task, "a", 0)], checkpoint_dir=tmp_path, checkpoint_every="soon")
    with pytest.raises(ValueError, match="max_retries"):
        hydra_cluster.train([functools.partial(make_task, "a", 0)], checkpoint_dir=tmp_path, max_retries=-1)
    with pytest.raises(ValueError, match="failed on the driver"):
        hydra_cluster.train([functools.partial(make_task, "a", "not a seed")], checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="task 'a' has nothing to train"):
        hydra_cluster.train([functools.partial(make_frozen_task, "a", 0)], checkpoint_dir=tmp_path)
    assert not ray.is_initialized()
