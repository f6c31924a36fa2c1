"""Optuna studies through one run: trials join as others end, pruners stop them at evaluations, the study is told
every result; and what a broken sampler, pruner or task does."""
import os
import signal
import warnings

import numpy as np
import pytest
import torch

import hydra_torch as ht
from models import lm_loss, tied_transformer, token_batches

optuna = pytest.importorskip("optuna", reason="Optuna is an optional dependency (pip install optuna)")
from hydra_torch.optuna import optimize  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
DATA, VALID = token_batches(8), token_batches(2, seed=7)


def build(trial, models=None, short=()):
    lr = trial.suggest_float("lr", 1e-5, 1e-2, log=True)
    model = tied_transformer(seed=trial.number, blocks=1)
    if models is not None:
        models[trial.number] = model
    return ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=lr), loss_fn=lm_loss, data=DATA, eval_data=VALID,
                        eval_every=2, name=f"trial{trial.number}", max_steps=2 if trial.number in short else None)


@pytest.mark.parametrize("pruner", [optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1),
                                    optuna.pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=2),
                                    optuna.pruners.HyperbandPruner(min_resource=2, max_resource=8, reduction_factor=2)],
                         ids=["median", "successive_halving", "hyperband"])
def test_trials_run_concurrently_are_pruned_and_told(pruner):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0), pruner=pruner)
    models = {}
    # Trial 0 is short and the devices take turns (longest-first would run it last): the fourth trial joins
    # while trials 1 and 2 still train.
    results = optimize(study, lambda trial: build(trial, models, short={0}), n_trials=8, concurrent=3,
                       devices=["cpu", "cpu"], schedule="round_robin")
    trials = study.trials
    assert len(trials) == 8 and len(results) == 8
    states = optuna.trial.TrialState
    assert all(t.state in (states.COMPLETE, states.PRUNED) for t in trials)
    # Hyperband splits the 8 trials into brackets of a few each and prunes a trial only when a better one of its
    # bracket reported at that rung before it, which the devices' interleaving decides: some runs prune none.
    if not isinstance(pruner, optuna.pruners.HyperbandPruner):
        assert any(t.state == states.PRUNED for t in trials)
    for trial in trials:
        result = results[f"trial{trial.number}"]
        assert trial.intermediate_values == dict(result.eval_losses)  # every evaluation reported, at its step
        if trial.state == states.COMPLETE:
            assert result.steps == (2 if trial.number == 0 else 8) and trial.value == result.final_eval_loss
        else:
            assert result.stopped.startswith(f"pruned by {type(pruner).__name__} at step {result.steps}")
            assert result.eval_losses[-1][0] == result.steps  # pruned at its latest evaluation
        # The trial's weights came back to its model when it ended.
        assert all(p.device.type == "cpu" and p.grad is None for p in models[trial.number].parameters())
    # Trials after the first three joined while others trained.
    first_unit = {}
    for e in results.trace:
        first_unit.setdefault(e.task_name, e.start)
    last_of_first_three = max(e.end for e in results.trace if e.task_name in ("trial0", "trial1", "trial2"))
    assert first_unit["trial3"] < last_of_first_three
    assert study.best_trial.value == min(t.value for t in trials if t.state == states.COMPLETE)


def test_a_trials_weights_equal_training_it_alone():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    models = {}
    results = optimize(study, lambda trial: build(trial, models), n_trials=4, concurrent=2, devices="cpu")
    late = study.trials[3]  # it joined the running call
    alone = tied_transformer(seed=3, blocks=1)
    task = ht.ModelTask(alone, optimizer=ht.optim.AdamW(lr=late.params["lr"]), loss_fn=lm_loss, data=DATA,
                        eval_data=VALID, eval_every=2, name="alone")
    # Every task's random streams (dropout here) start where the generator stood as the run began: just after
    # the first two trials' models were built.
    tied_transformer(seed=1, blocks=1)
    reference = ht.train(task, devices="cpu", progress=False)[0]
    assert results["trial3"].losses == pytest.approx(reference.losses, rel=1e-6)
    assert [step for step, _ in results["trial3"].eval_losses] == [step for step, _ in reference.eval_losses]
    assert [loss for _, loss in results["trial3"].eval_losses] == pytest.approx(
        [loss for _, loss in reference.eval_losses], rel=1e-6)
    for a, b in zip(models[3].parameters(), alone.parameters()):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_task_that_cannot_be_built_or_fails_is_told_fail_and_the_others_go_on():
    def flaky(trial):
        if trial.number == 1:
            raise RuntimeError("no such configuration")
        task = build(trial)
        if trial.number == 2:
            task.loss_fn = lambda out, batch: torch.tensor(float("nan"))
        if trial.number == 0:
            task.model.requires_grad_(False)  # nothing to train: refused as it is built, its trial alone
        return task

    study = optuna.create_study()
    with pytest.warns(RuntimeWarning, match="trial 1 failed: its task could not be built"):
        with pytest.warns(RuntimeWarning, match="trial 0 failed: its task could not be built: .*nothing to train"):
            results = optimize(study, flaky, n_trials=6, concurrent=2, devices="cpu")
    states = [t.state for t in study.trials]
    assert states[0] == states[1] == states[2] == optuna.trial.TrialState.FAIL
    assert sum(s == optuna.trial.TrialState.COMPLETE for s in states) == 3
    assert results["trial2"].error is not None and len(results) == 4


