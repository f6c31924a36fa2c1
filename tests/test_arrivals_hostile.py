"""Arrivals against hostile use: a call that refuses its arguments while a driver waits on it, one Arrivals handed to
two calls, and a task that builds and adds another from inside its own loss_fn. Each was a hang."""
import threading

import pytest

import hydra_torch as ht
from hydra_torch.arrivals import Arrivals, RunClosedError
from hydra_torch.state import task_rng
from models import lm_loss
from test_arrivals import task, train_or_hang


def waiting(call) -> tuple[threading.Thread, dict]:
    """call() on a thread of its own, as a driver's; what it returned or raised lands in the dict."""
    outcome = {}

    def driver():
        try:
            outcome["returned"] = call()
        except BaseException as error:
            outcome["error"] = error
    thread = threading.Thread(target=driver, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.parametrize("refused", ["duplicate names", "budget too small"])
def test_a_call_that_raises_before_training_lets_its_drivers_calls_return(refused):
    arrivals, late = Arrivals(), task("late", seed=2)
    adding, added = waiting(lambda: arrivals.add(late))
    closing, closed = waiting(arrivals.close)
    tasks, budget = ([task("x"), task("x", seed=1)], None) if refused == "duplicate names" else ([task("y")], 1000)
    with pytest.raises(ValueError):
        ht.train(tasks, devices="cpu", memory_budget=budget, progress=False, arrivals=arrivals)
    adding.join(30)
    closing.join(30)
    assert not adding.is_alive() and not closing.is_alive(), "a driver's call still waits for a run that never came"
    assert isinstance(added.get("error"), RunClosedError) and "before it started training" in str(added["error"])
    assert closed == {"returned": None}


def test_an_arrivals_serves_one_call():
    arrivals = Arrivals()
    closing, _ = waiting(arrivals.close)
    assert [r.name for r in train_or_hang([task("first")], arrivals, ["cpu"])] == ["first"]
    closing.join(30)
    again = task("second", seed=1)
    before = [p.detach().clone() for p in again.model.parameters()]
    with pytest.raises(ValueError, match="this Arrivals served an earlier call: make a new one for each call"):
        train_or_hang([again], arrivals, ["cpu"])
    assert all((p == b).all() for p, b in zip(again.model.parameters(), before)), "refused before anything trained"


def test_adding_from_a_tasks_own_loss_fn_is_refused_not_a_hang():
    arrivals, refusals, nested = Arrivals(), [], task("nested", seed=3)

    def adds_a_task(output, batch):
        if not refusals:
            for attempt in (lambda: task_rng.exclusive().__enter__(), lambda: arrivals.add(nested)):
                try:
                    attempt()
                except RuntimeError as error:
                    refusals.append(error)
            arrivals.close()
        return lm_loss(output, batch)
    first = task("first")
    first.loss_fn = adds_a_task
    results = train_or_hang([first], arrivals, ["cpu", "cpu"])
    assert [r.name for r in results] == ["first"] and results["first"].ok
    assert len(refusals) == 2, refusals
    assert "inside a task's unit" in str(refusals[0]) and "on a device's worker thread" in str(refusals[1])
