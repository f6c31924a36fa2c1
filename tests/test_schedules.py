"""Learning-rate schedules: transformers.get_scheduler's multipliers, applied to every shard's step, spilled and
resident, as torch.optim with that scheduler does; bad schedules refused or stopping only their task."""
import copy
import math

import pytest
import torch
from transformers import get_scheduler

import hydra_torch as ht
from hydra_torch.recipe import schedules
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain

STEPS, WARMUP = 9, 3


@pytest.mark.parametrize("name", ["linear", "cosine", "constant", "constant_with_warmup", "polynomial",
                                  "cosine_with_restarts", "inverse_sqrt"])
def test_multipliers_are_get_schedulers(name):
    warmup = 0 if name == "constant" else WARMUP
    ours = schedules.multipliers(name, warmup, STEPS)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    theirs = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=STEPS)
    for step in range(STEPS + 2):  # past the end too
        assert ours(step) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12, abs=1e-15), step
        optimizer.step()
        theirs.step()


def scheduled(name, warmup):
    return lambda optimizer: get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=STEPS)


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("name,options", [
    ("linear", {}),
    ("cosine", {"accumulate": 2, "clip_grad_norm": 0.5}),
    ("lambda", {}),
])
def test_a_scheduled_run_equals_torch_optim_with_the_scheduler(resident, name, options):
    accumulate = options.get("accumulate", 1)
    data = token_batches(STEPS * accumulate)
    model = tied_transformer(seed=3, dropout=0.0, blocks=2)
    reference = copy.deepcopy(model)
    if name == "lambda":
        schedule, warmup = (lambda step: 1.0 / (1 + step)), 0
        make_scheduler = lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)  # noqa: E731
    else:
        schedule, warmup = name, WARMUP
        make_scheduler = scheduled(name, warmup)
    train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), accumulate=accumulate,
                clip=options.get("clip_grad_norm"), make_scheduler=make_scheduler)
    task = ht.ModelTask(model, data=data, loss_fn=lm_loss, optimizer=ht.optim.AdamW(lr=1e-2, weight_decay=0.1),
                        lr_schedule=schedule, warmup_steps=warmup, **options)
    budget = "1GiB" if resident else int(1.5 * model_bytes(model))
    result = ht.train(task, devices="cpu", memory_budget=budget, progress=False)[0]
    assert result.error is None and result.resident == resident and result.steps == STEPS
    assert max_relative_error(model, reference) <= 1e-6


def test_the_schedule_spans_every_epoch_and_stops_at_max_steps():
    data = token_batches(4)
    model = tied_transformer(seed=4, dropout=0.0, blocks=1)
    reference = copy.deepcopy(model)
    steps = 6  # 2 epochs of 4 batches, cut at 6: the schedule decays over 6 steps
    train_plain(reference, (data * 2)[:steps], lambda p: torch.optim.AdamW(p, lr=1e-2),
                make_scheduler=lambda o: get_scheduler("linear", o, num_warmup_steps=1, num_training_steps=steps))
    task = ht.ModelTask(model, data=data, loss_fn=lm_loss, optimizer=ht.optim.AdamW(lr=1e-2), epochs=2,
                        max_steps=steps, lr_schedule="linear", warmup_steps=1)
    assert ht.train(task, devices="cpu", progress=False)[0].steps == steps
    assert max_relative_error(model, reference) <= 1e-6


@pytest.mark.parametrize("schedule,warmup,error,match", [
    ("linaer", 0, ValueError, "unknown lr_schedule 'linaer'"),
    ("reduce_lr_on_plateau", 0, ValueError, "unknown lr_schedule"),
    ("cosine_with_min_lr", 0, ValueError, "cannot be used here.*min_lr"),
    (0.5, 0, TypeError, "lr_schedule must be a name"),
    ("linear", -1, ValueError, "warmup_steps must be an int >= 0"),
    ("linear", 2.5, ValueError, "warmup_steps must be an int >= 0"),
    ("constant", 3, ValueError, "use 'constant_with_warmup'"),
    (lambda step: 1.0, 3, ValueError, "a callable lr_schedule has its own warmup"),
])
def test_bad_schedules_are_refused_when_the_task_is_made(schedule, warmup, error, match):
    with pytest.raises(error, match=match):
        ht.ModelTask(tied_transformer(blocks=1), data=token_batches(2), loss_fn=lm_loss, lr_schedule=schedule,
                     warmup_steps=warmup)


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, "fast"])
def test_a_bad_multiplier_stops_its_task_at_a_step_boundary_and_the_others_go_on(bad):
    def schedule(step):
        return bad if step == 2 else 1.0
    broken_model = tied_transformer(seed=5, dropout=0.0, blocks=1)
    after_two = copy.deepcopy(broken_model)
    train_plain(after_two, token_batches(2), lambda p: torch.optim.AdamW(p, lr=1e-2))
    other_model = tied_transformer(seed=6, dropout=0.0, blocks=1)
    broken = ht.ModelTask(broken_model, data=token_batches(4), loss_fn=lm_loss,
                          optimizer=ht.optim.AdamW(lr=1e-2), lr_schedule=schedule, name="broken")
    other = ht.ModelTask(other_model, data=token_batches(4), loss_fn=lm_loss, name="other")
    with pytest.warns(RuntimeWarning, match="task 'broken' stopped"):
        results = ht.train([broken, other], devices=["cpu", "cpu"], progress=False)
    assert "lr_schedule(2)" in str(results[0].error) and results[0].steps == 2
    assert results[1].error is None and results[1].steps == 4
    # Two devices of one thread each sum in another order than the reference: 1e-5, as across devices elsewhere.
    assert max_relative_error(broken_model, after_two) <= 1e-5, "the two good steps are kept, nothing half-applied"
