"""Results.best names a task that finished over one cut short or stopped, and never one without a finite loss;
data whose len() lies trains the steps len() promised, then stops the task with a DataLengthError."""
import math

import pytest
import torch

import hydra_torch as ht
from hydra_torch.run.steps import DataLengthError
from models import lm_loss, tied_transformer, token_batches
from test_bad_input import LyingData
from test_request_stop import StopAt

NAN = float("nan")


def result(name, loss=1.0, eval_loss=None, steps=4, total_steps=4, **fields):
    """A TaskResult of `steps` steps whose last loss is `loss` (and validation loss `eval_loss`, if given)."""
    evaluated = [(steps, eval_loss)] if eval_loss is not None else []
    return ht.TaskResult(name, [2.0] * (steps - 1) + [loss], steps, 1, 0.0, True, [], eval_losses=evaluated,
                         total_steps=total_steps, **fields)


def best_of(*tasks):
    best = ht.Results(list(tasks), ["cpu"]).best
    return best.name if best is not None else None


def test_best_is_a_finished_task_before_one_cut_short_or_stopped_however_low_their_loss():
    done = result("done", 0.9)
    cut = result("cut", 0.1, steps=2, cut_short="stopped on request")
    stopped = result("stopped", 0.2, steps=2, stopped="successive halving at rung 1 (step 2)")
    assert best_of(cut, stopped, done) == "done"
    assert best_of(stopped, cut) == "cut", "not judged worse by the rule: it ranks before one stopped"
    assert best_of(stopped) == "stopped"
    failed = result("failed", 0.05, error=RuntimeError("boom"))
    assert best_of(failed, cut) == "cut" and best_of(failed) is None


def test_best_skips_a_loss_that_is_not_finite_and_is_none_when_no_loss_is():
    assert best_of(result("a", eval_loss=NAN), result("b", eval_loss=0.5), result("c", eval_loss=math.inf)) == "b"
    # A finished task with no finite validation loss gives way to one cut short that has one.
    assert best_of(result("done", eval_loss=NAN), result("cut", eval_loss=0.5, cut_short="Ctrl-C")) == "cut"
    assert best_of(result("a", eval_loss=NAN), result("b", eval_loss=NAN, cut_short="Ctrl-C")) is None
    assert best_of(result("a", NAN), result("b", NAN)) is None


def test_a_name_not_in_the_results_is_a_key_error_that_names_the_tasks():
    results = ht.Results([result("lr1e-4"), result("lr3e-4")], ["cpu"])
    assert results["lr3e-4"].name == "lr3e-4" and results[0].name == "lr1e-4"
    with pytest.raises(KeyError, match=r"no task named 'lr3e-3' in these results: 'lr1e-4', 'lr3e-4'"):
        results["lr3e-3"]


