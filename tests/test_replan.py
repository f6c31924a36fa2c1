"""A task whose unit runs out of device memory is re-planned (spilled if it was resident, else cut into smaller
shards) and retried from its last step boundary while the others train on, ending as plain PyTorch training
does. On CPU the failure is injected: a layer that raises torch.OutOfMemoryError as a device allocation in its
shard would."""
import threading

import pytest
import torch
from torch import nn

import hydra_torch as ht
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain
from replan_tasks import ADAMW, SEED, TOLERANCE, model_with, reference, task_for


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_a_resident_task_that_runs_out_of_memory_is_spilled_and_retried(devices):
    data = token_batches(8)
    ref, ref_losses = reference(data, accumulate=2)
    model, oom = model_with(lambda m: m.calls == 6)  # in step 3's second micro-batch (one call per micro-batch)
    # On two devices a second task comes first, so the failing one is resident on the other device's thread.
    others = [ht.ModelTask(tied_transformer(seed=3, blocks=2), optimizer=ADAMW[0](), loss_fn=lm_loss,
                           data=token_batches(8, seed=5), name="other")] if len(devices) > 1 else []
    torch.manual_seed(SEED)
    task = task_for(model, oom, data, accumulate=2)
    with pytest.warns(RuntimeWarning, match="re-planned 1 time"):
        results = ht.train(others + [task], devices=devices, memory_budget=16 * model_bytes(model), progress=False)
    result = results[task.name]
    assert "re-planned 1x" in results.summary()
    assert all(r.ok for r in results)
    assert result.ok, result.error
    assert oom.raised == 1
    assert not result.resident
    assert len(result.replans) == 1 and "resident" in result.replans[0] and "step 3" in result.replans[0], result.replans
    assert result.steps == 4
    # The trace numbers its steps on across the re-plan: each step once per shard, resident before it, spilled after.
    steps = [e for e in results.steps if e.task_name == task.name]
    assert sorted((e.step, e.shard) for e in steps) == [(k, s) for k in range(1, 5) for s in range(len(task.modules))]
    assert [{e.place for e in steps if e.step == k} for k in range(1, 5)] == [{"resident"}] * 2 + [{"host"}] * 2
    assert result.losses == pytest.approx(ref_losses, rel=TOLERANCE)
    assert max_relative_error(model, ref) <= TOLERANCE
    assert model[0].weight is model[-1].weight


def test_a_spilled_task_is_cut_finer_until_its_shards_fit_while_another_trains_on():
    data = token_batches(6)
    ref, ref_losses = reference(data)
    # A shard holding the failing layer and any other runs out of memory, whatever the unit.
    model, oom = model_with(lambda m: len(m.shard) > 1)
    other = tied_transformer(seed=5, blocks=3)
    other_ref = tied_transformer(seed=5, blocks=3)
    other_ref_losses = train_plain(other_ref, token_batches(6, seed=9), ADAMW[1], seed=SEED)
    torch.manual_seed(SEED)
    tasks = [task_for(model, oom, data, shards=2, name="failing"),
             ht.ModelTask(other, optimizer=ADAMW[0](), loss_fn=lm_loss, data=token_batches(6, seed=9), name="other")]
    results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(1.5 * model_bytes(model)), progress=False)
    failing, fine = results["failing"], results["other"]
    assert failing.ok, failing.error
    assert len(failing.replans) >= 2, failing.replans  # 2 shards, then 4, then small enough
    assert len(oom.shard) == 1 and tasks[0].num_shards > 4
    assert failing.steps == 6 and fine.ok and fine.steps == 6
    assert failing.losses == pytest.approx(ref_losses, rel=TOLERANCE)
    assert max_relative_error(model, ref) <= TOLERANCE
    assert fine.replans == []
    assert fine.losses == pytest.approx(other_ref_losses, rel=TOLERANCE)
    assert max_relative_error(other, other_ref) <= TOLERANCE


