"""ht.train and ht.plan called where gradients are off (inside torch.no_grad(), torch.inference_mode() or after
torch.set_grad_enabled(False), say in a notebook cell after an evaluation) train and plan as they do elsewhere: the
caller's grad mode is the caller's own. Every task used to fail ("element 0 of tensors does not require grad")."""
import contextlib
import threading

import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.arrivals import Arrivals
from hydra_torch.state import task_rng

pytest.importorskip("transformers")
from test_hf_gpt2 import batches, tiny_gpt2  # noqa: E402

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
         "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False)}


def plainly_trained(data):
    model = tiny_gpt2(dropout=0.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in data:
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()
    return model


@pytest.mark.parametrize("budget", [None, 200_000], ids=["resident", "spilled"])
@pytest.mark.parametrize("mode", MODES)
def test_training_where_gradients_are_off_trains_as_elsewhere(mode, budget):
    data = batches(3)
    model = tiny_gpt2(dropout=0.0)
    task = ht.ModelTask(model, data=data, eval_data=data[:1], optimizer=ht.optim.SGD(lr=0.1))
    with MODES[mode]():
        result = ht.train([task], devices="cpu", memory_budget=budget, progress=False)[0]
        assert not torch.is_grad_enabled(), "the caller's mode is as it was"
    assert result.error is None and result.steps == 3 and result.resident == (budget is None)
    for a, b in zip(model.parameters(), plainly_trained(data).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert all(not p.is_inference() for p in model.parameters())


def test_planning_where_gradients_are_off_plans_as_elsewhere():
    task = ht.ModelTask(tiny_gpt2(dropout=0.0), data=batches(1))
    with torch.no_grad():
        plan = ht.plan(task, "cpu", budget=400_000, repeats=1)
    assert len(plan.starts) > 1 and all(seconds > 0 for seconds in plan.shard_seconds)
    assert all(activations > 0 for activations in plan.shard_activation_bytes)


def test_a_task_joining_from_a_thread_where_gradients_are_off_is_measured_as_elsewhere():
    # Arrivals.add measures the task on its caller's thread: under no_grad no activation was saved, so its working set
    # and saved inputs read small, and a task the run has no room for could join.
    measured = {}
    for off in (False, True):
        arrivals = Arrivals()
        with task_rng.exclusive():
            late = ht.ModelTask(tiny_gpt2(dropout=0.0), data=batches(2), name="late")
            first = ht.ModelTask(tiny_gpt2(dropout=0.0), data=batches(4), name="first")

        def driver():
            try:
                with torch.no_grad() if off else contextlib.nullcontext():
                    arrivals.add(late)
            finally:
                arrivals.close()
        thread = threading.Thread(target=driver)
        thread.start()
        with testing.emulated_link(1e10):  # a device whose lanes are apart measures a task cut by hand, as a GPU
            results = ht.train([first], devices="cpu", memory_budget="64MiB", progress=False, arrivals=arrivals)
        thread.join()
        assert [r.name for r in results] == ["first", "late"] and all(r.error is None for r in results)
        measured[off] = (late.working_set_bytes, late.boundary_bytes, late.graph_bytes)
    assert measured[True] == measured[False] and all(measured[False])


@pytest.mark.parametrize("devices", ["cpu", ["cpu", "cpu"]])
def test_a_callers_autocast_is_not_applied_to_some_units_and_says_so(devices):
    # Autocast is the calling thread's: it reached the first device's units alone (this thread runs them), so a
    # run on two devices computed some units in bf16 and the others in fp32, and on one device the fp32 task
    # trained apart from its plain training, silently. precision="bf16" is hydra-torch's mixed precision.
    data = batches(3)
    model = tiny_gpt2(dropout=0.0)
    task = ht.ModelTask(model, data=data, eval_data=data[:1], optimizer=ht.optim.SGD(lr=0.1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(UserWarning, match=r"ht.train is called under torch.autocast\('cpu'\), which it does not "
                                             r"apply: a task's precision='bf16' computes in bf16"):
            result = ht.train([task], devices=devices, memory_budget=200_000, progress=False)[0]
        assert torch.is_autocast_enabled("cpu"), "the caller's autocast is as it was"
    assert result.error is None and result.steps == 3
    for a, b in zip(model.parameters(), plainly_trained(data).parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
