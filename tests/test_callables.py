"""A callable argument that cannot be called as hydra-torch calls it is refused when the task is made, naming the
form: it failed at the task's first unit, after the run's planning and measuring (a loss_fn(output), say)."""
import functools

import pytest
import torch

import hydra_torch as ht
from models import lm_loss, tied_transformer, token_batches


def task(**options):
    return ht.ModelTask(tied_transformer(), **{"loss_fn": lm_loss, "data": token_batches(2), **options})


@pytest.mark.parametrize("option, value, form", [
    ("loss_fn", lambda output: output.sum(), r"loss_fn\(output, batch\): too many positional arguments"),
    ("loss_fn", lambda output, batch, weight: output.sum(), r"loss_fn\(output, batch\): missing a required argument"),
    ("inputs", lambda: None, r"inputs\(batch\): too many positional arguments"),
    ("lr_schedule", lambda: 1.0, r"lr_schedule\(step\) -> multiplier: too many positional arguments"),
    ("lr_schedule", lambda step, total: 1.0, r"lr_schedule\(step\) -> multiplier: missing a required argument"),
])
def test_a_callable_of_another_form_is_refused_naming_the_form(option, value, form):
    with pytest.raises(TypeError, match=rf"{option} must be callable as .*{form}"):
        task(**{option: value})


@pytest.mark.parametrize("loss_fn", [
    lambda output, batch, weight=1.0: lm_loss(output, batch) * weight,  # defaults are the user's own
    lambda *args: lm_loss(*args),
    functools.partial(lambda scale, output, batch: lm_loss(output, batch) * scale, 1.0),
    lambda output, batch, **options: lm_loss(output, batch),
])
def test_a_callable_that_takes_the_arguments_is_taken(loss_fn):
    result = ht.train([task(loss_fn=loss_fn, lr_schedule=lambda step, *rest: 1.0)], devices="cpu", progress=False)[0]
    assert result.error is None and result.steps == 2


def test_a_callable_without_a_signature_is_taken_and_called():
    # A builtin or an extension's function has no signature to read: it is found out when called, as before.
    class Loss:
        @property
        def __signature__(self):
            raise ValueError("no signature found")

        def __call__(self, output, batch):
            return lm_loss(output, batch)

    result = ht.train([task(loss_fn=Loss())], devices="cpu", progress=False)[0]
    assert result.error is None and result.steps == 2
    assert torch.isfinite(torch.tensor(result.losses)).all()


def test_a_param_group_selector_of_another_form_is_refused_naming_the_form():
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\] must be callable as select\(name, parameter\) "
                                        r"-> bool: too many positional arguments"):
        task(param_groups=[{"params": lambda name: "bias" in name, "weight_decay": 0.0}])
    selected = task(param_groups=[{"params": lambda name, parameter: "bias" in name, "lr": 0.5}])
    assert selected.param_options and all(lr == 0.5 for _, lr, _ in selected.param_options.values())


def test_an_optuna_build_task_of_another_form_is_refused_before_any_trial():
    optuna = pytest.importorskip("optuna")
    from hydra_torch.optuna import optimize
    study = optuna.create_study()
    with pytest.raises(TypeError, match=r"build_task must be callable as build_task\(trial\) -> ModelTask: missing a "
                                        r"required argument"):
        optimize(study, lambda trial, lr: task(), n_trials=1)
    assert not study.trials
