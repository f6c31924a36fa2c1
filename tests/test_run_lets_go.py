"""A run lets go of everything it made (engines with their arenas, device slots, runners) as ht.train returns,
whatever the caller keeps of it: its results, a failed task's error, the Arrivals handle. Nothing may wait for
the garbage collector: a notebook keeps results for hours, and an arena is up to a whole memory budget (on a GPU,
device memory the next run needs)."""
import gc
import traceback

import pytest

import hydra_torch as ht
from hydra_torch.arrivals import Arrivals, RunClosedError
from hydra_torch.run.workers import DeviceSlot
from models import lm_loss, tied_transformer, token_batches

DATA = token_batches(4)


def task(name, loss_fn=lm_loss, seed=0):
    return ht.ModelTask(tied_transformer(seed=seed, blocks=1), optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=loss_fn,
                        data=DATA, name=name)


def left_of_runs(train):
    """What `train()` returns, and the device slots still alive once it has, with the collector off."""
    gc.collect()
    gc.disable()
    try:
        assert not [o for o in gc.get_objects() if type(o) is DeviceSlot], "an earlier run left its slots"
        out = train()
        return out, [o for o in gc.get_objects() if type(o) is DeviceSlot]
    finally:
        gc.enable()


def failing_loss(output, batch):
    if failing_loss.calls == 2:
        raise ValueError("this loss fails on its third micro-batch")
    failing_loss.calls += 1
    return lm_loss(output, batch)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["one device", "two devices"])
def test_a_failed_tasks_error_keeps_its_traceback_as_text_and_not_the_run(devices):
    failing_loss.calls = 0
    with pytest.warns(RuntimeWarning, match="third micro-batch"):
        results, left = left_of_runs(lambda: ht.train([task("failing", failing_loss), task("fine", seed=1)],
                                                      devices=devices, progress=False))
    assert not left, f"{len(left)} device slots outlived the run through the failed task's error"
    error = results["failing"].error
    assert isinstance(error, ValueError) and error.__traceback__ is None
    shown = "".join(traceback.format_exception(error))
    assert "in failing_loss" in shown and "raise ValueError" in shown  # where it was raised, as text
    assert results["fine"].ok


def test_a_kept_arrivals_handle_does_not_keep_the_run():
    # With arrivals each arena takes its whole budget at the start: the handle (and the slots' references to one
    # another) held the run until a collection.
    arrivals = Arrivals(on_ended=lambda result: arrivals.close())
    results, left = left_of_runs(lambda: ht.train([task("first")], devices=["cpu", "cpu"], arrivals=arrivals,
                                                  memory_budget=2**30, progress=False))
    assert results["first"].ok
    assert not left, f"{len(left)} device slots outlived the run"
    with pytest.raises(RunClosedError, match="the run has ended"):
        arrivals.add(task("late"))


def test_a_plain_run_keeps_nothing():
    results, left = left_of_runs(lambda: ht.train([task("a"), task("b", seed=1)], devices=["cpu", "cpu"],
                                                  progress=False))
    assert all(r.ok for r in results) and not left
