"""Tasks joining a running ht.train call through Arrivals, and leaving it as soon as they end."""
import contextlib
import queue
import re
import warnings
import threading

import pytest

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.state import task_rng
from hydra_torch.arrivals import Arrivals, RunClosedError
from models import lm_loss, tied_transformer, token_batches

DATA, VALID = token_batches(4), token_batches(1, seed=7)


def task(name, eval_data=VALID, seed=0):
    with task_rng.exclusive():  # building a model draws from the CPU generator the workers share
        return ht.ModelTask(tied_transformer(seed=seed, blocks=1), optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss,
                            data=DATA, eval_data=eval_data, name=name)


def drive(arrivals, body, outcomes):
    """Runs body() on a thread of its own beside the run, then closes `arrivals`: an error it raises lands in
    outcomes["error"], for the test to report, not lost on that thread. Returns the started thread."""
    def driver():
        try:
            body()
        except BaseException as error:
            outcomes["error"] = error
        finally:
            arrivals.close()
    thread = threading.Thread(target=driver)
    thread.start()
    return thread


def test_a_task_joins_when_another_ends_and_a_refused_one_changes_nothing():
    ended, outcomes = queue.SimpleQueue(), {}
    arrivals = Arrivals(on_ended=ended.put)
    late = task("late", seed=1)

    def body():
        outcomes["first ended"] = ended.get(timeout=60).name
        with pytest.raises(ValueError, match="no eval_data"):  # the run's selection cannot judge it
            arrivals.add(task("no-eval", eval_data=None, seed=2))
        with pytest.raises(ValueError, match="already in the run"):
            arrivals.add(task("first"))
        arrivals.add(late)
        outcomes["late ended"] = ended.get(timeout=60).name
    thread = drive(arrivals, body, outcomes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no race on the CPU generator either
        results = ht.train([task("first")], devices=["cpu", "cpu"], progress=False, arrivals=arrivals,
                           selection=ht.SuccessiveHalving(min_steps=2, reduction_factor=2))
    thread.join()
    assert "error" not in outcomes, outcomes.get("error")
    assert outcomes == {"first ended": "first", "late ended": "late"}
    assert [r.name for r in results] == ["first", "late"] and all(r.steps == 4 for r in results)
    assert all(r.error is None for r in results) and len(results["late"].eval_losses) == 2  # rung 2 and the end
    assert all(p.device.type == "cpu" and p.grad is None for p in late.model.parameters())  # weights are home
    with pytest.raises(RunClosedError):
        arrivals.add(task("after"))


def test_arrivals_are_refused_with_checkpoints_or_of_the_wrong_type(tmp_path):
    with pytest.raises(ValueError, match="checkpoint_dir cannot be combined with arrivals"):
        ht.train(task("t"), devices="cpu", arrivals=Arrivals(), checkpoint_dir=tmp_path, progress=False)
    with pytest.raises(TypeError, match="arrivals must be"):
        ht.train(task("t"), devices="cpu", arrivals=object(), progress=False)


def train_or_hang(tasks, arrivals, devices, timeout=120):
    """ht.train on a thread of its own: a run that hangs fails the test instead of holding up the suite."""
    outcome = {}

    def run():
        try:
            outcome["results"] = ht.train(tasks, devices=devices, progress=False, arrivals=arrivals)
        except BaseException as error:
            outcome["error"] = error
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the run hung for {timeout} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results"]


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_on_ended_adds_the_next_task_itself(devices):
    names, ended = ["second", "third"], []

    def on_ended(result):  # keeps one task running: each one's end brings the next
        ended.append(result.name)
        if names:
            arrivals.add(task(names.pop(0), seed=len(ended)))
        else:
            arrivals.close()
    arrivals = Arrivals(on_ended=on_ended)
    results = train_or_hang([task("first")], arrivals, devices)
    assert ended == ["first", "second", "third"]
    assert [r.name for r in results] == ended and all(r.ok and r.steps == 4 for r in results)


@pytest.mark.parametrize("error", [RuntimeError("callback bug"), KeyboardInterrupt()], ids=["Exception", "Ctrl-C"])
@pytest.mark.parametrize("warnings_raise", [False, True], ids=["warned", "a filter that raises"])
def test_an_on_ended_that_raises_is_a_warning_and_the_run_goes_on(error, warnings_raise, capfd):
    # Under a filter that raises (python -W error) the warning ended the callback thread, and the run waited for
    # ever for the callbacks after it: it goes to stderr instead.
    ended = []

    def on_ended(result):
        ended.append(result.name)
        if len(ended) == 2:
            arrivals.close()
        if result.name == "a":
            raise error
    arrivals = Arrivals(on_ended=on_ended)
    a, b = task("a"), task("b", seed=1)
    said = re.escape(f"on_ended raised for task 'a': {error!r}")
    with (warnings.catch_warnings() if warnings_raise else pytest.warns(RuntimeWarning, match=said)):
        if warnings_raise:
            warnings.simplefilter("error")
        results = train_or_hang([a, b], arrivals, ["cpu", "cpu"])
    assert not warnings_raise or re.search("RuntimeWarning: " + said, capfd.readouterr().err)
    assert sorted(ended) == ["a", "b"]
    assert [r.name for r in results] == ["a", "b"] and all(r.ok and r.steps == 4 for r in results)
    assert all(p.device.type == "cpu" and p.grad is None for p in a.model.parameters())  # weights are home


def refused_on_arrival(joiner) -> str:
    """Why `joiner`, added as a first task ends, was refused (ValueError); the run trained the first task alone."""
    outcome = {}

    def on_ended(result):
        try:
            arrivals.add(joiner)
        except ValueError as error:
            outcome["refused"] = str(error)
        finally:
            arrivals.close()
    arrivals = Arrivals(on_ended=on_ended)
    results = train_or_hang([task("first")], arrivals, ["cpu"])
    assert [r.name for r in results] == ["first"]
    return outcome["refused"]


def test_a_task_whose_model_changed_after_it_was_built_is_refused_on_arrival():
    from torch import nn
    changed = task("changed", seed=1)
    changed.model[1] = nn.Identity()  # after the task recorded its layers
    assert "the model changed after its ModelTask was built" in refused_on_arrival(changed)


def planned(name, batch, seed=0, shards="auto"):
    with task_rng.exclusive():
        return ht.ModelTask(tied_transformer(seed=seed, blocks=1, dropout=0.0), loss_fn=lm_loss,
                            data=token_batches(2, batch=batch), shards=shards, name=name)


# A hand-cut task is measured as it joins where the device's memory is its own (here a CPU device on an emulated link).
@pytest.mark.parametrize("shards", ["auto", None], ids=["planned", "cut by hand"])
def test_a_task_that_needs_more_room_beside_the_arena_than_the_run_kept_is_refused_on_arrival(shards):
    """The arena takes what the first tasks' working set and saved inputs leave of the budget: a newcomer whose
    needs beside it are more would pass the budget, so it is refused before any engine holds it; one that needs
    no more joins."""
    ended, outcomes = queue.SimpleQueue(), {}
    arrivals = Arrivals(on_ended=ended.put)

    def body():
        ended.get(timeout=60)
        with pytest.raises(ValueError, match="cannot join the run: one unit's working set"):
            arrivals.add(planned("wide", batch=64, shards=shards))
        arrivals.add(planned("same", batch=8, seed=1, shards=shards))
        outcomes["ended"] = ended.get(timeout=60).name
    thread = drive(arrivals, body, outcomes)
    with testing.emulated_link(1e10):
        results = ht.train([planned("first", batch=8, shards=shards)], devices="cpu", memory_budget="64MiB",
                           progress=False, arrivals=arrivals)
    thread.join()
    assert "error" not in outcomes, outcomes.get("error")
    assert outcomes == {"ended": "same"} and [r.name for r in results] == ["first", "same"]
    assert all(r.ok for r in results)


@pytest.mark.parametrize("emulated", [False, True])
def test_a_task_measured_as_it_joins_leaves_the_running_tasks_random_draws_as_they_were(emulated):
    """A joiner is measured on a batch (planned: shards="auto"; cut by hand: on an emulated link, as on a GPU) while
    the running task's dropout draws from the CPU generator: the measurement holds that generator, and the running
    task draws what it would draw alone."""
    def running(data):
        with task_rng.exclusive():
            return ht.ModelTask(tied_transformer(seed=3, blocks=2), optimizer=ht.optim.AdamW(lr=1e-3),
                                loss_fn=lm_loss, data=data, name="running", shards=None if emulated else "auto")

    class Signalling(list):  # tells the driver once the run is past its first steps
        def __iter__(self):
            for i, batch in enumerate(list.__iter__(self)):
                if i == 3:
                    midway.set()
                yield batch

    link = testing.emulated_link(1e9) if emulated else contextlib.nullcontext()
    midway, outcomes = threading.Event(), {}
    with link:
        alone = ht.train([running(token_batches(12))], devices="cpu", progress=False)["running"]
        arrivals = Arrivals()

        def body():
            midway.wait(timeout=60)
            with task_rng.exclusive():
                joiner = ht.ModelTask(tied_transformer(seed=4, blocks=2), loss_fn=lm_loss,  # fits what it kept
                                      data=token_batches(4, batch=2), name="joiner",
                                      shards=None if emulated else "auto")
            arrivals.add(joiner)
        thread = drive(arrivals, body, outcomes)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nothing drew from the CPU generator without it
            results = ht.train([running(Signalling(token_batches(12)))], devices="cpu", progress=False,
                               arrivals=arrivals)
        thread.join()
    assert "error" not in outcomes, outcomes.get("error")
    assert [r.name for r in results] == ["running", "joiner"] and all(r.ok for r in results)
    assert results["running"].losses == alone.losses


def test_exclusive_held_twice_by_one_thread_is_refused_not_a_hang():
    with task_rng.exclusive():
        with pytest.raises(RuntimeError, match="already held by this thread"):
            with task_rng.exclusive():
                pass
    with task_rng.exclusive():  # let go of, whatever happened inside
        pass


def test_a_task_with_nothing_to_train_is_refused_on_arrival():
    frozen = task("frozen", seed=1)
    frozen.model.requires_grad_(False)
    assert "task 'frozen' has nothing to train" in refused_on_arrival(frozen)


def test_a_task_an_earlier_call_cut_short_is_warned_of_as_it_joins():
    # A run with arrivals keeps no checkpoints: the task trains from the start of its data again, as ht.train warns.
    calls = []

    def stop_at_its_second_step(output, batch):
        calls.append(1)
        if len(calls) == 2:
            again.request_stop("a look at the losses")
        return lm_loss(output, batch)
    with task_rng.exclusive():
        again = ht.ModelTask(tied_transformer(seed=1, blocks=1), loss_fn=stop_at_its_second_step, data=DATA,
                             name="again")
    assert ht.train([again], devices=["cpu"], progress=False)["again"].steps == 2

    def on_ended(result):
        if result.name != "first":
            return
        try:
            arrivals.add(again)
        finally:
            arrivals.close()
    arrivals = Arrivals(on_ended=on_ended)
    with pytest.warns(RuntimeWarning, match=r"task 'again' was cut short after 2 of its 4 steps by an earlier call"):
        results = train_or_hang([task("first")], arrivals, ["cpu"])
    assert [r.name for r in results] == ["first", "again"] and results["again"].steps == 4
