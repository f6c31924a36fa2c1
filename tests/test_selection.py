"""Successive halving inside a run: the worse tasks stop at their rungs, the devices go to the others, the
Results say when and why, and a stopped task's weights are exactly those of its last step."""
import pytest
import torch

import hydra_torch as ht
from models import lm_loss, max_relative_error, tied_transformer, token_batches, train_plain

LRS = [3e-3, 1e-3, 3e-4, 1e-4, 3e-5, 1e-5]


def tasks_for(lrs, data, eval_data=None, blocks=1, **options):
    return [ht.ModelTask(tied_transformer(seed=0, blocks=blocks), optimizer=ht.optim.AdamW(lr=lr), loss_fn=lm_loss,
                         data=data, eval_data=eval_data, name=f"lr{lr:g}", **options) for lr in lrs]


@pytest.mark.parametrize("devices", ["cpu", ["cpu", "cpu"]])
def test_worse_tasks_stop_at_their_rungs_and_the_rest_finish(devices):
    data, eval_data = token_batches(12), token_batches(2, seed=7)
    tasks = tasks_for(LRS, data, eval_data)
    largest_shard = max(sum(p.numel() * 4 for p in shard) for shard in tasks[0].shard_params)
    budget = 3 * largest_shard  # spilled: shards visit the devices
    rule = ht.SuccessiveHalving(min_steps=3, reduction_factor=2)
    torch.manual_seed(0)
    results = ht.train(tasks, devices=devices, memory_budget=budget, selection=rule, progress=False)
    assert all(r.error is None for r in results)
    stopped = [r for r in results if r.stopped]
    finished = [r for r in results if not r.stopped]
    assert stopped and finished
    for r in stopped:  # at a rung (3 or 6 steps), judged on the validation loss measured there
        assert r.steps in (3, 6) and r.eval_losses[-1][0] == r.steps
        assert f"(step {r.steps}): validation loss {r.eval_losses[-1][1]:.4f} ranked" in r.stopped
        # No unit of it ran after it stopped: its trace holds its steps' units and its evaluations', no more.
        n = len(r.shard_loads)
        units = [e for e in results.trace if e.task_name == r.name]
        assert len(units) == r.steps * (2 * n - 1) + len(r.eval_losses) * len(eval_data) * n
    assert all(r.steps == 12 for r in finished)
    assert sum(r.steps for r in results) < 12 * len(LRS)
    # Rungs evaluate every task; their final evaluation after the last step too.
    assert all({3}.issubset(step for step, _ in r.eval_losses) for r in results)
    assert results.best in finished
    assert "stopped: successive halving at rung" in results.summary()


def test_a_stopped_task_keeps_exactly_the_weights_of_its_last_step():
    data, eval_data = token_batches(8), token_batches(2, seed=7)
    tasks = tasks_for([3e-3, 1e-5], data, eval_data)  # lr 1e-5 reaches rung 1 second and loses
    torch.manual_seed(0)  # each task's random streams start from the generator's state, as a plain loop's would
    results = ht.train(tasks, devices="cpu", selection=ht.SuccessiveHalving(min_steps=4, reduction_factor=2),
                       schedule="round_robin", progress=False)
    loser = results["lr1e-05"]
    assert loser.stopped and loser.steps == 4 and results["lr0.003"].steps == 8
    reference = tied_transformer(seed=0, blocks=1)
    reference_losses = train_plain(reference, data[:4], lambda p: torch.optim.AdamW(p, lr=1e-5), seed=0)
    for ours, theirs in zip(tasks[1].model.parameters(), reference.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    assert loser.losses == pytest.approx(reference_losses, rel=1e-5)


@pytest.mark.parametrize("clip", [None, 1.0])
def test_training_loss_metric_needs_no_validation_data(clip):
    data = token_batches(8)
    # FIFO: the order in which tasks reach a rung, and so which of them an asynchronous rung stops, does not
    # depend on unit timings (under LRTF a run on a busy machine could let every task through). Clipped, a step
    # is judged once its norm is read, before the task's next unit: a stopped task still stops at its rung.
    results = ht.train(tasks_for([3e-3, 1e-3, 1e-5, 1e-6], data, clip_grad_norm=clip), devices="cpu", progress=False,
                       schedule="fifo",
                       selection=ht.SuccessiveHalving(min_steps=2, reduction_factor=2, metric="train_loss"))
    stopped = [r for r in results if r.stopped]
    assert stopped and all("mean training loss since the last rung" in r.stopped for r in stopped)
    assert all(r.steps in (2, 4) for r in stopped)


def test_bad_selection_is_refused_before_anything_changes():
    data = token_batches(4)
    tasks = tasks_for([1e-3, 1e-4], data)
    before = [p.detach().clone() for t in tasks for p in t.model.parameters()]
    with pytest.raises(ValueError, match="no eval_data"):
        ht.train(tasks, devices="cpu", selection=ht.SuccessiveHalving(min_steps=2), progress=False)
    with pytest.raises(TypeError, match="selection must be"):
        ht.train(tasks, devices="cpu", selection="asha", progress=False)
    for bad in ({"min_steps": 0}, {"min_steps": 2, "reduction_factor": 1}, {"min_steps": 2.5},
                {"min_steps": 2, "metric": "accuracy"}, {"min_steps": 2**63},
                {"min_steps": 2, "reduction_factor": 2**70}):  # past the native rule's int64
        with pytest.raises(ValueError, match="SuccessiveHalving"):
            ht.SuccessiveHalving(**bad)
    after = [p for t in tasks for p in t.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_a_resumed_run_judges_and_stops_as_the_uninterrupted_one(tmp_path):
    """The first run ends at step 2, before any rung; the second, longer, resumes from its checkpoint, judges
    both tasks at step 2 on the validation loss measured there and goes on as one run of 8 steps would."""
    data, eval_data = token_batches(8), token_batches(2, seed=7)
    rule = ht.SuccessiveHalving(min_steps=2, reduction_factor=2)

    def run(max_steps, checkpoint_dir=None):
        tasks = [ht.ModelTask(tied_transformer(seed=0, blocks=1), optimizer=ht.optim.AdamW(lr=lr), loss_fn=lm_loss,
                              data=data, eval_data=eval_data, max_steps=max_steps, name=f"lr{lr:g}")
                 for lr in (3e-3, 1e-5)]
        torch.manual_seed(0)
        results = ht.train(tasks, devices="cpu", selection=rule, schedule="round_robin", progress=False,
                           checkpoint_dir=checkpoint_dir)
        return results, [t.model for t in tasks]

    whole, whole_models = run(8)
    assert whole["lr1e-05"].stopped and whole["lr1e-05"].steps == 2 and whole["lr0.003"].steps == 8
    first, _ = run(2, tmp_path)
    assert [r.steps for r in first] == [2, 2] and not any(r.stopped for r in first)
    resumed, models = run(8, tmp_path)
    for a, b in zip(whole, resumed):
        assert (a.steps, a.stopped) == (b.steps, b.stopped)
        assert a.losses == pytest.approx(b.losses, rel=1e-6)
        assert [s for s, _ in a.eval_losses] == [s for s, _ in b.eval_losses]
        assert [v for _, v in a.eval_losses] == pytest.approx([v for _, v in b.eval_losses], rel=1e-6)
    for a, b in zip(whole_models, models):
        assert max_relative_error(a, b) <= 1e-6
    again, _ = run(8, tmp_path)  # everything done or stopped: nothing trains, the stop is remembered
    assert not again.trace and again["lr1e-05"].stopped == whole["lr1e-05"].stopped
