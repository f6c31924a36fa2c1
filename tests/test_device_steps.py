"""Shards of a spilled task stepped on the device (placement="device"): their gradients stay on the device, their
fp32 master and optimizer state come in for the step and go home with the new weights. Training must still be
plain PyTorch training, and the same, bit for bit, as with those shards stepped on the host."""
import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.run import lane_choice, measuring
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain
import placed_training
from placed_training import SEED, adamw, params

# tied_transformer(): 8 layers, the embedding (0) tied to the head (7); budget 2x its fp32 weights.
DEVICE = "spilled, shards 0, 7 resident, shards 1-6 stepped on the device"
ENDS = "spilled, shards 0, 7 resident"


def train(model, data, placement, budget_fraction=2.0, **options):
    return placed_training.train(model, data, placement, budget_fraction, **options)


@pytest.mark.parametrize("accumulate, clip", [(1, None), (3, None), (1, 0.5), (2, 0.5)])
def test_device_stepped_shards_train_as_plain_pytorch(accumulate, clip):
    data = token_batches(12)
    reference = tied_transformer()
    reference_losses = train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
                                   accumulate=accumulate, clip=clip, seed=SEED)
    model = tied_transformer()
    options = {"clip_grad_norm": clip} if clip else {}
    results = train(model, data, "device", accumulate=accumulate, **options)
    result, stats = results[0], results.stats[0]
    assert result.placement == DEVICE and result.device_shards == [1, 2, 3, 4, 5, 6]
    assert stats["device_steps"] == 6 * result.steps and stats["host_steps"] == 0
    assert stats["high_water_bytes"] <= stats["budget_bytes"]
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5
    assert model[0].weight is model[-1].weight
    summary = results.summary()
    assert f"({DEVICE})" in summary and f"shard steps: {6 * result.steps} on the device, {2 * result.steps} resident" \
        in summary


@pytest.mark.parametrize("options", [
    {"accumulate": 2, "clip_grad_norm": 0.3},
    {"lr_schedule": "cosine", "warmup_steps": 2},
    {"param_groups": [{"params": ht.optim.NO_WEIGHT_DECAY, "weight_decay": 0.0, "lr": 1e-3}]},
    {"optimizer": ht.optim.SGD(lr=0.05, momentum=0.9, nesterov=True)},
    {"precision": "bf16"},
    {"precision": "bf16", "clip_grad_norm": 0.3},
], ids=["clip_accumulate", "schedule", "param_groups", "sgd", "bf16", "bf16_clip"])
def test_device_stepped_and_host_stepped_shards_end_bit_for_bit_alike(options):
    data = token_batches(8)
    stepped, spilled = tied_transformer(), tied_transformer()
    got = train(stepped, data, "device", **dict(options))[0]
    want = train(spilled, data, "auto", **dict(options))[0]
    assert got.placement == DEVICE and want.placement == ENDS
    assert got.losses == want.losses
    assert all(torch.equal(a, b) for a, b in zip(params(stepped), params(spilled)))


def test_with_room_to_cache_them_device_stepped_shards_weights_come_in_once():
    """A step updates a cached copy of the shard's weights on the device as it sends them home: where the arena
    keeps them, the next visit copies nothing in."""
    data = token_batches(8)
    stepped, spilled = tied_transformer(), tied_transformer()
    got = train(stepped, data, "device", budget_fraction=4.0)[0]
    want = train(spilled, data, "auto", budget_fraction=4.0)[0]
    assert got.placement == DEVICE and got.shard_loads == [1] * 8
    assert max(want.shard_loads) > 1, "a host-stepped shard's weights come in again after each step"
    assert got.losses == want.losses
    assert all(torch.equal(a, b) for a, b in zip(params(stepped), params(spilled)))


def test_a_frozen_weight_in_a_device_stepped_shard_keeps_its_value():
    data = token_batches(6)
    stepped, spilled = tied_transformer(), tied_transformer()
    for model in (stepped, spilled):
        model[3].qkv.weight.requires_grad_(False)
    frozen = stepped[3].qkv.weight.detach().clone()
    got = train(stepped, data, "device")[0]
    train(spilled, data, "auto")
    assert got.placement == DEVICE
    assert torch.equal(stepped[3].qkv.weight, frozen)
    assert all(torch.equal(a, b) for a, b in zip(params(stepped), params(spilled)))


