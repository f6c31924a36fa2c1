"""ht.plan's `placement`: where each shard would live and step were the task trained alone on the device, decided as
ht.train decides it, and the lane model's forecast where it is asked; the task and its model untouched."""
import pytest
import torch

import hydra_torch as ht
from hydra_torch import planning, testing
from hydra_torch.models import planner
from models import lm_loss, model_bytes, tied_transformer, token_batches
import placed_training
from test_frozen_base import partly_frozen


def tied_task(model=None, **options):
    model = model if model is not None else tied_transformer()
    return ht.ModelTask(model, optimizer=placed_training.adamw(), loss_fn=lm_loss, data=token_batches(4), **options)


def one_shard_a_layer(task, budget):
    """The plan of `task` under `budget` with every layer's time taken as the same: one shard a layer, whatever the
    machine's timing noise would make of the measured times (the bytes are measured)."""
    probe = planner.probe(task, torch.device("cpu"))
    probe.costs = [(weights, activations, 1e-3) for weights, activations, _ in probe.costs]
    plan = planner.cut(task, probe, budget)
    assert plan.num_shards == len(task.pieces)
    return plan


def trained_placement(model, plan, placement):
    """Where ht.train put the shards of `model` cut as `plan` says, under the plan's budget: per shard as
    Plan.placement names them."""
    task = tied_task(model)
    ht.planner.apply_plan(task, plan)
    results = ht.train([task], devices="cpu", memory_budget=plan.budget_bytes, progress=False, placement=placement)
    result = results[0]
    assert result.ok, result.error
    return ["resident" if result.resident or s in result.resident_shards else
            "device" if s in result.device_shards else "host" for s in range(task.num_shards)]


def test_a_model_that_fits_is_resident_whole_and_asks_no_lane_model():
    plan = ht.plan(tied_task(), budget="1GiB")
    assert plan.placement == ["resident"] * plan.num_shards
    assert plan.lane_plan is None
    assert "resident" in str(plan) and "lane model" not in str(plan)


@pytest.mark.parametrize("placement", ["auto", "host", "device"])
def test_a_spilled_model_is_placed_as_train_places_it(placement):
    # One shard a layer, a budget that spills the model: "auto" on a CPU device without emulated lanes keeps the tied
    # embedding and head (shards 0 and 7) resident by the engine's rule; "device" steps the blocks there too.
    task = tied_task()
    plan = one_shard_a_layer(task, int(3.0 * model_bytes(task.model)))
    places, lane_plan = planning.placed_alone(task, plan, placement)
    assert places == trained_placement(tied_transformer(), plan, placement)
    want = {"auto": {"resident": {0, 7}, "device": set()}, "host": {"resident": set(), "device": set()},
            "device": {"resident": {0, 7}, "device": set(range(1, 7))}}[placement]
    for place, shards in want.items():
        assert {s for s, p in enumerate(places) if p == place} == shards, places
    assert lane_plan is None, "a CPU device without emulated lanes: no lane model"


def test_auto_on_emulated_lanes_takes_steps_off_a_slow_host_as_train_does():
    # The host steps the model's ~1.8 MB a step at 2 MB/s: a second a step, against milliseconds of compute.
    task = tied_task()
    plan = one_shard_a_layer(task, int(4.0 * model_bytes(task.model)))
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        places, lane_plan = planning.placed_alone(task, plan, "auto")
        trained = trained_placement(tied_transformer(), plan, "auto")
    assert places == trained
    assert {places[0], places[-1]} == {"resident"} and places.count("host") < 6, places
    rates, busy = lane_plan["rates"], lane_plan["busy"]
    assert rates["copies_in"] == rates["copies_out"] == 1e10 and rates["host_steps"] == 2e6
    assert all(0.0 <= share <= 1.0 + 1e-9 for share in busy.values())


def test_plan_shows_where_each_shard_steps_and_the_lane_models_forecast():
    budget = int(4.0 * model_bytes(tied_transformer()))
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        plan = ht.plan(tied_task(), budget=budget)
    assert len(plan.placement) == plan.num_shards and plan.placement.count("host") < plan.num_shards, plan.placement
    assert plan.lane_plan["rates"]["host_steps"] == 2e6
    lines = str(plan).splitlines()
    assert lines[1].split()[-1] == "steps" and [line.split()[-1] for line in lines[2:2 + plan.num_shards]] == \
        plan.placement
    assert lines[-1].startswith("lane model: link 9.31 GiB/s in")


def test_placement_none_gives_the_shards_alone():
    plan = ht.plan(tied_task(), budget="1GiB", placement=None)
    assert plan.placement is None and plan.lane_plan is None
    assert "steps" not in str(plan).splitlines()[1]


@pytest.mark.parametrize("placement", ["everywhere", "", 3, "AUTO"])
def test_a_bad_placement_is_refused_before_anything_is_measured(placement):
    class Untouchable:
        def __iter__(self):
            raise AssertionError("the data was read before the argument was checked")

        def __len__(self):
            return 1

    task = ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=Untouchable())
    with pytest.raises(ValueError, match="placement must be one of 'auto', 'host', 'device' or None"):
        ht.plan(task, budget="1GiB", placement=placement)


def test_placing_leaves_the_task_its_cut_and_its_model_untouched():
    model = tied_transformer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task = tied_task(model, shards=2)
    modules, shard_params = task.modules, task.shard_params
    rng = torch.get_rng_state()
    plan = ht.plan(task, budget=int(3.0 * model_bytes(model)))
    assert plan.num_shards > 2 and plan.placement is not None
    assert task.modules is modules and task.shard_params is shard_params and task.num_shards == 2
    for key, value in model.state_dict().items():
        assert torch.equal(before[key], value), key
    assert all(p.grad is None and p.device.type == "cpu" for p in model.parameters())
    assert model[0].weight is model[-1].weight
    assert torch.equal(torch.get_rng_state(), rng)
    results = ht.train([task], devices="cpu", memory_budget="1GiB", progress=False)  # still trains as it was cut
    assert results[0].ok and len(results[0].shard_loads) == 2


def test_a_task_that_shares_a_frozen_base_has_no_placement_of_its_own():
    task = tied_task(partly_frozen(), base=ht.FrozenBase())
    plan = ht.plan(task, budget="1GiB")
    assert plan.placement is None and plan.lane_plan is None
