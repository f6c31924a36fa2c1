"""Several models in one ht.train call, on several (virtual CPU) devices: same results as alone."""
import _thread
import os
import signal
import threading

import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.run import measuring
from models import lm_loss, model_bytes, tied_transformer, token_batches

LEARNING_RATES = [1e-3, 3e-3, 1e-2, 3e-2]


def make_tasks(data, fail_task=None, seeds=(0, 1, 2, 3), **options):
    tasks, models = [], []
    for i, (lr, seed) in enumerate(zip(LEARNING_RATES, seeds)):
        model = tied_transformer(seed=seed, dropout=0.0)
        loss_fn = lm_loss
        if i == fail_task:
            def loss_fn(out, batch, calls=[0]):
                calls[0] += 1
                if calls[0] == 3:
                    raise RuntimeError("boom in loss_fn")
                return lm_loss(out, batch)
        tasks.append(ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=lr), loss_fn=loss_fn, data=data,
                                  name=f"lr{lr:g}", **options))
        models.append(model)
    return tasks, models


def train_alone(data, index, budget, **options):
    """The same model trained by itself on one device with one thread, as each virtual device has."""
    model = tied_transformer(seed=index, dropout=0.0)
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=LEARNING_RATES[index]), loss_fn=lm_loss, data=data,
                        **options)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = ht.train([task], devices="cpu", memory_budget=budget, progress=False)[0]
    finally:
        torch.set_num_threads(threads)
    return model, result


def check_trace(results):
    by_task, by_device = {}, {}
    for e in results.trace:
        by_task.setdefault(e.task, []).append(e)
        by_device.setdefault(e.device, []).append(e)
    for entries in by_task.values():
        entries.sort(key=lambda e: e.start)
        assert [e.unit for e in entries] == list(range(len(entries))), "a task's units run in order, each once"
        for a, b in zip(entries, entries[1:]):
            assert a.end <= b.start, "a task never runs two units at once"
    for entries in by_device.values():
        entries.sort(key=lambda e: e.start)
        for a, b in zip(entries, entries[1:]):
            assert a.end <= b.start, "a device runs one unit at a time"
    return by_task, by_device


@pytest.mark.parametrize("schedule", ["lrtf", "fifo", "round_robin", "random"])
def test_three_models_on_two_devices_match_training_alone(schedule):
    """Each model, whichever devices its units ran on, ends exactly as it does trained alone. The comparison
    means most where a task moved between devices part way, which the schedule allows but timing decides: two
    devices in lock step under FIFO kept each of four tasks on one device (A C A C | B D B D, under
    ThreadSanitizer). Three tasks rotate over two devices in lock step (A C B | B A C), and the run is repeated,
    each run checked in full, until one has moved a task (three runs at most)."""
    data = token_batches(6)
    budget = int(0.45 * model_bytes(tied_transformer()))
    seeds = (0, 1, 2)
    alone = [train_alone(data, i, budget, accumulate=2) for i in seeds]
    moved_in = []
    for _ in range(3):
        tasks, models = make_tasks(data, seeds=seeds, accumulate=2)
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, schedule=schedule, progress=False)
        by_task, by_device = check_trace(results)
        assert len(by_device) == 2, "both devices ran units"
        for i, (model, result, (alone_model, alone_result)) in enumerate(zip(models, results, alone)):
            assert result.error is None and not result.resident and result.steps == 3
            assert result.losses == alone_result.losses
            for a, b in zip(model.parameters(), alone_model.parameters()):
                assert torch.equal(a, b), f"task {i} differs from training alone"
            assert model[0].weight is model[-1].weight
        for stats in results.stats:
            assert stats["high_water_bytes"] <= budget
        moved_in.append(sum(len(set(e.device for e in entries)) > 1 for entries in by_task.values()))
        if moved_in[-1]:
            break
    assert moved_in[-1] >= 1, f"with spilled models, tasks move between devices (tasks moved, by run: {moved_in})"


@pytest.mark.parametrize("host_threads", [1, 3])
def test_on_an_emulated_link_four_models_match_training_alone(host_threads):
    """The asynchronous path with copies that take time (a slow link), host steps on several threads: copies
    and steps of different models overlap, and each model's result is still exactly its result alone."""
    data = token_batches(4)
    tasks, models = make_tasks(data)
    bandwidth = 2e7  # bytes/s: a shard's copy takes a few ms, as long as its compute here
    with testing.emulated_link(bandwidth):
        # The arena as 0.45 of a model's weights: beside it the budget keeps the tasks' working set and saved inputs.
        budget = int(0.45 * model_bytes(tied_transformer())) + measuring.kept_beside_arena(tasks)
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, progress=False,
                           host_threads=host_threads)
    check_trace(results)
    for stats in results.stats:
        assert stats["high_water_bytes"] <= budget
        assert stats["weight_copy_seconds"] >= stats["host_to_device_bytes"] / bandwidth * 0.999
        assert stats["grad_copy_seconds"] >= stats["device_to_host_bytes"] / bandwidth * 0.999
    for i, (model, result) in enumerate(zip(models, results)):
        assert result.error is None and not result.resident and result.steps == 4
        alone, alone_result = train_alone(data, i, budget)
        assert result.losses == alone_result.losses
        for a, b in zip(model.parameters(), alone.parameters()):
            assert torch.equal(a, b), f"task {i} differs from training alone"


