"""A task joining a running call steps on the device the shards its placement asks (the lane model's choice for
"auto", from the lanes the call measured as it started; every untied shard for "device"), with the tasks already
training kept where they are, and trains as it would alone."""
import queue
import threading

import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.arrivals import Arrivals
from hydra_torch.run import measuring
from hydra_torch.state import task_rng
from models import lm_loss, model_bytes, tied_transformer, token_batches

DATA = token_batches(4)
# The host steps a model's ~1.8 MB a step at 2 MB/s, a second a step against milliseconds of compute: the lane model
# takes the steps it can off the host.
LINK, HOST = 1e10, 2e6


def task(name, seed, accumulate=1, data=DATA):
    with task_rng.exclusive():  # building a model draws from the CPU generator the workers share
        return ht.ModelTask(tied_transformer(seed=seed), optimizer=ht.optim.AdamW(lr=3e-3, weight_decay=0.05),
                            loss_fn=lm_loss, data=data, accumulate=accumulate, name=name)


def train_with_a_late_task(placement, accumulate=1, devices="cpu", late_data=DATA, first_data=DATA,
                           once_first_left=False):
    """"first" trains, "late" joins as soon as the run is open (while "first" trains), or `once_first_left`; the
    results and late's model."""
    first = task("first", seed=0, data=first_data)
    late = task("late", seed=1, accumulate=accumulate, data=late_data)
    left = threading.Event()
    arrivals, outcome = Arrivals(on_ended=lambda result: left.set()), queue.SimpleQueue()

    def driver():
        try:
            if once_first_left:
                left.wait(timeout=60)
            arrivals.add(late)
        except BaseException as error:  # reported below, not lost on this thread
            outcome.put(error)
        finally:
            arrivals.close()
    thread = threading.Thread(target=driver)
    thread.start()
    with testing.emulated_link(LINK), testing.emulated_host(HOST):
        budget = int(4 * model_bytes(first.model)) + measuring.kept_beside_arena([first])  # the arena as four models
        results = ht.train([first], devices=devices, memory_budget=budget, progress=False, placement=placement,
                           arrivals=arrivals)
    thread.join(timeout=120)
    assert outcome.empty(), outcome.get()
    assert [r.name for r in results] == ["first", "late"] and all(r.ok for r in results), [r.error for r in results]
    return results, late.model


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_a_task_joining_an_auto_run_steps_shards_on_the_device_and_trains_as_alone(devices):
    # On two devices as on one: the host, a second a step, binds the run; each of "late"'s backwards is followed by
    # its step, so its shards may step on whichever device ran the backward.
    results, joined = train_with_a_late_task("auto", devices=devices)
    late = results["late"]
    untied = set(range(1, 7))  # shards 0 and 7 share the tied embedding and head
    assert late.device_shards and set(late.device_shards) <= untied, late.placement
    assert "stepped on the device" in late.placement
    assert sum(stats["device_steps"] for stats in results.stats) == sum(len(r.device_shards) * r.steps
                                                                         for r in results)
    # Alone, every shard stepped on the host, from where the generator stood as the run began (just after "late"'s
    # model was built): the same steps.
    alone = task("alone", seed=1)
    reference = ht.train(alone, devices=devices, progress=False, placement="host")[0]
    assert late.losses == pytest.approx(reference.losses, rel=1e-5)
    for a, b in zip(joined.parameters(), alone.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("placement, accumulate", [("host", 1), ("auto", 2)],
                         ids=["host", "auto summing micro-batches"])
def test_a_task_joining_steps_every_shard_on_the_host_where_its_placement_or_its_steps_ask(placement, accumulate):
    # Summing micro-batches, a device-stepped shard would hold a gradient buffer, which a sized arena does not take.
    results, _ = train_with_a_late_task(placement, accumulate)
    assert results["late"].device_shards == []
    assert results["late"].placement == "spilled"


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_a_task_joining_a_device_run_steps_every_untied_shard_on_the_device(devices):
    results, _ = train_with_a_late_task("device", devices=devices)
    assert results["late"].device_shards == list(range(1, 7))


def test_a_task_joining_two_devices_asks_the_lane_model_only_where_the_host_binds(monkeypatch):
    # On several devices "auto" asks the lane model only where the host lane bounds the placement with the newcomer's
    # steps all on the host (lane_choice._host_binds), as it does for the tasks it places as the call starts: here the
    # host binds as the call starts, and the gate says it does not once "late" joins.
    from hydra_torch.run import lane_choice
    asked, host_binds = [], lane_choice._host_binds

    def binds_at_the_start_only(shapes, rates, bytes_, devices, start):
        asked.append((len(shapes), devices))
        return host_binds(shapes, rates, bytes_, devices, start) if len(asked) == 1 else False
    monkeypatch.setattr(lane_choice, "_host_binds", binds_at_the_start_only)
    results, _ = train_with_a_late_task("auto", devices=["cpu", "cpu"])
    # "first" alone as the call starts; then "first" and "late" (and "first" alone again, placed again, where "late"
    # leaves first).
    assert asked[:2] == [(1, 2), (2, 2)] and asked[2:] in ([], [(1, 2)]), asked
    assert results["first"].device_shards and results["late"].device_shards == []


def test_a_lane_model_that_fails_for_a_joining_task_warns_and_its_steps_stay_on_the_host(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("no forecast")
    from hydra_torch.run import lane_choice
    # Asked as "late" joins, and again once "first" has left.
    monkeypatch.setattr(lane_choice, "added_device_shards", fails)
    with pytest.warns(RuntimeWarning, match="could not ask the lane model for 'late'.*no forecast"):
        results, _ = train_with_a_late_task("auto")
    assert results["late"].device_shards == []


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_a_task_joining_whose_steps_the_engine_refuses_steps_every_shard_on_the_host(devices, monkeypatch):
    # The engine has the last word: asked for shards it cannot step on the device (here the tied embedding's), it
    # refuses them, and the task is added with every step on the host on every device alike, and trains as alone.
    from hydra_torch.run import lane_choice
    monkeypatch.setattr(lane_choice, "added_device_shards", lambda *args: [0, 1])
    results, joined = train_with_a_late_task("auto", devices=devices)
    late = results["late"]
    assert late.device_shards == [] and late.placement == "spilled"
    assert sum(stats["device_steps"] for stats in results.stats) == len(results["first"].device_shards) * 4
    alone = task("alone", seed=1)
    reference = ht.train(alone, devices=devices, progress=False, placement="host")[0]
    assert late.losses == pytest.approx(reference.losses, rel=1e-5)
    for a, b in zip(joined.parameters(), alone.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_a_task_still_training_is_placed_again_once_another_leaves_and_trains_on_as_alone(devices, monkeypatch):
    # "late" joins with every step on the host (the lane model asked as it joins is told to keep it there); once
    # "first" has left, at late's next step boundary, the lane model is asked again, and it steps shards on the
    # device from then on. Its state is home in the store between steps: it trains on as it would have alone.
    from hydra_torch.run import lane_choice
    choose, asked = lane_choice.added_device_shards, []

    def on_the_host_as_it_joins(newcomer, store, running, *args):
        asked.append([r.task.name for r in running])
        return [] if len(asked) == 1 else choose(newcomer, store, running, *args)
    monkeypatch.setattr(lane_choice, "added_device_shards", on_the_host_as_it_joins)
    # "first" trains long enough for "late" to join beside it (its pieces are measured as it joins).
    results, joined = train_with_a_late_task("auto", devices=devices, late_data=token_batches(10),
                                             first_data=token_batches(8))
    late = results["late"]
    assert asked == [["first"], []], asked  # as it joined, beside "first"; then alone
    assert late.device_shards and set(late.device_shards) <= set(range(1, 7)), late.placement
    places = [(e.step, e.place) for e in results.steps if e.task_name == "late" and e.shard == late.device_shards[0]]
    switched = next(step for step, place in places if place == "device")
    assert switched > 1 and places == [(k, "host" if k < switched else "device") for k in range(1, 11)], places
    alone = task("alone", seed=1, data=token_batches(10))
    reference = ht.train(alone, devices=devices, progress=False, placement="host")[0]
    assert late.losses == pytest.approx(reference.losses, rel=1e-5)
    for a, b in zip(joined.parameters(), alone.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_task_placed_as_the_run_started_keeps_its_resident_ends_when_another_leaves():
    # "first" keeps shards resident (homes, which a sized arena does not take again): it is not moved once "late"
    # leaves (late's one step ends long before first's twelve).
    results, _ = train_with_a_late_task("auto", late_data=token_batches(1), first_data=token_batches(12))
    kept = results["first"]
    assert not kept.resident and kept.resident_shards, kept.placement
    assert max(e.end for e in results.trace if e.task_name == "late") < \
        max(e.end for e in results.trace if e.task_name == "first")
    places = {e.place for e in results.steps if e.task_name == "first" and e.shard == kept.resident_shards[0]}
    assert places == {"resident"}


def test_a_task_that_cannot_be_added_back_once_moved_ends_with_the_reason_and_its_weights_home(monkeypatch):
    # Placing "late" again once "first" has left takes it off the engine and adds it back; where no engine takes it
    # back it ends there with that reason, its weights those of its last step (written back as it was taken off).
    from hydra_torch.run import lane_choice, moving
    choose, asked = lane_choice.added_device_shards, []

    def on_the_host_as_it_joins(newcomer, store, running, *args):
        asked.append(len(running))
        return [] if len(asked) == 1 else choose(newcomer, store, running, *args)
    monkeypatch.setattr(lane_choice, "added_device_shards", on_the_host_as_it_joins)
    monkeypatch.setattr(moving, "put_back", lambda *args, **kwargs: "no device can take it (injected)")
    # "first" trains long enough for "late" to join beside it (its pieces are measured as it joins).
    first, late = task("first", seed=0, data=token_batches(8)), task("late", seed=1, data=token_batches(10))
    arrivals = Arrivals(on_ended=lambda result: None)
    thread = threading.Thread(target=lambda: (arrivals.add(late), arrivals.close()))
    thread.start()
    with testing.emulated_link(LINK), testing.emulated_host(HOST), pytest.warns(RuntimeWarning, match="late"):
        budget = int(4 * model_bytes(first.model)) + measuring.kept_beside_arena([first])
        results = ht.train([first], devices="cpu", memory_budget=budget, progress=False, arrivals=arrivals)
    thread.join(timeout=120)
    moved = results["late"]
    assert results["first"].ok and not moved.ok
    assert "could not be placed again after a task left the run: no device can take it (injected)" in str(moved.error)
    assert 0 < moved.steps < 10
    # Its model holds the weights of its last step: a plain run of as many steps from the same start ends there.
    alone = task("alone", seed=1, data=token_batches(10)[:moved.steps])
    ht.train(alone, devices="cpu", progress=False, placement="host")
    for a, b in zip(late.model.parameters(), alone.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_task_joining_after_another_left_is_placed_once(monkeypatch):
    # "late" joins once "first" has left: it is placed beside the tasks training then, and not asked again at its
    # first step boundary for a departure that came before it.
    from hydra_torch.run import lane_choice
    choose, asked = lane_choice.added_device_shards, []

    def counted(newcomer, *args):
        asked.append(newcomer.task.name)
        return choose(newcomer, *args)
    monkeypatch.setattr(lane_choice, "added_device_shards", counted)
    results, _ = train_with_a_late_task("auto", first_data=token_batches(1), once_first_left=True)
    assert results["late"].device_shards and asked == ["late"], (results["late"].placement, asked)
