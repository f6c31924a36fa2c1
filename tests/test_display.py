"""What a notebook shows of ht.train's results and ht.plan's plan: their tables. A repr stays short however long
the run was: a sweep's trace holds an entry per unit (millions in a long one), which a notebook cell, a log line
or a debugger would otherwise print whole."""
import pytest

import hydra_torch as ht
from hydra_torch.report.results import StepEntry, TraceEntry
from models import lm_loss, tied_transformer, token_batches
from test_results_and_data import result

IPython = pytest.importorskip("IPython")
from IPython.lib.pretty import pretty  # noqa: E402


def long_run() -> ht.Results:
    """Two tasks of 4000 steps, one cut short, with a trace and step record of such a run's length."""
    tasks = [result("lr1e-4", loss=1.5, steps=4000, total_steps=4000),
             result("lr3e-4", loss=1.2, steps=2500, total_steps=4000, cut_short="Ctrl-C")]
    trace = [TraceEntry(0, i % 2, tasks[i % 2].name, i // 2, i % 8, "forward", 0.01 * i, 0.01 * i + 0.005, 1 << 20)
             for i in range(200_000)]
    steps = [StepEntry(0, i % 2, tasks[i % 2].name, i % 8, i // 16, "host", 0.01 * i, 0.01 * i + 0.002)
             for i in range(50_000)]
    return ht.Results(tasks, ["cpu"], trace=trace, wall_time=2000.0, steps=steps)


def test_the_repr_of_a_long_run_is_short_and_names_its_tasks_and_best():
    results = long_run()
    text = repr(results)
    assert len(text) < 400, text
    assert "2 tasks" in text and "best 'lr1e-4'" in text and "200000 units" in text and "50000 shard steps" in text
    for task in results:
        line = repr(task)
        assert len(line) < 200 and task.name in line, line
    assert "4000 of 4000 steps" in repr(results[0]) and "final loss 1.5000" in repr(results[0])
    assert "cut short at step 2500 of 4000" in repr(results[1])


def test_a_failed_task_says_why_in_its_repr():
    failed = result("lr1", error=RuntimeError("the loss is nan at step 3"))
    assert "failed: RuntimeError('the loss is nan at step 3')" in repr(failed)


def test_a_notebook_shows_the_results_table_and_print_prints_it():
    results = long_run()
    assert pretty(results) == results.summary() == str(results)


def test_a_notebook_shows_the_plan_as_its_table():
    task = ht.ModelTask(tied_transformer(dropout=0.0), loss_fn=lm_loss, data=token_batches(2))
    plan = ht.plan(task, "cpu", budget="1GiB", placement=None, repeats=1)
    assert pretty(plan) == str(plan) and str(plan).startswith("Plan: ")


def test_a_loss_not_measured_is_a_dash_in_the_table():
    # A task that was never evaluated, or took no step, has no such loss: "nan" read as a loss that diverged.
    results = ht.Results([result("evaluated", eval_loss=0.75), result("plain"), ht.TaskResult("none", [], 0, 0, 0.0, False, [])],
                         ["cpu"])
    rows = {line.split()[0]: line.split()[1:4] for line in results.summary().splitlines()[1:4]}
    assert rows == {"evaluated": ["4", "1.0000", "0.7500"], "plain": ["4", "1.0000", "-"], "none": ["0", "-", "-"]}


def test_the_repr_says_when_no_task_is_best():
    # No finite loss: Results.best is None, which the repr names rather than fails on.
    results = ht.Results([result("diverged", loss=float("nan")), ht.TaskResult("none", [], 0, 0, 0.0, False, [])],
                         ["cpu"])
    assert "2 tasks on cpu in 0.0 s, best None;" in repr(results)
