"""A task cut by hand (one shard per layer by default, or shards given) on a device whose memory is its own (a GPU;
here a CPU device on an emulated link) is measured as the call starts, as the planner measures a task it cuts: the
budget keeps its working set and a micro-batch's saved inputs beside the arena, and it is resident only where its
autograd graph fits beside its state. A CPU device's activations are the host's memory: nothing is kept there."""
import pytest
import torch

import hydra_torch as ht
import placed_training
from hydra_torch import testing
from hydra_torch.run import measuring
from models import OneShot, lm_loss, model_bytes, tied_transformer, token_batches

CUT = [0, 2, 4]  # tied_transformer(blocks=3)'s six layers in three shards


def hand_cut(name="cut", batch=16, seed=0, shards=CUT):
    return ht.ModelTask(tied_transformer(seed=seed, blocks=3, dropout=0.0), optimizer=ht.optim.AdamW(lr=1e-3),
                        loss_fn=lm_loss, data=token_batches(3, batch=batch), shards=shards, name=name)


def train(tasks, budget):
    with testing.emulated_link(1e10):
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    assert all(r.ok for r in results), [r.error for r in results]
    return results


def test_a_hand_cut_tasks_working_set_and_saved_inputs_are_kept_beside_the_arena_as_the_planner_measures_them():
    # Batch 16: the activations dwarf the weights. What the budget keeps beside the arena is what the planner
    # measures of the same pieces: the most demanding piece's activations, and the inputs of the shards' first pieces.
    plan = ht.plan(hand_cut(), "cpu", budget="1GiB", placement=None)
    working_set = max(plan.piece_activation_bytes)
    inputs = sum(plan.piece_input_bytes[start] for start in CUT)
    budget = 3 * model_bytes(tied_transformer(blocks=3)) + working_set + inputs
    results = train([hand_cut()], budget)
    stats = results.stats[0]
    assert stats["working_set_bytes"] == working_set > 0
    assert stats["capacity_bytes"] <= budget - working_set - inputs
    assert stats["saved_allowance_bytes"] == budget - stats["capacity_bytes"] - working_set
    assert stats["capacity_bytes"] + working_set + stats["saved_high_water_bytes"] <= budget


def test_on_a_cpu_device_of_the_hosts_memory_nothing_is_kept_for_a_hand_cut_task():
    results = ht.train([hand_cut()], devices="cpu", memory_budget=3 * model_bytes(tied_transformer(blocks=3)),
                       progress=False)
    assert results[0].ok and results.stats[0]["working_set_bytes"] == 0


def test_a_hand_cut_task_is_resident_only_where_its_autograd_graph_fits_beside_its_state():
    # Resident with room to spare, its state takes `state` of the arena. With the working set and saved inputs beside
    # it but not the rest of its graph, it is spilled as the call starts (before, it was placed resident and the graph
    # came on top of the budget: on a GPU, out of memory in its first step); with the graph's room too, it stays
    # resident.
    state = train([hand_cut()], 1 << 30).stats[0]["capacity_bytes"]
    task = hand_cut()
    with testing.emulated_link(1e10):
        kept, with_graph = measuring.kept_beside_arena([task]), measuring.kept_beside_arena([task], resident=["cut"])
    assert with_graph > kept > 0
    assert not train([hand_cut()], state + kept + 1024)[0].resident
    assert train([hand_cut()], state + with_graph + 1024)[0].resident


def test_a_one_shot_iterator_is_not_measured_and_loses_no_batch():
    task = ht.ModelTask(tied_transformer(blocks=3, dropout=0.0), optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss,
                        data=OneShot(3), shards=CUT)
    results = train([task], 1 << 30)
    assert results[0].steps == 3 and results.stats[0]["working_set_bytes"] == 0


def test_sizing_a_budget_by_its_arena_leaves_the_tasks_as_they_were():
    task = hand_cut()
    assert measuring.kept_beside_arena([task]) == 0, "a plain CPU device keeps nothing beside the arena"
    with testing.emulated_link(1e10):
        assert measuring.kept_beside_arena([task], resident=["cut"]) > measuring.kept_beside_arena([task]) > 0
    assert (task.working_set_bytes, task.boundary_bytes, task.graph_bytes, task.piece_seconds) == (0, 0, 0, None)


def test_a_task_cut_as_ht_plan_planned_keeps_the_plans_needs_where_it_cannot_be_measured_again():
    # ht.planner.apply_plan set what the plan measured; a one-shot iterator cannot be measured again: they stay.
    task = hand_cut(shards=None)
    ht.planner.apply_plan(task, ht.plan(task, "cpu", budget="1GiB", placement=None))
    needs = (task.working_set_bytes, task.boundary_bytes, task.graph_bytes)
    task.data = OneShot(3)
    with testing.emulated_link(1e10):
        measuring.measure_tasks([task], ["cpu"], [1 << 30], time_units=False)
    assert (task.working_set_bytes, task.boundary_bytes, task.graph_bytes) == needs and needs[0] > 0


def test_measuring_for_memory_alone_runs_each_piece_twice_and_finds_what_the_timed_measurement_finds():
    # Where nothing asks for unit times (placement "host" or "device", a task joining), a piece runs once to warm
    # up (its parameters' gradients allocated) and once measured: no pass over the chain to warm up, none timed.
    calls = []
    task = hand_cut()
    for index, piece in enumerate(task.pieces):
        piece.register_forward_hook(lambda *_, index=index: calls.append(index))
    figures = {}
    for time_units in (False, True):
        calls.clear()
        with testing.emulated_link(1e10):
            measuring.measure_tasks([task], [torch.device("cpu")], [1 << 30], time_units=time_units)
        figures[time_units] = (task.working_set_bytes, task.boundary_bytes, task.graph_bytes)
        assert sorted(calls) == sorted(list(range(len(task.pieces))) * (4 if time_units else 2))
        assert (task.piece_seconds is not None) == time_units
    assert figures[False] == figures[True] and figures[False][0] > 0


@pytest.mark.parametrize("fraction, precision", [(0.4, "fp32"), (0.5, "fp32"), (0.4, "bf16")])
def test_the_cuda_tests_budgets_leave_the_arena_they_name(fraction, precision):
    """tests/test_cuda.py sizes its budgets as `fraction` of the weights beside what ht.train keeps
    (placed_training.budget_of, on cuda:0): on a device whose memory is its own (this emulated link takes a GPU's
    branch) they train spilled, where the fraction alone would leave no arena. Run here, so that those budgets
    cannot drift where no GPU runs them."""
    def task():
        return ht.ModelTask(tied_transformer(dropout=0.0), loss_fn=lm_loss, data=token_batches(2), precision=precision)
    with testing.emulated_link(1e10):
        with pytest.raises(ValueError, match="memory budget"):
            ht.train([task()], devices="cpu", memory_budget=int(fraction * model_bytes(task().model)), progress=False)
        measured = task()
        result = ht.train([measured], devices="cpu", memory_budget=placed_training.budget_of(fraction, measured),
                          progress=False)[0]
    assert result.ok and not result.resident, result.error
