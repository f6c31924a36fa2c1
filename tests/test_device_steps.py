"""Shards of a spilled task stepped on the device (placement="device"): their gradients stay on the device, their
fp32 master and optimizer state come in for the step and go home with the new weights. Training must still be
plain PyTorch training, and the same, bit for bit, as with those shards stepped on the host."""
import math

import pytest
import torch

import hydra_torch as ht
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
    device for the whole run: the budget holds only some of them."""
    model, reference = tied_transformer(), tied_transformer()
    data = token_batches(6 * accumulate)
    options = {"clip_grad_norm": clip} if clip else {}
    result = train(model, data, "device", budget_fraction=1.5, accumulate=accumulate, **options)[0]
    assert result.device_shards and result.device_shards == list(range(1, 1 + len(result.device_shards)))
    assert len(result.device_shards) < 6
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


def test_on_several_devices_a_spilled_task_steps_on_the_host_and_runs_anywhere():
    result = train(tied_transformer(), token_batches(6), "device", devices=["cpu", "cpu"])[0]
    assert result.placement == "spilled" and result.device_shards == []


def test_evaluation_reads_the_device_stepped_shards_current_weights():
    data, held_out = token_batches(6), token_batches(2, seed=7)
    stepped, spilled = tied_transformer(), tied_transformer()
    got = train(stepped, data, "device", eval_data=held_out, eval_every=2)[0]
    want = train(spilled, data, "host", eval_data=held_out, eval_every=2)[0]
    assert got.placement == DEVICE and got.eval_losses == want.eval_losses and len(got.eval_losses) >= 3


@pytest.mark.parametrize("first, then", [("host", "device"), ("device", "host")])
def test_a_checkpoint_written_under_one_placement_resumes_under_the_other_bit_for_bit(tmp_path, first, then):
    data = token_batches(8)
    straight = tied_transformer()
    train(straight, data, then)
    resumed = tied_transformer()
    train(resumed, data, first, max_steps=4, checkpoint_dir=tmp_path, name="t")
    result = train(resumed, data, then, checkpoint_dir=tmp_path, name="t")[0]
    assert result.steps == 8 and result.placement == (DEVICE if then == "device" else "spilled")
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))


@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 1.0)])
def test_a_nan_loss_keeps_the_last_good_weights_of_device_stepped_shards(accumulate, clip):
    bad_step = 3
    data = token_batches(6 * accumulate)
    calls = {"n": 0}

    def loss_fn(out, batch):
        calls["n"] += 1
        loss = lm_loss(out, batch)
        return loss * math.nan if calls["n"] == (bad_step + 1) * accumulate else loss

    def run(model, loss_fn, data):
        task = ht.ModelTask(model, loss_fn=loss_fn, data=data, accumulate=accumulate, clip_grad_norm=clip)
        return ht.train([task], devices="cpu", memory_budget=2 * model_bytes(model), progress=False,
                        placement="device")[0]

    reference = tied_transformer()
    assert run(reference, lm_loss, data[:bad_step * accumulate]).placement == DEVICE
    model = tied_transformer()
    with pytest.warns(RuntimeWarning, match="step 3"):
        result = run(model, loss_fn, data)
    assert isinstance(result.error, ht.NonFiniteLossError) and result.steps == bad_step
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_device_shards_are_checked_by_the_engine_before_anything_is_registered():
    model = tied_transformer()
    task = ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(2))
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, False)
    engine = ht._C.DeviceEngine("cpu", 100 * model_bytes(model))
    free = engine.free_bytes()
    for bad, why in [([0], "shares a tied weight"), ([1, 1], "named twice"), ([8], "of a model of 8 shards")]:
        with pytest.raises(RuntimeError, match=why):
            engine.add_model(store, allow_resident=False, device_shards=bad)
    with pytest.raises(RuntimeError, match="resident too"):
        engine.add_model(store, allow_resident=False, resident_shards=[0, 7], device_shards=[1, 7])
    with pytest.raises(RuntimeError, match="a spilled model's"):
        engine.add_model(store, device_shards=[1])
    assert engine.free_bytes() == free
    model_id = engine.add_model(store, allow_resident=False, resident_shards=[0, 7], device_shards=[2, 3])
    assert engine.device_shards(model_id) == [2, 3] and engine.resident_shards(model_id) == [0, 7]


def test_a_task_joining_a_run_with_device_stepped_shards_steps_its_untied_ones_there_and_each_trains_as_alone():
    # The arena is sized when the task joins: no homes for its tied ends, but its other shards step on the device
    # (each backward is followed by its step: no gradient buffer is held).
    from hydra_torch.arrivals import Arrivals
    data = token_batches(6)
    first, late = tied_transformer(seed=0), tied_transformer(seed=1)
    references = [tied_transformer(seed=0), tied_transformer(seed=1)]
    for reference in references:
        train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05), seed=SEED)

    def task(model, name):
        return ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=data, name=name)
    late_task = task(late, "late")  # built before the run: a model's construction draws random numbers

    def on_ended(result):
        if result.name == "first":
            arrivals.add(late_task)
        else:
            arrivals.close()
    arrivals = Arrivals(on_ended=on_ended)
    torch.manual_seed(SEED)
    results = ht.train([task(first, "first")], devices="cpu", memory_budget=2 * model_bytes(first), progress=False,
                       placement="device", arrivals=arrivals)
    assert [r.name for r in results] == ["first", "late"] and all(r.ok for r in results)
    assert results["first"].placement == DEVICE
    assert results["late"].placement == "spilled, shards 1-6 stepped on the device"
    assert results.stats[0]["device_steps"] == 2 * 6 * 6
    for model, reference in zip((first, late), references):
        assert max_relative_error(model, reference) <= 1e-5