@pytest.mark.parametrize("accumulate, clip", [(2, None), (1, 0.5)])
def test_where_their_held_gradients_do_not_all_fit_the_first_shards_step_on_the_device(accumulate, clip):
    """A step that sums several backwards (accumulation, clipping) holds each device-stepped shard's gradients on the
    device for the whole run: the budget holds only some of them, the first blocks' and the final norm's (the
    blocks after them do not fit; the norm, small, does)."""
    model, reference = tied_transformer(), tied_transformer()
    data = token_batches(6 * accumulate)
    options = {"clip_grad_norm": clip} if clip else {}
    result = train(model, data, "device", budget_fraction=1.5, accumulate=accumulate, **options)[0]
    assert result.resident_shards == [0, 7]
    blocks = [s for s in result.device_shards if s <= 5]
    assert blocks and blocks == list(range(1, 1 + len(blocks))) and len(blocks) < 5
    assert result.device_shards == blocks + [6]
    train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05), accumulate=accumulate,
                clip=clip, seed=SEED)
    assert max_relative_error(model, reference) <= 1e-5


def test_where_each_backward_is_followed_by_its_step_the_gradients_need_no_buffer_of_their_own():
    """Under the budget that holds only some shards' gradient buffers, every untied shard steps on the device: its
    gradients take arena room from its backward to its step, as a host-stepped shard's do until they are copied out."""
    model, reference = tied_transformer(), tied_transformer()
    data = token_batches(6)
    results = train(model, data, "device", budget_fraction=1.5)
    result, stats = results[0], results.stats[0]
    assert result.placement == DEVICE and stats["device_steps"] == 6 * result.steps
    assert stats["high_water_bytes"] <= stats["budget_bytes"]
    reference_losses = train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
                                   seed=SEED)
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5


def test_a_bf16_task_that_sums_micro_batches_steps_every_shard_on_the_host():
    """Its device-stepped shards would sum micro-batches in a bf16 buffer; on the host they sum in fp32."""
    result = train(tied_transformer(), token_batches(4), "device", precision="bf16", accumulate=2)[0]
    assert result.placement == "spilled" and result.device_shards == []


TIED_LAST = [0, 1, 2, 3, 4, 5, 6]  # shard starts: the final norm and the tied head are one shard, which trains the norm


def train_two(placement, budget_fraction, devices="cpu", models=None, checkpoint_dir=None, **options):
    """Two tied models without dropout (new ones, or `models`), cut at TIED_LAST, trained together on `devices` under
    a budget whose arena is `budget_fraction` times one model's fp32 weights: (results, models, each task's data)."""
    models = models or [tied_transformer(seed=seed, dropout=0.0) for seed in (0, 1)]
    data = [token_batches(6, seed=seed + 1) for seed in (0, 1)]
    tasks = [ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=batches, shards=TIED_LAST, name=f"t{i}",
                          **options) for i, (model, batches) in enumerate(zip(models, data))]
    budget = int(budget_fraction * model_bytes(models[0])) + measuring.kept_beside_arena(tasks)
    results = ht.train(tasks, devices=devices, memory_budget=budget, progress=False, placement=placement,
                       checkpoint_dir=checkpoint_dir)
    assert all(result.ok for result in results), [result.error for result in results]
    return results, models, data


@pytest.mark.parametrize("budget_fraction, options", [(1.5, {}), (2.0, {"clip_grad_norm": 0.5})],
                         ids=["each_backward_stepped", "clip"])
def test_a_tied_embedding_and_head_step_on_the_device_together(budget_fraction, options):
    """Beside another spilled task the ends are not resident, and the tie steps on the device: the head's gradient of
    the shared weight is summed into the embedding's gradient buffer there, the embedding's step steps the sum. As
    plain PyTorch, and bit for bit as every shard stepped on the host."""
    results, models, data = train_two("device", budget_fraction, **options)
    assert results[0].device_shards == list(range(7)), results[0].placement
    assert results[0].placement == "spilled, shards 0-6 stepped on the device"
    assert results.stats[0]["high_water_bytes"] <= results.stats[0]["budget_bytes"]
    host, host_models, _ = train_two("host", budget_fraction, **options)
    for got, want, model, host_model in zip(results, host, models, host_models):
        assert got.losses == want.losses
        assert all(torch.equal(a, b) for a, b in zip(params(model), params(host_model)))
    reference = tied_transformer(seed=0, dropout=0.0)
    reference_losses = train_plain(reference, data[0], lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
                                   clip=options.get("clip_grad_norm"), seed=SEED)
    assert results[0].losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(models[0], reference) <= 1e-5
    assert models[0][0].weight is models[0][-1].weight


