"""Shards of one spilled task placed apart: with placement="auto" on one device, its first and last shards stay
resident (their whole state on the device, stepped there) and the rest are spilled. Training must still be plain
PyTorch training, and the same, bit for bit in fp32, as with every shard spilled (placement="host")."""
import pytest
import torch

import hydra_torch as ht
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain
import placed_training
from placed_training import SEED, adamw, params

ENDS = "spilled, shards 0, 7 resident"  # tied_transformer(): 8 layers, the embedding tied to the head


def train(model, data, placement, budget_fraction=1.0, **options):
    return placed_training.train(model, data, placement, budget_fraction, **options)


@pytest.mark.parametrize("accumulate, clip", [(1, None), (3, None), (1, 0.5), (2, 0.5)])
def test_resident_ends_train_as_plain_pytorch(accumulate, clip):
    data = token_batches(12)
    reference = tied_transformer()
    reference_losses = train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
                                   accumulate=accumulate, clip=clip, seed=SEED)
    model = tied_transformer()
    options = {"clip_grad_norm": clip} if clip else {}
    results = train(model, data, "auto", accumulate=accumulate, **options)
    result = results[0]
    assert result.placement == ENDS and not result.resident and result.resident_shards == [0, 7]
    assert result.shard_loads[0] == 1 and result.shard_loads[-1] == 1, "resident shards are uploaded once"
    assert max(result.shard_loads[1:-1]) > 1, "the spilled shards are copied in for every step"
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5
    assert model[0].weight is model[-1].weight
    assert results.stats[0]["high_water_bytes"] <= results.stats[0]["budget_bytes"]
    assert f"({ENDS})" in results.summary()


@pytest.mark.parametrize("options", [
    {"accumulate": 2, "clip_grad_norm": 0.3},
    {"lr_schedule": "cosine", "warmup_steps": 2},
    {"param_groups": [{"params": ht.optim.NO_WEIGHT_DECAY, "weight_decay": 0.0, "lr": 1e-3}]},
    {"optimizer": ht.optim.SGD(lr=0.05, momentum=0.9, nesterov=True)},
], ids=["clip_accumulate", "schedule", "param_groups", "sgd"])
def test_resident_ends_and_every_shard_spilled_end_bit_for_bit_alike(options):
    data = token_batches(8)
    ends, spilled = tied_transformer(), tied_transformer()
    got = train(ends, data, "auto", **dict(options))[0]
    want = train(spilled, data, "host", **dict(options))[0]
    assert got.placement == ENDS and want.placement == "spilled"
    assert got.losses == want.losses
    assert all(torch.equal(a, b) for a, b in zip(params(ends), params(spilled)))


def test_bf16_resident_ends_track_every_shard_spilled():
    """In bf16 a resident shard sums a tied weight's two gradients in bf16 as autograd does (as a resident task),
    a spilled one in fp32 on the host: close, not equal."""
    data = token_batches(12)
    ends, spilled = tied_transformer(dropout=0.0), tied_transformer(dropout=0.0)
    got = train(ends, data, "auto", precision="bf16")[0]
    want = train(spilled, data, "host", precision="bf16")[0]
    assert got.placement == ENDS
    assert got.losses[-1] < got.losses[0]
    assert max(abs(a - b) / b for a, b in zip(got.losses, want.losses)) <= 0.01
    assert all(p.dtype == torch.float32 for p in ends.parameters())


def test_a_bf16_task_that_sums_micro_batches_keeps_its_ends_spilled():
    """A resident shard would sum its micro-batches' gradients in its bf16 buffer; spilled, they sum in fp32."""
    result = train(tied_transformer(), token_batches(4), "auto", precision="bf16", accumulate=2)[0]
    assert result.placement == "spilled"
    assert train(tied_transformer(), token_batches(4), "auto", precision="bf16")[0].placement == ENDS


def test_a_frozen_weight_in_the_resident_shards_keeps_its_value():
    data = token_batches(6)
    ends, spilled = tied_transformer(), tied_transformer()
    for model in (ends, spilled):
        model[0].weight.requires_grad_(False)  # the tied embedding and head: both ends hold nothing to train
    frozen = ends[0].weight.detach().clone()
    got = train(ends, data, "auto")[0]
    train(spilled, data, "host")
    assert got.placement == ENDS
    assert torch.equal(ends[0].weight, frozen)
    assert all(torch.equal(a, b) for a, b in zip(params(ends), params(spilled)))


