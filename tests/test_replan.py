"""A task whose unit runs out of device memory is re-planned (spilled if it was resident, else cut into smaller
shards) and retried from its last step boundary while the others train on, ending as plain PyTorch training
does. On CPU the failure is injected: a layer that raises torch.OutOfMemoryError as a device allocation in its
shard would."""
import threading

import pytest
import torch
from torch import nn

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.run import lane_choice
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain

SEED = 123
TOLERANCE = 1e-5  # as the equivalence tests: spilled steps run on the host, resident ones as torch.optim's
ADAMW = (lambda: ht.optim.AdamW(lr=3e-3, weight_decay=0.05),
         lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05))


class OutOfMemoryWhen(nn.Module):
    """Passes its input through; raises torch.OutOfMemoryError when `fail(self)` says so (it sees `calls`, this
    call's number from 1, and `shard`, the modules of the shard holding it)."""

    def __init__(self, fail=None):
        super().__init__()
        self.fail = fail
        self.calls = 0
        self.task = None
        self.raised = 0

    @property
    def shard(self):
        return next(group for group in self.task.modules if any(m is self for m in group))

    def forward(self, x):
        self.calls += 1
        if self.fail is not None and self.fail(self):
            self.raised += 1
            raise torch.OutOfMemoryError("injected: the device has no room for this unit")
        return x


def model_with(fail=None, dropout=0.1, blocks=4):
    """tied_transformer's layers with the failing layer after the second block."""
    base = tied_transformer(seed=0, blocks=blocks, dropout=dropout)
    layers = list(base)
    oom = OutOfMemoryWhen(fail)
    return nn.Sequential(*layers[:3], oom, *layers[3:]), oom


def reference(data, accumulate=1, blocks=4):
    model, _ = model_with(blocks=blocks)
    losses = train_plain(model, data, ADAMW[1], accumulate=accumulate, seed=SEED)
    return model, losses


def untied_trainable(task, model) -> list[int]:
    """The task's shards that hold neither end of the tied embedding and head, and have weights to train."""
    return [s for s, group in enumerate(task.modules) if model[0] not in group and model[-1] not in group
            and any(p.requires_grad for m in group for p in m.parameters())]


def task_for(model, oom, data, **options):
    task = ht.ModelTask(model, optimizer=ADAMW[0](), loss_fn=lm_loss, data=data, **options)
    oom.task = task
    return task


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
    import threading

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


def test_a_task_that_joined_the_run_is_re_planned_and_leaves_with_its_weights():
    import queue
    import threading

    from hydra_torch.arrivals import Arrivals

    data = token_batches(4)
    ref, _ = reference(data)
    ended, outcome = queue.SimpleQueue(), {}
    arrivals = Arrivals(on_ended=ended.put)
    first = ht.ModelTask(tied_transformer(seed=3, blocks=2), optimizer=ADAMW[0](), loss_fn=lm_loss,
                         data=token_batches(6), name="first")

    model, oom = model_with(lambda m: len(m.shard) > 2)

    def driver():
        try:
            # Its random streams start where the run's did: the same as the reference's, seeded alike.
            arrivals.add(task_for(model, oom, data, shards=2, name="joined"))
            outcome["ended"] = sorted([ended.get(timeout=60).name, ended.get(timeout=60).name])
        except BaseException as error:
            outcome["error"] = error
        finally:
            arrivals.close()
    thread = threading.Thread(target=driver)
    torch.manual_seed(SEED)
    thread.start()
    with pytest.warns(RuntimeWarning, match="re-planned"):
        results = ht.train([first], devices=["cpu", "cpu"], memory_budget=int(1.5 * model_bytes(ref)),
                           progress=False, arrivals=arrivals)
    thread.join()
    assert "error" not in outcome, outcome["error"]
    assert outcome["ended"] == ["first", "joined"]
    joined = results["joined"]
    assert joined.ok and joined.steps == 4 and joined.replans
    assert all(p.device.type == "cpu" and p.grad is None for p in model.parameters())
    assert max_relative_error(model, ref) <= TOLERANCE


