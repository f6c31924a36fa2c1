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
from hydra_torch.state import task_rng
from models import lm_loss, model_bytes, tied_transformer, token_batches

DATA = token_batches(4)
# The host steps a model's ~1.8 MB a step at 2 MB/s, a second a step against milliseconds of compute: the lane model
# takes the steps it can off the host.
LINK, HOST = 1e10, 2e6


def task(name, seed, accumulate=1):
    with task_rng.exclusive():  # building a model draws from the CPU generator the workers share
        return ht.ModelTask(tied_transformer(seed=seed), optimizer=ht.optim.AdamW(lr=3e-3, weight_decay=0.05),
                            loss_fn=lm_loss, data=DATA, accumulate=accumulate, name=name)


def train_with_a_late_task(placement, accumulate=1):
    """"first" trains, "late" joins as soon as the run is open (while "first" trains); the results and late's model."""
    first, late = task("first", seed=0), task("late", seed=1, accumulate=accumulate)
    arrivals, outcome = Arrivals(on_ended=lambda result: None), queue.SimpleQueue()

    def driver():
        try:
            arrivals.add(late)
        except BaseException as error:  # reported below, not lost on this thread
            outcome.put(error)
        finally:
            arrivals.close()
    thread = threading.Thread(target=driver)
    thread.start()
    with testing.emulated_link(LINK), testing.emulated_host(HOST):
        results = ht.train([first], devices="cpu", memory_budget=int(4 * model_bytes(first.model)), progress=False,
                           placement=placement, arrivals=arrivals)
    thread.join(timeout=120)
    assert outcome.empty(), outcome.get()
    assert [r.name for r in results] == ["first", "late"] and all(r.ok for r in results), [r.error for r in results]
    return results, late.model


def test_a_task_joining_an_auto_run_steps_shards_on_the_device_and_trains_as_alone():
    results, joined = train_with_a_late_task("auto")
    late = results["late"]
    untied = set(range(1, 7))  # shards 0 and 7 share the tied embedding and head
    assert late.device_shards and set(late.device_shards) <= untied, late.placement
    assert "stepped on the device" in late.placement
    assert results.stats[0]["device_steps"] == sum(len(r.device_shards) * r.steps for r in results)
    # Alone, every shard stepped on the host, from where the generator stood as the run began (just after "late"'s
    # model was built): the same steps.
    alone = task("alone", seed=1)
    reference = ht.train(alone, devices="cpu", progress=False, placement="host")[0]
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


def test_a_task_joining_a_device_run_steps_every_untied_shard_on_the_device():
    results, _ = train_with_a_late_task("device")
    assert results["late"].device_shards == list(range(1, 7))


def test_a_lane_model_that_fails_for_a_joining_task_warns_and_its_steps_stay_on_the_host(monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("no forecast")
    from hydra_torch.run import lane_choice
    monkeypatch.setattr(lane_choice, "_placed", fails)  # where the running tasks step: asked for a newcomer alone
    with pytest.warns(RuntimeWarning, match="could not ask the lane model for 'late'.*no forecast"):
        results, _ = train_with_a_late_task("auto")
    assert results["late"].device_shards == []