def test_where_the_ends_do_not_fit_every_shard_is_spilled():
    model = tied_transformer()
    result = train(model, token_batches(4), "auto", budget_fraction=0.4)[0]
    assert result.placement == "spilled" and result.resident_shards == []


def test_on_several_devices_a_spilled_task_spills_whole_and_runs_anywhere():
    model = tied_transformer()
    result = train(model, token_batches(6), "auto", devices=["cpu", "cpu"])[0]
    assert result.placement == "spilled"


@pytest.mark.parametrize("budget_fraction, placements", [
    (4.0, [ENDS] * 3),  # every spilled shard's weights stay cached beside the homes: each task keeps its ends
    (2.5, ["spilled"] * 3),  # homes would take room that caches the others' weights, whose units hide the round trip
])
def test_beside_other_spilled_tasks_ends_are_resident_only_where_every_weight_stays_cached(budget_fraction,
                                                                                          placements):
    data = token_batches(8)
    models = [tied_transformer(seed=s) for s in range(3)]
    references = [tied_transformer(seed=s) for s in range(3)]
    for reference in references:
        train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05), seed=SEED)
    torch.manual_seed(SEED)
    tasks = [ht.ModelTask(m, optimizer=adamw(), loss_fn=lm_loss, data=data, name=f"m{i}") for i, m in enumerate(models)]
    results = ht.train(tasks, devices="cpu", memory_budget=int(budget_fraction * model_bytes(models[0])),
                       progress=False)
    assert all(r.ok for r in results)
    assert [r.placement for r in results] == placements
    for model, reference in zip(models, references):
        assert max_relative_error(model, reference) <= 1e-5


def test_evaluation_reads_the_resident_shards_current_weights():
    data, held_out = token_batches(6), token_batches(2, seed=7)
    ends, spilled = tied_transformer(), tied_transformer()
    got = train(ends, data, "auto", eval_data=held_out, eval_every=2)[0]
    want = train(spilled, data, "host", eval_data=held_out, eval_every=2)[0]
    assert got.placement == ENDS and got.eval_losses == want.eval_losses and len(got.eval_losses) >= 3


@pytest.mark.parametrize("first, then", [("host", "auto"), ("auto", "host")])
def test_a_checkpoint_written_under_one_placement_resumes_under_the_other_bit_for_bit(tmp_path, first, then):
    data = token_batches(8)
    straight = tied_transformer()
    train(straight, data, then)
    resumed = tied_transformer()
    train(resumed, data, first, max_steps=4, checkpoint_dir=tmp_path, name="t")
    result = train(resumed, data, then, checkpoint_dir=tmp_path, name="t")[0]
    assert result.steps == 8 and result.placement == (ENDS if then == "auto" else "spilled")
    assert all(torch.equal(a, b) for a, b in zip(params(resumed), params(straight)))


def test_placement_is_checked_before_anything_runs():
    model = tied_transformer()
    before = params(model)
    task = ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(2))
    for bad in ("gpu", "", None, 3):
        with pytest.raises(ValueError, match="placement must be one of 'auto', 'host'"):
            ht.train(task, devices="cpu", progress=False, placement=bad)
    assert all(torch.equal(a, b) for a, b in zip(before, params(model)))


def test_resident_shards_that_split_a_tied_weight_badly_are_refused_by_the_engine():
    # The head (shard 7) owns nothing: it is resident with the embedding it borrows from, or both spill.
    model = tied_transformer()
    task = ht.ModelTask(model, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(2))
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, False)
    engine = ht._C.DeviceEngine("cpu", 100 * model_bytes(model))
    with pytest.raises(RuntimeError, match="resident shard 7 borrows a tied weight from shard 0, which is spilled"):
        engine.add_model(store, allow_resident=False, resident_shards=[7])
    with pytest.raises(RuntimeError, match="shard 7 has nothing of its own to train and borrows a tied weight from "
                                           "resident shard 0"):
        engine.add_model(store, allow_resident=False, resident_shards=[0])
    with pytest.raises(RuntimeError, match="every shard resident"):
        engine.add_model(store, allow_resident=False, resident_shards=list(range(8)))
    model_id = engine.add_model(store, allow_resident=False, resident_shards=[0, 7])
    assert engine.resident_shards(model_id) == [0, 7] and not engine.resident(model_id)