def test_emulated_link_and_host_threads_reject_bad_values():
    for bad in (0, -1.0, float("nan"), float("inf"), "fast", True):
        with pytest.raises(ValueError, match="bytes_per_second"):
            with testing.emulated_link(bad):
                pass
    assert testing.link_bytes_per_second() == 0.0
    tasks, _ = make_tasks(token_batches(1))
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match="host_threads"):
            ht.train(tasks, devices="cpu", progress=False, host_threads=bad)


def test_one_failing_task_does_not_disturb_the_others():
    data = token_batches(4)
    budget = int(0.45 * model_bytes(tied_transformer()))
    tasks, models = make_tasks(data, fail_task=1)
    with pytest.warns(RuntimeWarning, match="boom in loss_fn"):
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, progress=False)
    check_trace(results)
    assert isinstance(results[1].error, RuntimeError) and results[1].steps == 2
    for i in (0, 2, 3):
        assert results[i].error is None and results[i].steps == 4
        alone, _ = train_alone(data, i, budget)
        assert all(torch.equal(a, b) for a, b in zip(models[i].parameters(), alone.parameters()))
    failed_alone, _ = train_alone(data[:2], 1, budget)
    assert all(torch.equal(a, b) for a, b in zip(models[1].parameters(), failed_alone.parameters())), \
        "the failed task keeps the weights of its last good step"
    assert results.best is not None and results.best.name != "lr0.003"


def test_resident_models_spread_over_devices():
    data = token_batches(3)
    tasks, models = make_tasks(data)
    results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=200 * model_bytes(models[0]), progress=False)
    by_task, _ = check_trace(results)
    assert all(r.resident and r.shard_loads == [1] * len(r.shard_loads) for r in results)
    assert all(len({e.device for e in entries}) == 1 for entries in by_task.values()), "resident tasks stay home"
    assert {entries[0].device for entries in by_task.values()} == {0, 1}
    for i, model in enumerate(models):
        alone, _ = train_alone(data, i, 200 * model_bytes(models[0]))
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), alone.parameters()))


def ctrl_c_at_call(*calls_to_interrupt, signum=signal.SIGINT):
    """The LM loss, sending `signum` (Ctrl-C by default) to the process at the given calls."""
    calls = [0]

    def interrupting_loss(out, batch):
        calls[0] += 1
        if calls[0] in calls_to_interrupt:
            if signum == signal.SIGINT:
                _thread.interrupt_main()
            else:
                os.kill(os.getpid(), signum)
        return lm_loss(out, batch)
    return interrupting_loss


def check_home(models):
    """Every model is back on host storage of its own, no gradients bound, ties intact."""
    pointers = set()
    for model in models:
        assert model[0].weight is model[-1].weight
        for p in set(model.parameters()):
            assert p.device.type == "cpu" and p.grad is None and torch.isfinite(p).all()
            assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), "a view into shared memory"
            assert p.data_ptr() not in pointers
            pointers.add(p.data_ptr())


@pytest.mark.parametrize("clip", [None, 1.0])
def test_ctrl_c_stops_every_task_at_a_step_boundary_and_returns_the_results(clip):
    """Mid-step when Ctrl-C comes, each task finishes its step on every shard; each ends as if trained alone
    for the steps it took (clipped: counting the step whose norm was still being summed)."""
    data = token_batches(40)
    budget = int(0.45 * model_bytes(tied_transformer()))
    tasks, models = make_tasks(data, accumulate=2, clip_grad_norm=clip)
    tasks[0].loss_fn = ctrl_c_at_call(5)  # step 3's first micro-batch: the step must still complete
    before = threading.active_count()
    with pytest.warns(RuntimeWarning, match="stopped by Ctrl-C at step boundaries; 4 of 4 tasks cut short"):
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, progress=False)
    assert threading.active_count() == before, "every worker thread joined"
    assert results.interrupted == "Ctrl-C"
    check_home(models)
    assert results[0].steps >= 3
    for i, (model, result) in enumerate(zip(models, results)):
        assert result.ok and result.cut_short == "Ctrl-C" and result.steps < 20
        assert len(result.losses) == result.steps
        alone, alone_result = train_alone(data, i, budget, accumulate=2, max_steps=result.steps, clip_grad_norm=clip)
        assert result.losses == alone_result.losses
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), alone.parameters())), \
            f"task {i} is not where {result.steps} whole steps take it"
    assert "cut short by Ctrl-C" in results.summary()


def test_a_second_ctrl_c_stops_at_once_and_still_brings_every_model_home():
    data = token_batches(40)
    tasks, models = make_tasks(data, accumulate=2)
    tasks[0].loss_fn = ctrl_c_at_call(5, 6)  # the second comes while task 0 finishes its step
    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(0.45 * model_bytes(models[0])), progress=False)
    assert threading.active_count() == before, "every worker thread joined"
    check_home(models)


