"""placement="auto" steps on the device the shards the lane model takes off the host, from the lane rates measured
at the call's start (hydra_torch.run.lane_rates) and the units' times the planner measured: on the device where the
host's memory is slow beside the link, on the host where the link is slow beside the host. Training stays plain
PyTorch training whichever it picks."""
import math

import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.run import lane_choice, lane_rates, measuring
from models import OneShot, lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches
import placed_training
from test_bad_input import LyingData

ENDS = "spilled, shards 0, 7 resident"


def test_measured_rates_are_the_emulated_lanes_where_there_are_some():
    with testing.emulated_link(3e8), testing.emulated_host(2e8):
        to_device, to_host, host, device_memory = lane_rates.measure("cpu", 1000)
    assert (to_device, to_host, host) == (3e8, 3e8, 2e8)
    assert math.isfinite(device_memory) and device_memory > 0, "the CPU device steps at its memory's own rate"
    measured = lane_rates.measure("cpu", 1 << 30)  # a buffer of at most MAX_ELEMENTS
    assert all(math.isfinite(rate) and rate > 0 for rate in measured)


@pytest.mark.parametrize("precision, optimizer, want", [
    ("fp32", ht.optim.AdamW(lr=1e-3), (4, 8, 28, 8, 28)),
    ("bf16", ht.optim.AdamW(lr=1e-3), (2, 12, 28, 8, 28)),
    ("fp32", ht.optim.SGD(lr=0.1, momentum=0.9), (4, 4, 20, 8, 20)),
    ("fp32", ht.optim.SGD(lr=0.1), (4, 0, 12, 8, 12)),
])
def test_step_bytes_are_the_engines_counts(precision, optimizer, want):
    task = ht.ModelTask(tied_transformer(), data=token_batches(1), optimizer=optimizer, precision=precision,
                        loss_fn=lm_loss)
    assert lane_choice.step_bytes(task) == want


def train_auto(model, data, link, host, shards="auto", budget_fraction=3.0):
    with testing.emulated_link(link), testing.emulated_host(host):
        return placed_training.train(model, data, "auto", budget_fraction, shards=shards)


@pytest.mark.parametrize("shards", ["auto", None], ids=["planned", "by_hand"])
def test_auto_takes_steps_off_a_slow_host_and_trains_as_plain_pytorch(shards):
    # Shards given by hand: the lane model has their pieces timed on a batch of the data, with the generators left
    # as they were (a shuffling DataLoader draws its order from them), so training is still plain PyTorch training.
    data = token_batches(6)
    reference, reference_losses = placed_training.plain_reference(data)
    model = tied_transformer()
    # The host steps the model's ~1.8 MB a step at 2 MB/s: a second a step, against milliseconds of compute.
    results = train_auto(model, data, link=1e10, host=2e6, shards=shards, budget_fraction=4.0)
    result, stats = results[0], results.stats[0]
    if shards is None:
        # One shard a layer: the rule keeps the tied embedding and head (shards 0 and 7) resident and steps the blocks
        # on the host; the lane model takes blocks off it too (stepped on the device, or resident where the room
        # holds homes). A planned cut follows the times the planner measures, and with it what the room holds.
        assert {0, 7} <= set(result.resident_shards), result.placement
        assert len(set(result.resident_shards) | set(result.device_shards)) > 2, result.placement
    assert stats["device_steps"] == len(result.device_shards) * result.steps
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5
    assert model[0].weight is model[-1].weight
    plan = results.lane_plan  # what the lane model was told, and its forecast
    assert plan["rates"]["copies_in"] == plan["rates"]["copies_out"] == 1e10 and plan["rates"]["host_steps"] == 2e6
    assert all(0.0 <= share <= 1.0 + 1e-9 for share in plan["busy"].values())
    assert "lane model: link 9.31 GiB/s in" in results.summary()


def test_auto_keeps_steps_on_the_host_where_the_link_is_slow():
    # Three models: one's step round trip hides behind the others' units, and the link, which a device step's
    # master and moments would cross both ways, binds.
    data = token_batches(3)
    tasks = [ht.ModelTask(tied_transformer(seed=i), optimizer=placed_training.adamw(), loss_fn=lm_loss, data=data,
                          shards="auto") for i in range(3)]
    with testing.emulated_link(1e6), testing.emulated_host(1e11):
        results = ht.train(tasks, devices="cpu", memory_budget=int(6.0 * model_bytes(tied_transformer())),
                           progress=False)
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.device_shards for r in results] == [[]] * 3, [r.placement for r in results]
    assert all(stats["device_steps"] == 0 for stats in results.stats)


def test_auto_on_a_cpu_device_without_emulated_lanes_keeps_the_engines_rule():
    # A CPU device shares the host's cores and memory: no lane to move work to.
    model = tied_transformer()
    results = placed_training.train(model, token_batches(4), "auto", 3.0, shards="auto")
    assert results[0].device_shards == [], results[0].placement
    assert results.lane_plan is None and "lane model" not in results.summary()


def test_a_one_shot_iterator_is_not_measured_and_loses_no_batch():
    data = OneShot(4)
    results = train_auto(tied_transformer(), data, link=1e10, host=2e6, shards=None)
    assert results[0].steps == 4, "every batch trained"
    assert results[0].device_shards == [], "nothing measured: the engine's rule"