class BrokenPruner(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        if trial.number == 1:
            raise ValueError("pruner bug")
        return False


def test_a_pruner_that_raises_fails_its_trial_only():
    study = optuna.create_study(pruner=BrokenPruner())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        results = optimize(study, build, n_trials=3, concurrent=3, devices="cpu")
    error = results["trial1"].error
    assert isinstance(error, ValueError) and "raised by the study's pruner (BrokenPruner)" in "".join(error.__notes__)
    assert [t.state.name for t in study.trials] == ["COMPLETE", "FAIL", "COMPLETE"]


class BrokenSampler(optuna.samplers.RandomSampler):
    def before_trial(self, study, trial):
        if trial.number >= 3:
            raise RuntimeError("sampler bug")


def test_a_sampler_that_raises_stops_new_trials_and_the_running_ones_are_told():
    study = optuna.create_study(sampler=BrokenSampler(seed=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(RuntimeError, match="sampler failed") as raised:
            optimize(study, build, n_trials=6, concurrent=2, devices="cpu")
    assert "sampler bug" in repr(raised.value.__cause__)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3  # trials 0-2 ran to the end and were told


def test_bad_arguments():
    study = optuna.create_study()
    for bad in ({"n_trials": 0}, {"n_trials": 2, "concurrent": 0}, {"n_trials": 2.0}, {"n_trials": np.bool_(True)}):
        with pytest.raises(ValueError, match="positive int"):
            optimize(study, build, **bad)
    with pytest.raises(ValueError, match="minimise one value"):
        optimize(optuna.create_study(direction="maximize"), build, n_trials=1)
    with pytest.raises(TypeError, match="optuna Study"):
        optimize("study", build, n_trials=1)
    with pytest.raises(ValueError, match="no trial's task could be built"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            optimize(study, lambda trial: "not a task", n_trials=2)


@pytest.fixture
def ctrl_c():
    """Ctrl-C raises KeyboardInterrupt, as in a terminal: a background job starts with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_stops_the_study_at_step_boundaries_and_returns_what_ran(ctrl_c):
    calls = [0]

    def interrupting(trial):
        task = build(trial)
        if trial.number == 1:
            def loss_fn(out, batch):
                calls[0] += 1
                if calls[0] == 3:
                    os.kill(os.getpid(), signal.SIGINT)
                return lm_loss(out, batch)
            task.loss_fn = loss_fn
        return task

    study = optuna.create_study()
    with pytest.warns(RuntimeWarning, match="stopped by Ctrl-C"):
        results = optimize(study, interrupting, n_trials=6, concurrent=2, devices="cpu")
    assert results.interrupted == "Ctrl-C"
    assert len(study.trials) <= 3  # no trial was started after the stop (one may have been joining)
    assert all(t.state != optuna.trial.TrialState.RUNNING for t in study.trials)  # every trial was told
    assert any(r.cut_short == "Ctrl-C" for r in results)


def test_ctrl_c_while_the_first_task_is_built_fails_its_trial(ctrl_c):
    def interrupted(trial):
        signal.raise_signal(signal.SIGINT)
        return build(trial)

    study = optuna.create_study()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(KeyboardInterrupt):
            optimize(study, interrupted, n_trials=3, concurrent=2, devices="cpu")
    assert [t.state.name for t in study.trials] == ["FAIL"]


@pytest.mark.parametrize("cause", ["two trials share a model", "too big for the devices"])
def test_trials_are_told_fail_when_the_run_cannot_start(cause):
    shared = tied_transformer(seed=0, blocks=1)

    def sharing(trial):
        return ht.ModelTask(shared, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=DATA,
                            name=f"trial{trial.number}")

    study = optuna.create_study()
    build_task, budget, error = ((sharing, None, "share a parameter") if cause == "two trials share a model"
                                 else (build, 1000, "memory budget too small"))
    with pytest.warns(RuntimeWarning, match="trial 1 failed: optimize stopped before it ended"):
        with pytest.raises(ValueError, match=error):
            optimize(study, build_task, n_trials=4, concurrent=2, devices="cpu", memory_budget=budget)
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL"]


class Abort(BaseException):
    """Not an Exception: what a build_task may raise to stop everything."""


@pytest.mark.parametrize("error", [Abort("stop the study"), KeyboardInterrupt()], ids=["BaseException", "Ctrl-C"])
def test_a_build_task_that_kills_the_driver_makes_optimize_raise_once_every_trial_is_told(error):
    def aborting(trial):
        if trial.number == 2:  # asked on the driver's thread, once trial 0 or 1 has ended
            raise error
        return build(trial)

    study = optuna.create_study()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(type(error)) as raised:
            optimize(study, aborting, n_trials=5, concurrent=2, devices="cpu")
    assert raised.value is error
    # The trial still training when the driver died ran to its end and was told.
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "FAIL"]
    assert all(len(t.intermediate_values) == 4 for t in study.trials[:2])


def test_trials_of_one_frozen_base_share_it_as_they_join():
    import copy

    torch.manual_seed(0)
    pretrained = tied_transformer(seed=0, blocks=2)
    for layer in list(pretrained)[:2]:
        layer.requires_grad_(False)
    base = ht.FrozenBase("pretrained")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))

    def build_on_base(trial):
        lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        return ht.ModelTask(copy.deepcopy(pretrained), optimizer=ht.optim.AdamW(lr=lr), loss_fn=lm_loss, data=DATA,
                            eval_data=VALID, eval_every=4, name=f"trial{trial.number}", base=base)
    results = optimize(study, build_on_base, n_trials=5, concurrent=2, devices="cpu")
    assert len(results) == 5 and all(r.error is None for r in results)
    assert results.bases["pretrained"]["tasks"] == [f"trial{i}" for i in range(5)]