# Per task: a tie split both ways. Task 0 steps the embedding (shard 0) on the device and the head that borrows it
# (shard 6, which trains the final norm) on the host; task 1 the head on the device and the embedding on the host.
SPLIT = [["device"] * 4 + ["host"] * 3, ["host"] * 5 + ["device"] * 2]


def train_split(monkeypatch, budget_fraction=2.0, **options):
    """train_two under "auto" on an emulated link and host, the lane model's choice replaced by SPLIT."""
    chosen = lane_choice.plan

    def split(*args):
        planned = chosen(*args)
        assert planned is not None, "the lane model was asked"
        return [list(places) for places in SPLIT], planned[1]
    monkeypatch.setattr(lane_choice, "plan", split)
    with testing.emulated_link(1e10), testing.emulated_host(1e10):
        return train_two("auto", budget_fraction, **options)


@pytest.mark.parametrize("options", [{}, {"clip_grad_norm": 0.5}], ids=["each_backward_stepped", "clip"])
def test_a_tie_split_between_the_device_and_the_host_trains_as_plain_pytorch(monkeypatch, options):
    """The tied weight steps with its owner. A host-stepped head adds its gradient of the shared weight to the
    device-stepped embedding's buffer and sends out only the norm's; a device-stepped head sends its share out to be
    summed with the host-stepped embedding's. As plain PyTorch, and bit for bit as every shard stepped on the host."""
    results, models, data = train_split(monkeypatch, **options)
    assert [result.device_shards for result in results] == [[0, 1, 2, 3], [5, 6]], results.summary()
    assert all(stats["high_water_bytes"] <= stats["budget_bytes"] for stats in results.stats)
    host, host_models, _ = train_two("host", 2.0, **options)
    for got, want, model, host_model in zip(results, host, models, host_models):
        assert got.losses == want.losses
        assert all(torch.equal(a, b) for a, b in zip(params(model), params(host_model)))
    for name, device in (("t0", {0, 1, 2, 3}), ("t1", {5, 6})):
        places = {(entry.shard, entry.place) for entry in results.steps if entry.task_name == name}
        assert {shard for shard, place in places if place == "device"} == device, (name, sorted(places))
    for i in (0, 1):
        reference = tied_transformer(seed=i, dropout=0.0)
        reference_losses = train_plain(reference, data[i], lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
                                       clip=options.get("clip_grad_norm"), seed=SEED)
        assert results[i].losses == pytest.approx(reference_losses, rel=1e-5)
        assert max_relative_error(models[i], reference) <= 1e-5
        assert models[i][0].weight is models[i][-1].weight


def test_a_checkpoint_of_a_split_tie_resumes_on_the_device_whole_bit_for_bit(monkeypatch, tmp_path):
    _, straight, _ = train_two("host", 2.0)
    first, resumed, _ = train_split(monkeypatch, max_steps=3, checkpoint_dir=tmp_path)
    assert first[1].device_shards == [5, 6] and first[1].steps == 3
    results, _, _ = train_two("device", 2.0, models=resumed, checkpoint_dir=tmp_path)
    assert [result.steps for result in results] == [6, 6] and results[1].device_shards == list(range(7))
    for model, reference in zip(resumed, straight):
        assert all(torch.equal(a, b) for a, b in zip(params(model), params(reference)))


def test_a_checkpoint_of_a_tie_stepped_on_the_device_resumes_on_the_host_bit_for_bit(tmp_path):
    _, straight, _ = train_two("host", 1.5)
    first, resumed, _ = train_two("device", 1.5, max_steps=3, checkpoint_dir=tmp_path)
    assert first[0].device_shards == list(range(7)) and first[0].steps == 3
    results, _, _ = train_two("host", 1.5, models=resumed, checkpoint_dir=tmp_path)
    assert [result.steps for result in results] == [6, 6] and results[0].device_shards == []
    for model, reference in zip(resumed, straight):
        assert all(torch.equal(a, b) for a, b in zip(params(model), params(reference)))


def test_a_tie_stepped_on_the_device_stays_there_when_another_task_leaves():
    """A task placed again once another has left keeps nothing on the device between its steps; a tie's owner keeps
    its gradient buffer, so a task stepping a tie on the device is not moved (its tie would go back to the host)."""
    models = [tied_transformer(seed=seed, dropout=0.0) for seed in (0, 1)]
    tasks = [ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(count), shards=TIED_LAST,
                          name=f"t{i}") for i, (model, count) in enumerate(zip(models, (2, 6)))]
    results = ht.train(tasks, devices="cpu", memory_budget=int(1.5 * model_bytes(models[0])), progress=False,
                       placement="device")
    assert all(result.ok for result in results)
    assert [result.device_shards for result in results] == [list(range(7))] * 2
    for result in results:
        places = {(entry.shard, entry.place) for entry in results.steps if entry.task_name == result.name}
        assert {place for shard, place in places if shard in (0, 6)} == {"device"}, (result.name, sorted(places))