def test_sigterm_stops_at_step_boundaries_then_reaches_the_previous_handler():
    data = token_batches(40)
    tasks, models = make_tasks(data)
    tasks[1].loss_fn = ctrl_c_at_call(4, signum=signal.SIGTERM)
    seen = []

    def previous_handler(signum, frame):  # a job system's own handler: it runs once the weights are home
        seen.append((signum, models[0][0].weight.grad is None))

    original = signal.signal(signal.SIGTERM, previous_handler)
    try:
        with pytest.warns(RuntimeWarning, match="stopped by SIGTERM"):
            results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(0.45 * model_bytes(models[0])),
                               progress=False)
    finally:
        signal.signal(signal.SIGTERM, original)
    assert seen == [(signal.SIGTERM, True)]
    assert results.interrupted == "SIGTERM" and all(r.cut_short == "SIGTERM" for r in results)
    check_home(models)


class FailingBackward(torch.autograd.Function):
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        FailingBackward.calls += 1
        if FailingBackward.calls == 3:
            raise RuntimeError("boom in backward")
        return grad


class RaisesInBackward(torch.nn.Module):
    def forward(self, x):
        return FailingBackward.apply(x)


def test_a_failure_inside_a_backward_says_which_shards_took_the_step():
    FailingBackward.calls = 0
    model = tied_transformer(dropout=0.0)
    model.insert(3, RaisesInBackward())
    modules = list(model)
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=token_batches(6),
                        shards=[modules[:2], modules[2:4], modules[4:5], modules[5:6], modules[6:]])
    with pytest.warns(RuntimeWarning, match="boom in backward"):
        result = ht.train([task], devices="cpu", memory_budget=int(0.45 * model_bytes(model)), progress=False)[0]
    assert result.steps == 2 and "boom in backward" in str(result.error)
    assert any("applied to shards [2, 3, 4] only" in note for note in result.error.__notes__)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_a_second_ctrl_c_during_the_write_back_waits_for_it(monkeypatch, devices):
    """Ctrl-C twice: the second arrives while the first model's weights are being written back (on one device, as
    the task leaves the engine on the main thread, its worker's). Every model must still come home: parameters on
    host storage of their own, no gradients bound, ties intact."""
    from hydra_torch.run.runner import TaskRunner
    data = token_batches(40)
    restore = TaskRunner.restore_buffers
    second = []

    def interrupt_again(runner):  # runs on the main thread, in the write-back
        if not second:
            second.append(runner.task.name)
            signal.raise_signal(signal.SIGINT)
        restore(runner)

    monkeypatch.setattr(TaskRunner, "restore_buffers", interrupt_again)
    tasks, models = make_tasks(data)
    tasks[0].loss_fn = ctrl_c_at_call(5)
    # The held Ctrl-C goes to the handler that was there before ht.train: make it Python's, which raises
    # KeyboardInterrupt. A process started with SIGINT ignored (a background job) has SIG_IGN there, and
    # then the held Ctrl-C is rightly ignored too.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            ht.train(tasks, devices=devices, memory_budget=int(0.45 * model_bytes(models[0])), progress=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert second, "the second Ctrl-C was sent during the write-back"
    check_home(models)


def test_schedule_chart_and_summary(tmp_path):
    pytest.importorskip("matplotlib")
    data = token_batches(2)
    tasks, _ = make_tasks(data)
    results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(0.45 * model_bytes(tied_transformer())),
                       progress=False)
    path = tmp_path / "schedule.png"
    results.plot_schedule(path)
    assert path.stat().st_size > 1000
    utilisation = results.utilisation()
    assert set(utilisation) == {"cpu[0]", "cpu[1]"}
    assert all(0.0 < u <= 1.0 for u in utilisation.values())
    assert "best:" in results.summary()


def test_a_resident_task_never_leaves_a_later_one_without_room():
    """The first model would fit resident, but then the second's largest shard would not: both spill."""
    small = tied_transformer(seed=0, blocks=1, dropout=0.0)
    large = torch.nn.Sequential(torch.nn.Embedding(48, 32), torch.nn.Linear(32, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 32), torch.nn.Linear(32, 48))
    data = token_batches(2)
    tasks = [ht.ModelTask(small, loss_fn=lm_loss, data=data, name="small"),
             ht.ModelTask(large, loss_fn=lm_loss, data=data, name="large")]
    stores = [ht._C.ShardStore(t.shard_params, t.optimizer.spec(), False, False) for t in tasks]
    resident = ht._C.DeviceEngine.resident_need(stores[0])
    spilled = ht._C.DeviceEngine.spilled_need(stores[1])
    budget = max(resident, spilled) + 4096
    assert resident + spilled > budget, "small resident would leave large no room"
    results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    assert all(r.ok and r.steps == 2 for r in results)
    assert not results["small"].resident and not results["large"].resident
    assert results.stats[0]["high_water_bytes"] <= budget