def test_a_retried_step_draws_what_it_drew_the_first_time():
    """Bit for bit the run without the failure, in the plan it ends in: the same batches and dropout masks."""
    data = token_batches(6)
    model, oom = model_with(lambda m: m.calls == 3)  # step 2's first forward (a forward and a backward per step)
    torch.manual_seed(SEED)
    task = task_for(model, oom, data, shards=[0, 4])
    result = ht.train([task], devices="cpu", memory_budget=int(1.5 * model_bytes(model)), progress=False)[0]
    assert result.ok, result.error
    assert oom.raised == 1 and len(result.replans) == 1 and task.num_shards == 4
    starts = [0]
    for group in task.modules[:-1]:
        starts.append(starts[-1] + len(group))
    plain_model, plain_oom = model_with()
    torch.manual_seed(SEED)
    plain = ht.train([task_for(plain_model, plain_oom, data, shards=starts)], devices="cpu",
                     memory_budget=int(1.5 * model_bytes(plain_model)), progress=False)[0]
    assert result.losses == plain.losses
    for a, b in zip(model.parameters(), plain_model.parameters()):
        assert torch.equal(a, b)


def test_a_step_applied_to_some_shards_already_is_not_retried():
    data = token_batches(4)
    # Shard 0 holds the failing layer: its backward comes after the later shards' parts of the step.
    model, oom = model_with(lambda m: torch.is_grad_enabled() and m.calls > 1)
    other = tied_transformer(seed=3, blocks=2)
    torch.manual_seed(SEED)
    tasks = [task_for(model, oom, data, shards=[0, 4, 6], name="failing"),
             ht.ModelTask(other, optimizer=ADAMW[0](), loss_fn=lm_loss, data=data, name="other")]
    with pytest.warns(RuntimeWarning, match="failing"):
        results = ht.train(tasks, devices="cpu", memory_budget=int(1.5 * model_bytes(model)), progress=False)
    failing = results["failing"]
    assert isinstance(failing.error, torch.OutOfMemoryError)
    assert any("not retried" in note and "applied to shards" in note for note in failing.error.__notes__)
    assert failing.replans == [] and failing.steps == 0
    assert results["other"].ok and results["other"].steps == 4


def test_a_task_of_single_layer_shards_stops_with_the_error():
    data = token_batches(3)
    model, oom = model_with(lambda m: m.calls >= 1)
    torch.manual_seed(SEED)
    before = [p.detach().clone() for p in model.parameters()]
    task = task_for(model, oom, data)  # one layer per shard
    with pytest.warns(RuntimeWarning, match="stopped"):
        result = ht.train([task], devices="cpu", memory_budget=int(1.5 * model_bytes(model)), progress=False)[0]
    assert isinstance(result.error, torch.OutOfMemoryError)
    assert any("single layer" in note for note in result.error.__notes__), result.error.__notes__
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_an_evaluation_that_runs_out_of_memory_is_retried():
    data, eval_data = token_batches(4), token_batches(2, seed=4)
    plain_model, plain_oom = model_with()
    torch.manual_seed(SEED)
    plain = ht.train([task_for(plain_model, plain_oom, data, eval_data=eval_data, eval_every=2)], devices="cpu",
                     memory_budget=16 * model_bytes(plain_model), progress=False)[0]
    model, oom = model_with(lambda m: not m.training and m.raised == 0)  # the first evaluation
    torch.manual_seed(SEED)
    result = ht.train([task_for(model, oom, data, eval_data=eval_data, eval_every=2)], devices="cpu",
                      memory_budget=16 * model_bytes(model), progress=False)[0]
    assert result.ok, result.error
    assert oom.raised == 1 and len(result.replans) == 1 and "evaluate" in result.replans[0]
    assert [s for s, _ in result.eval_losses] == [2, 4]
    assert result.eval_losses[0][1] == pytest.approx(plain.eval_losses[0][1], rel=1e-6)
    assert result.losses == pytest.approx(plain.losses, rel=TOLERANCE)


class RunningNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(12)  # over the sequence positions

    def forward(self, x):
        return self.norm(x)