def test_a_task_whose_data_lies_or_fails_is_not_measured_and_fails_alone():
    float_ids = [(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))] * 2  # an embedding takes no floats
    tasks = [ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=LyingData(0, 4), name="lies"),
             ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=float_ids, name="bad"),
             ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=token_batches(3), name="good")]
    tasks[1].piece_seconds = [1.0] * len(tasks[1].pieces)  # another call's times: not kept
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        measuring.measure_tasks(tasks, [torch.device("cpu")], [1 << 40], time_units=True)
        assert tasks[0].piece_seconds is None, "no batch to measure on"
        assert tasks[1].piece_seconds is None, "its pieces fail on its batch"
        assert len(tasks[2].piece_seconds) == len(tasks[2].pieces)
        results = ht.train(tasks[1:], devices="cpu", memory_budget=int(6.0 * model_bytes(tied_transformer())),
                           progress=False)
    assert not results["bad"].ok and results["good"].ok and results["good"].steps == 3


def test_measuring_leaves_a_shuffling_loaders_own_generator_and_pythons_as_they_were():
    import random

    samples = [(x[i], y[i]) for x, y in token_batches(2) for i in range(4)]
    generator = torch.Generator().manual_seed(5)
    loader = torch.utils.data.DataLoader(samples, batch_size=4, shuffle=True, generator=generator)
    task = ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=loader)
    before, python_before = generator.get_state(), random.getstate()
    with testing.emulated_link(1e10):
        measuring.measure_tasks([task], [torch.device("cpu")], [1 << 40], time_units=True)
    assert task.piece_seconds is not None
    assert torch.equal(generator.get_state(), before) and random.getstate() == python_before


def test_a_failed_measurement_warns_and_keeps_the_engines_rule(monkeypatch):
    def out_of_memory(device, elements):
        raise torch.OutOfMemoryError("no room for the rates' buffers")

    monkeypatch.setattr(lane_rates, "measure", out_of_memory)
    with pytest.warns(RuntimeWarning, match="could not ask the lane model .*no room"):
        results = train_auto(tied_transformer(), token_batches(3), link=1e10, host=2e6, shards=None)
    assert results[0].placement == ENDS and results.lane_plan is None


def test_a_task_given_its_shards_is_priced_at_the_measured_tasks_rate():
    runners = [type("Runner", (), {"task": ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=token_batches(1))})()
               for _ in range(2)]
    measured = runners[0].task
    measured.piece_seconds = [0.001 * (i + 1) for i in range(len(measured.pieces))]
    stores = [ht._loader.native.ShardStore(r.task.shard_params, r.task.optimizer.spec(), False, False)
              for r in runners]
    first, second = lane_choice.timed_seconds(runners, stores)
    assert first == pytest.approx(lane_choice.shard_seconds(measured))
    rate = sum(first) / sum(stores[0].device_numel(s) for s in range(stores[0].num_shards))
    assert second == pytest.approx([rate * stores[1].device_numel(s) for s in range(stores[1].num_shards)])
    measured.piece_seconds = measured.piece_seconds[:-1]  # not this cut's pieces: not used
    assert lane_choice.timed_seconds(runners, stores) == [None, None]


@pytest.mark.parametrize("shards", ["auto", None], ids=["planned", "by_hand"])
def test_auto_on_several_devices_takes_steps_off_a_slow_host_onto_the_devices(shards):
    # No home on several devices (a spilled task's units run on any of them): the tied ends step on the host, and the
    # lane model steps other shards on whichever device runs their backward. A task cut by hand is timed on the first.
    data = token_batches(6)
    reference, reference_losses = placed_training.plain_reference(data)
    model = tied_transformer()
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        results = placed_training.train(model, data, "auto", 4.0, devices=["cpu", "cpu"], shards=shards)
    result = results[0]
    assert result.resident_shards == [] and result.device_shards, result.placement
    assert sum(stats["device_steps"] for stats in results.stats) == len(result.device_shards) * result.steps
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5
    assert results.lane_plan["rates"]["host_steps"] == 2e6
    # What the lane model placed in: no home on several devices (the rule's placement every shard on the host), and
    # the room the devices' budgets leave beyond it.
    assert results.lane_plan["start"] == [["host"] * len(result.shard_loads)]
    assert isinstance(results.lane_plan["room"], int) and results.lane_plan["room"] > 0


def test_auto_on_several_devices_keeps_a_task_whose_steps_sum_backwards_on_the_host():
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        results = placed_training.train(tied_transformer(), token_batches(4), "auto", 4.0, devices=["cpu", "cpu"],
                                        shards=None, accumulate=2)
    assert results[0].placement == "spilled" and results.lane_plan is None


def test_auto_on_several_devices_keeps_the_steps_on_the_host_where_the_link_binds():
    """There the lane model's choice is asked only where the host lane bounds the host-only run (lane_choice's
    _host_binds): on two devices its forecast counted host steps too dear, and took device steps that ran slower."""
    with testing.emulated_link(1e7), testing.emulated_host(1e11):
        results = placed_training.train(tied_transformer(), token_batches(3), "auto", 4.0, devices=["cpu", "cpu"],
                                        shards=None)
    assert results[0].placement == "spilled" and results.lane_plan is None


def test_auto_on_several_devices_plans_around_a_model_resident_on_one_of_them():
    # The resident model is kept where it is in the lane model (it loads its device's compute), and the spilled one
    # steps shards on the devices; both train as plain PyTorch.
    data = token_batches(4)
    small, large = tied_transformer(seed=1, blocks=1), tied_transformer()
    tasks = [ht.ModelTask(model, optimizer=placed_training.adamw(), loss_fn=lm_loss, data=data, name=name)
             for model, name in ((small, "small"), (large, "large"))]
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        torch.manual_seed(placed_training.SEED)
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(4.0 * model_bytes(large)), progress=False)
    assert all(r.ok for r in results), [r.error for r in results]
    assert results[0].resident and not results[1].resident and results[1].device_shards, \
        [r.placement for r in results]
    reference, _ = placed_training.plain_reference(data)
    assert max_relative_error(large, reference) <= 1e-5
