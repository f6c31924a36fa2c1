"""Whole-number arguments given as NumPy integers or one-element integer tensors (from np.arange, a sweep's table,
a DataFrame row) are taken as the ints they are, as torch takes them; they were refused as "must be a positive
int, got np.int64(2)". Floats and bools are still refused."""
import numpy as np
import pytest
import torch

import hydra_torch as ht
from models import lm_loss, tied_transformer, token_batches

TASK_ARGUMENTS = dict(epochs=2, accumulate=2, max_steps=3, eval_every=2, warmup_steps=1, shards=2)


def run(arguments, **train_arguments):
    model = tied_transformer()
    task = ht.ModelTask(model, data=token_batches(4), eval_data=token_batches(1), loss_fn=lm_loss,
                        lr_schedule="linear", name="task", **arguments)
    result = ht.train([task], devices="cpu", progress=False, **train_arguments)[0]
    assert result.error is None
    return task, result, model


@pytest.mark.parametrize("kind", [np.int64, np.int32, torch.tensor])
def test_numpy_and_tensor_integers_train_as_the_ints_they_are(kind, tmp_path):
    _, expected, model = run(TASK_ARGUMENTS, seed=3, host_threads=1)
    task, result, other = run({key: kind(value) for key, value in TASK_ARGUMENTS.items()}, seed=kind(3),
                              host_threads=kind(1), checkpoint_dir=tmp_path, checkpoint_every=kind(1))
    assert result.losses == expected.losses and result.eval_losses == expected.eval_losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert all(type(getattr(task, key)) is int for key in TASK_ARGUMENTS if key != "shards")
    assert task.num_shards == 2 and (tmp_path / "task" / "manifest.json").exists()


@pytest.mark.parametrize("key", ["epochs", "accumulate", "max_steps", "eval_every", "warmup_steps"])
@pytest.mark.parametrize("value", [2.0, np.float64(2.0), np.bool_(True), True, torch.tensor([1, 2])])
def test_what_is_no_whole_number_is_still_refused(key, value):
    with pytest.raises((ValueError, TypeError), match=key):
        ht.ModelTask(tied_transformer(), data=token_batches(2), eval_data=token_batches(1), loss_fn=lm_loss,
                     lr_schedule="linear", **{key: value})


def test_successive_halving_and_plan_take_numpy_integers():
    rule = ht.SuccessiveHalving(min_steps=np.int64(2), reduction_factor=np.int64(3))
    assert type(rule.min_steps) is int and type(rule.reduction_factor) is int
    with pytest.raises(ValueError, match="min_steps"):
        ht.SuccessiveHalving(min_steps=np.float64(2.0))
    task = ht.ModelTask(tied_transformer(), data=token_batches(1), loss_fn=lm_loss, shards="auto")
    assert len(ht.plan(task, max_shards=np.int64(2), repeats=np.int64(1), placement=None).starts) <= 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads the refusal of a CUDA index where there is no CUDA")
@pytest.mark.parametrize("devices", [np.int64(0), [np.int64(0)], torch.tensor(0)])
def test_a_numpy_device_index_names_a_cuda_device_as_an_int_does(devices):
    from hydra_torch.run.devices import resolve_devices

    with pytest.raises(ValueError, match="device cuda:0 was asked for but CUDA is not available"):
        resolve_devices(devices)