def test_a_resident_bf16_task_spilled_trains_on_from_its_current_weights():
    data = token_batches(6)
    plain_model, plain_oom = model_with(dropout=0.0)
    torch.manual_seed(SEED)
    plain = ht.train([task_for(plain_model, plain_oom, data, precision="bf16")], devices="cpu",
                     memory_budget=16 * model_bytes(plain_model), progress=False)[0]
    model, oom = model_with(lambda m: m.calls == 4, dropout=0.0)  # step 4's forward
    torch.manual_seed(SEED)
    with pytest.warns(RuntimeWarning, match="re-planned"):
        result = ht.train([task_for(model, oom, data, precision="bf16")], devices="cpu",
                          memory_budget=16 * model_bytes(model), progress=False)[0]
    assert result.ok and plain.resident and not result.resident
    assert result.losses[:3] == plain.losses[:3]
    # Spilled, it computes from the bf16 copy of the same weights: resident and spilled bf16 round alike.
    assert result.losses[3:] == pytest.approx(plain.losses[3:], rel=1e-2)


@pytest.mark.parametrize("where", ["host memory", "store"])
def test_a_re_plan_that_cannot_be_made_fails_only_its_task(monkeypatch, where):
    """A re-cut refused for host memory, or a re-plan that raises half-way (its state already off the
    devices): the task stops with its out-of-memory error and a note, its weights home; the other finishes."""
    from hydra_torch.models import memory
    from hydra_torch.run import lifecycle

    if where == "host memory":
        checks = []

        def refuse(tasks):  # ht.train's own check passes; the re-plan's is refused
            checks.append(tasks)
            if len(checks) > 1:
                raise MemoryError("the host has 1 byte available")
        monkeypatch.setattr(memory, "check_host_memory", refuse)
    else:
        real = lifecycle.make_store

        def broken(runner, pin):  # placement makes the store; the re-plan's new one fails
            if runner.task.name == "failing" and runner.store is not None:
                raise RuntimeError("no store today")
            return real(runner, pin)
        monkeypatch.setattr(lifecycle, "make_store", broken)
    data = token_batches(4)
    model, oom = model_with(lambda m: m.calls == 3)
    other = tied_transformer(seed=3, blocks=2)
    torch.manual_seed(SEED)
    tasks = [task_for(model, oom, data, shards=2, name="failing"),
             ht.ModelTask(other, optimizer=ADAMW[0](), loss_fn=lm_loss, data=data, name="other")]
    with pytest.warns(RuntimeWarning, match="failing"):
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(1.5 * model_bytes(model)),
                           progress=False)
    failing = results["failing"]
    assert isinstance(failing.error, torch.OutOfMemoryError) and failing.replans == []
    expected = "would not fit in host memory" if where == "host memory" else "the re-plan failed"
    assert any(expected in note for note in failing.error.__notes__), failing.error.__notes__
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert results["other"].ok and results["other"].steps == 4


@pytest.mark.parametrize("placement, on_the_host_first, had", [
    ("auto", False, "spilled in 4 shards, shards 0, 3 resident"),
    ("device", False, "spilled in 4 shards, shards 0, 3 resident, shards 1, 2 stepped on the device"),
    ("device", True, "spilled in 4 shards)"),
], ids=["resident ends", "device steps", "every step on the host"])
def test_a_spilled_task_out_of_memory_is_cut_finer_and_placed_by_what_it_kept_on_the_device(
        placement, on_the_host_first, had, monkeypatch):
    """A task that kept shards resident or stepped them on the device may have run short of that room: cut finer, it
    steps every shard on the host. One that stepped every shard on the host ("device" here, with
    lifecycle.may_keep_ends saying no as the call starts) is placed as a task joining the run would be: every untied
    shard with weights on the device (the layer that fails has none)."""
    from hydra_torch.run import lifecycle
    asked = []

    def not_as_the_call_starts(task):
        asked.append(task.name)
        return len(asked) > 1
    if on_the_host_first:
        monkeypatch.setattr(lifecycle, "may_keep_ends", not_as_the_call_starts)
    data = token_batches(6)
    ref, ref_losses = reference(data)
    model, oom = model_with(lambda m: len(m.shard) > 1)
    torch.manual_seed(SEED)
    task = task_for(model, oom, data, shards=4)
    with pytest.warns(RuntimeWarning, match="re-planned 1 time"):
        result = ht.train([task], devices="cpu", memory_budget=4 * model_bytes(model), progress=False,
                          placement=placement)[0]
    assert result.ok, result.error
    assert len(result.replans) == 1 and had in result.replans[0], result.replans
    assert len(asked) == (2 if on_the_host_first else 0)
    stepped = untied_trainable(task, model) if on_the_host_first else []
    assert result.resident_shards == [] and result.device_shards == stepped and task.num_shards > 4
    assert result.losses == pytest.approx(ref_losses, rel=TOLERANCE)
    assert max_relative_error(model, ref) <= TOLERANCE
    assert model[0].weight is model[-1].weight