def test_on_several_devices_a_tie_steps_on_the_host():
    """Its gradient would sum in one device's buffer while the task's units run on either device."""
    results, models, _ = train_two("device", 1.5, devices=["cpu", "cpu"])
    assert results[0].device_shards == [1, 2, 3, 4, 5]


def test_a_tied_head_alone_in_its_shard_steps_on_the_device_with_its_embedding():
    """The default cut puts the head alone in the last shard: nothing of its own to train, its gradient of the shared
    weight goes to the embedding's buffer on the device, and its step is the count alone."""
    runs = {}
    for placement in ("device", "host"):
        models = [tied_transformer(seed=seed, dropout=0.0) for seed in (0, 1)]
        tasks = [ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(4, seed=i + 1),
                              name=f"t{i}") for i, model in enumerate(models)]
        results = ht.train(tasks, devices="cpu", memory_budget=int(1.5 * model_bytes(models[0])), progress=False,
                           placement=placement)
        assert all(result.ok for result in results)
        runs[placement] = results, models
    (got, stepped), (want, spilled) = runs["device"], runs["host"]
    assert got[0].device_shards == list(range(8)), got[0].placement
    assert sum(stats["host_steps"] for stats in got.stats) < sum(stats["host_steps"] for stats in want.stats)
    for a, b, model_a, model_b in zip(got, want, stepped, spilled):
        assert a.losses == b.losses
        assert all(torch.equal(x, y) for x, y in zip(params(model_a), params(model_b)))


SEVERAL = "spilled, shards 1-6 stepped on the device"  # no home on several devices: the tied ends step on the host


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_on_several_devices_each_untied_shard_steps_on_the_device_that_ran_its_backward(precision):
    # Any device may run any unit of the task, so a shard's state comes from, and goes home to, the one host store
    # whichever device steps it: the task ends as with every shard stepped on the host, bit for bit, and in fp32 as
    # plain PyTorch.
    data = token_batches(8)
    stepped, spilled = tied_transformer(), tied_transformer()
    results = train(stepped, data, "device", devices=["cpu", "cpu"], precision=precision)
    got, want = results[0], train(spilled, data, "host", devices=["cpu", "cpu"], precision=precision)[0]
    assert got.placement == SEVERAL and got.device_shards == [1, 2, 3, 4, 5, 6]
    assert sum(stats["device_steps"] for stats in results.stats) == 6 * got.steps
    assert all(stats["high_water_bytes"] <= stats["budget_bytes"] for stats in results.stats)
    assert got.losses == want.losses
    assert all(torch.equal(a, b) for a, b in zip(params(stepped), params(spilled)))
    if precision == "fp32":
        reference, reference_losses = placed_training.plain_reference(data)
        assert got.losses == pytest.approx(reference_losses, rel=1e-5)
        assert max_relative_error(stepped, reference) <= 1e-5


@pytest.mark.parametrize("options", [{"accumulate": 2}, {"clip_grad_norm": 0.5}], ids=["accumulate", "clip"])
def test_on_several_devices_a_task_whose_steps_sum_backwards_steps_on_the_host(options):
    """Its gradients would be summed in a buffer of one device, and its backwards may run on several."""
    result = train(tied_transformer(), token_batches(4), "device", devices=["cpu", "cpu"], **options)[0]
    assert result.placement == "spilled" and result.device_shards == []


def test_on_several_devices_a_checkpoint_of_device_stepped_shards_resumes_bit_for_bit(tmp_path):
    # Two devices throughout: a virtual CPU device computes with its share of the cores, and sums in another order
    # than one device with them all.
    data, devices = token_batches(8), ["cpu", "cpu"]
    straight = tied_transformer()
    train(straight, data, "host", devices=devices)
    resumed = tied_transformer()
    first = train(resumed, data, "device", devices=devices, max_steps=4, checkpoint_dir=tmp_path, name="t")[0]
    assert first.placement == SEVERAL
    result = train(resumed, data, "host", devices=devices, checkpoint_dir=tmp_path, name="t")[0]
    assert result.steps == 8 and result.placement == "spilled"
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))
