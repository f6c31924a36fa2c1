"""Re-planned tasks among the others of a run (tests/test_replan.py has the re-plan itself): a task that joined the run,
a resident bf16 task spilled, a re-plan that cannot be made failing only its task, where the shards of a task re-planned
under "auto" and "device" step, and its steps numbered on after it was cut finer."""
import threading

import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.run import measuring
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches
from replan_tasks import ADAMW, SEED, TOLERANCE, model_with, reference, task_for, untied_trainable


def test_a_task_that_joined_the_run_is_re_planned_and_leaves_with_its_weights():
    import queue
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
    measure = measuring.measure_tasks

    def measured_then_armed(*args, **named):
        measure(*args, **named)
        armed.set()
    other = tied_transformer(seed=3, blocks=10)  # built first: building seeds the CPU generator
    torch.manual_seed(SEED)
    tasks = [task_for(model, oom, data, shards=4, name="failing"),
             ht.ModelTask(other, optimizer=ADAMW[0](), loss_fn=lm_loss, data=token_batches(2, seed=5), name="spilled")]
    with testing.emulated_link(1e10), testing.emulated_host(2e6), pytest.warns(RuntimeWarning, match="re-planned"):
        budget = 6 * model_bytes(model) + measuring.kept_beside_arena(tasks, resident=["failing"])
        monkeypatch.setattr(measuring, "measure_tasks", measured_then_armed)  # armed by ht.train's, not the above
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
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