def test_a_resident_task_spilled_under_auto_steps_shards_on_the_device_where_the_host_binds(monkeypatch):
    """Spilled, it is placed as a task joining the run would be (lane_choice.added_device_shards), from the lanes the
    call measured for the task it spilled as it started: the host, a second a step, binds, and the lane model takes
    steps off it; it trains on as plain PyTorch."""
    data = token_batches(6)
    ref, ref_losses = reference(data)
    armed = threading.Event()  # the layer fails once, after the lane model's measurement of the task
    model, oom = model_with(lambda m: armed.is_set() and m.raised == 0)
    measure = lane_choice.measure_tasks

    def measured_then_armed(*args):
        measure(*args)
        armed.set()
    monkeypatch.setattr(lane_choice, "measure_tasks", measured_then_armed)
    other = tied_transformer(seed=3, blocks=10)  # built first: building seeds the CPU generator
    torch.manual_seed(SEED)
    tasks = [task_for(model, oom, data, shards=4, name="failing"),
             ht.ModelTask(other, optimizer=ADAMW[0](), loss_fn=lm_loss, data=token_batches(2, seed=5), name="spilled")]
    with testing.emulated_link(1e10), testing.emulated_host(2e6), pytest.warns(RuntimeWarning, match="re-planned"):
        results = ht.train(tasks, devices="cpu", memory_budget=6 * model_bytes(model), progress=False)
    assert results.lane_plan is not None and results["spilled"].device_shards, results["spilled"].placement
    result = results["failing"]
    assert result.ok, result.error
    assert len(result.replans) == 1 and "resident" in result.replans[0] and oom.raised == 1, result.replans
    assert not result.resident and tasks[0].num_shards == 4
    assert result.device_shards and set(result.device_shards) <= set(untied_trainable(tasks[0], model)), \
        result.placement
    # It failed in its first step's forward: every step it took was spilled.
    stepped = [e for e in results.steps if e.task_name == "failing" and e.shard in result.device_shards]
    assert [e.place for e in stepped] == ["device"] * len(result.device_shards) * 6
    assert result.losses == pytest.approx(ref_losses, rel=TOLERANCE)
    assert max_relative_error(model, ref) <= TOLERANCE
    assert model[0].weight is model[-1].weight


def test_a_task_cut_finer_after_some_steps_numbers_its_steps_on():
    """Results.steps numbers a re-planned task's steps on from where its old cut left off (the new store carries
    the count), each step once per shard of the cut that took it."""
    data = token_batches(6)
    model, oom = model_with(lambda m: m.calls > 4 and len(m.shard) > 1)  # from step 2 or 3, until cut finer
    torch.manual_seed(SEED)
    task = task_for(model, oom, data, shards=2)
    with pytest.warns(RuntimeWarning, match="re-planned"):
        results = ht.train([task], devices="cpu", memory_budget=int(1.5 * model_bytes(model)), progress=False,
                           placement="host")
    result = results[0]
    assert result.ok and result.steps == 6 and result.replans and oom.raised >= 1
    steps = [e for e in results.steps if e.task_name == task.name]
    by_step = {k: sorted(e.shard for e in steps if e.step == k) for k in range(1, 7)}
    assert sorted({e.step for e in steps}) == list(range(1, 7))
    assert all(shards == list(range(len(shards))) for shards in by_step.values()), by_step
    assert len(by_step[1]) == 2 and len(by_step[6]) == task.num_shards > 2