def test_a_step_that_changed_running_statistics_is_not_retried():
    data = token_batches(3)
    model, oom = model_with(lambda m: m.calls == 2 and torch.is_grad_enabled())
    model = nn.Sequential(*list(model)[:3], RunningNorm(), *list(model)[3:])
    torch.manual_seed(SEED)
    task = task_for(model, oom, data, shards=[0, 5])
    with pytest.warns(RuntimeWarning):
        result = ht.train([task], devices="cpu", memory_budget=16 * model_bytes(model), progress=False)[0]
    assert isinstance(result.error, torch.OutOfMemoryError)
    assert any("running_mean" in note or "running_var" in note or "num_batches" in note
               for note in result.error.__notes__), result.error.__notes__


def test_an_exhausted_budget_raises_torch_out_of_memory_error():
    """The engine's own allocation failure is what a device's is, so a task re-plans on either."""
    from hydra_torch import _C

    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    store = _C.ShardStore([list(a.parameters()), list(b.parameters())], ht.optim.AdamW().spec(), False, False)
    engine = _C.DeviceEngine("cpu", _C.DeviceEngine.spilled_need(store))
    model = engine.add_model(store, allow_resident=False)
    engine.acquire(model, 0, with_grads=True)
    with pytest.raises(torch.OutOfMemoryError, match="memory budget exhausted"):
        engine.acquire(model, 1, with_grads=True)  # both shards at once: more than the budget
    engine.release(model, 0)
    engine.finish(model)


def test_two_tasks_re_planned_at_once_on_two_devices_both_finish():
    """Each re-plan waits for the other device's worker to take its part; each worker, waiting, takes the
    other's part meanwhile. Run beside a watchdog: a deadlock fails the test instead of hanging it."""
    data = token_batches(4)
    together = threading.Barrier(2)

    def fail_together(m):  # both tasks' first failures meet here, so that their re-plans overlap
        if m.calls < 2 or len(m.shard) <= 1:  # a shard's first forward holds the CPU generator (task_rng)
            return False
        if m.raised == 0:
            together.wait(timeout=30)
        return True
    pairs = [model_with(fail_together, dropout=0.0) for _ in range(2)]
    refs = [model_with(dropout=0.0)[0] for _ in range(2)]
    for ref in refs:
        train_plain(ref, data, ADAMW[1], seed=SEED)
    torch.manual_seed(SEED)
    tasks = [task_for(model, oom, data, shards=2, name=f"t{i}") for i, (model, oom) in enumerate(pairs)]
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("results", ht.train(
        tasks, devices=["cpu", "cpu"], memory_budget=int(1.5 * model_bytes(pairs[0][0])), progress=False)),
        daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the run hung: two re-plans waited on each other"
    results = outcome["results"]
    for result, (model, _), ref in zip(results, pairs, refs):
        assert result.ok, result.error
        assert len(result.replans) >= 2
        assert max_relative_error(model, ref) <= TOLERANCE


def test_a_re_planned_task_checkpoints_and_resumes_where_it_was(tmp_path):
    """Its checkpoints come from the new plan's state; a later call resumes them in the task's own plan."""
    data = token_batches(8)
    ref, ref_losses = reference(data, accumulate=2)
    model, oom = model_with(lambda m: m.calls == 4)  # step 2's second micro-batch, resident
    torch.manual_seed(SEED)
    with pytest.warns(RuntimeWarning, match="re-planned"):
        first = ht.train([task_for(model, oom, data, accumulate=2, max_steps=3, name="t")], devices="cpu",
                         memory_budget=16 * model_bytes(model), progress=False, checkpoint_dir=tmp_path,
                         checkpoint_every=1)[0]
    assert first.ok and first.steps == 3 and len(first.replans) == 1
    again, again_oom = model_with()  # a fresh model: everything comes from the checkpoint
    torch.manual_seed(SEED)
    second = ht.train([task_for(again, again_oom, data, accumulate=2, name="t")], devices="cpu",
                      memory_budget=16 * model_bytes(again), progress=False, checkpoint_dir=tmp_path)[0]
    assert second.ok and second.steps == 4 and second.resident
    assert second.losses == pytest.approx(ref_losses, rel=TOLERANCE)
    assert max_relative_error(again, ref) <= TOLERANCE