@pytest.mark.parametrize("chart", ["plot_schedule", "plot_curves"])
def test_a_chart_without_matplotlib_says_what_to_install(chart, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    results = ht.Results([result("lr1e-4")], ["cpu"])
    with pytest.raises(ImportError, match=r"the charts need matplotlib: pip install matplotlib"):
        getattr(results, chart)(tmp_path / "chart.png")


def test_the_summary_says_when_the_best_did_not_finish():
    cut = result("cut", 0.25, steps=3, cut_short="Ctrl-C")
    assert "best: cut (final loss 0.2500; cut short at step 3 of 4)" in summary_lines(cut)
    stopped = result("stopped", 0.25, eval_loss=0.5, steps=2, stopped="successive halving at rung 1 (step 2)")
    assert "best: stopped (validation loss 0.5000; stopped: successive halving at rung 1 (step 2))" in \
        summary_lines(stopped)
    assert "best: done (final loss 0.2500)" in summary_lines(result("done", 0.25))


def summary_lines(*tasks):
    return ht.Results(list(tasks), ["cpu"]).summary().splitlines()


def test_a_task_cut_short_by_request_stop_is_not_best_though_its_loss_is_lower():
    stopper = StopAt(3)
    data = token_batches(1) * 10  # one batch again and again: training lowers its loss step by step
    cut = ht.ModelTask(tied_transformer(seed=0, blocks=1), optimizer=ht.optim.AdamW(lr=3e-3), loss_fn=stopper,
                       data=data, name="cut")
    stopper.task = cut
    slow = ht.ModelTask(tied_transformer(seed=0, blocks=1), optimizer=ht.optim.AdamW(lr=1e-6), loss_fn=lm_loss,
                        data=data, name="slow")
    results = ht.train([cut, slow], devices="cpu", progress=False)
    cut_short = results["cut"]
    assert cut_short.cut_short and cut_short.final_loss < results["slow"].final_loss
    assert results.best is results["slow"]
    assert f"best: cut (final loss {cut_short.final_loss:.4f}; cut short at step {cut_short.steps} of 10)" in \
        summary_lines(cut_short)


def lying_pair(data, accumulate, epochs, twin_batches, **options):
    """A task on `data` and its twin on `twin_batches` honest batches, one epoch: the same model, seed and
    options."""
    def task(name, batches, epochs):
        return ht.ModelTask(tied_transformer(seed=0, blocks=1), loss_fn=lm_loss, data=batches, name=name,
                            accumulate=accumulate, epochs=epochs, **options)
    return task("liar", data, epochs), task("twin", token_batches(twin_batches), 1)


def train_pair(liar, twin):
    torch.manual_seed(0)
    with pytest.warns(RuntimeWarning, match="liar"):
        return ht.train([liar, twin], devices="cpu", progress=False)


def same_training(results, liar, twin):
    """The liar trained exactly what its twin did: the same steps, losses, evaluations and weights."""
    a, b = results["liar"], results["twin"]
    return a.steps == b.steps and a.losses == b.losses and a.eval_losses == b.eval_losses and \
        all(torch.equal(p, q) for p, q in zip(liar.model.parameters(), twin.model.parameters()))


@pytest.mark.parametrize("accumulate, epochs, clip", [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None),
                                                     (2, 2, 1.0)])
def test_data_longer_than_its_len_trains_every_promised_step_then_stops(accumulate, epochs, clip):
    # Evaluated after each epoch: the evaluation after the last promised step runs too.
    liar, twin = lying_pair(LyingData(8, 5), accumulate, epochs, twin_batches=5, eval_data=token_batches(2, seed=7),
                            eval_every=math.ceil(5 / accumulate), clip_grad_norm=clip)
    results = train_pair(liar, twin)
    error = results["liar"].error
    assert isinstance(error, DataLengthError) and "epoch 1 of data has more than len(data) = 5 batches" in str(error)
    assert results["liar"].steps == math.ceil(5 / accumulate) and results["liar"].epochs == 1
    assert same_training(results, liar, twin), "the last promised step was trained and its weights kept"


@pytest.mark.parametrize("accumulate, epochs", [(1, 1), (2, 1), (2, 2)])
def test_data_shorter_than_its_len_trains_its_whole_steps_then_stops(accumulate, epochs):
    liar, twin = lying_pair(LyingData(5, 8), accumulate, epochs, twin_batches=5 // accumulate * accumulate)
    results = train_pair(liar, twin)
    error = results["liar"].error
    assert isinstance(error, DataLengthError) and \
        "epoch 1 of data ended after 5 batches, but len(data) is 8" in str(error)
    assert results["liar"].steps == 5 // accumulate and results["liar"].epochs == 0
    assert same_training(results, liar, twin), "a step missing some of its batches is not trained"


def test_the_summary_names_the_loss_the_best_was_chosen_by():
    # Not every task was evaluated, so the training loss chose: the summary says that loss, not another.
    evaluated = result("evaluated", 0.25, eval_loss=float("nan"))
    assert "best: evaluated (final loss 0.2500)" in summary_lines(evaluated, result("other", 0.5))


def test_a_result_is_found_by_position_name_or_task_and_in_answers_alike():
    # `"t0" in results` said False while results["t0"] found it (in compared each TaskResult with the str).
    tasks = [ht.ModelTask(tied_transformer(seed=i, blocks=1), data=token_batches(1), loss_fn=lm_loss, name=f"t{i}")
             for i in range(2)]
    results = ht.train(tasks, devices="cpu", progress=False)
    assert results["t1"] is results[1] is results[tasks[1]] is results[-1]
    assert "t0" in results and tasks[0] in results and results[0] in results
    assert "t2" not in results and 0 not in results and None not in results
    other = ht.ModelTask(tied_transformer(blocks=1), data=token_batches(1), loss_fn=lm_loss, name="t2")
    assert other not in results
    with pytest.raises(KeyError, match="no task named 't2'"):
        results[other]
