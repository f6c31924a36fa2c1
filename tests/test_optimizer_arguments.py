"""ht.optim's optimizers take torch.optim's arguments: the numbers as torch.optim takes them (a tensor lr, NumPy
scalars) kept as floats, the flags that choose torch's implementation taken and changing nothing, and the flags that
change what a step computes refused by name; a task's clip_grad_norm likewise as clip_grad_norm_ takes it."""
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import hydra_torch as ht


@pytest.mark.parametrize("make", [
    lambda **kw: ht.optim.AdamW(lr=1e-3, **kw), lambda **kw: ht.optim.Adam(lr=1e-3, **kw),
    lambda **kw: ht.optim.SGD(lr=0.1, momentum=0.9, **kw)])
def test_torchs_implementation_flags_change_nothing(make):
    plain = make()
    flags = dict(foreach=True, fused=False) if isinstance(plain, ht.optim.SGD) else dict(foreach=False, fused=True,
                                                                                          capturable=True)
    flagged = make(**flags)
    assert flagged == plain and dataclasses.asdict(flagged) == dataclasses.asdict(plain)
    assert repr(flagged) == repr(plain)


@pytest.mark.parametrize("make, name", [(lambda: ht.optim.AdamW(amsgrad=True), "amsgrad"),
                                        (lambda: ht.optim.Adam(maximize=True), "maximize"),
                                        (lambda: ht.optim.SGD(maximize=True), "maximize"),
                                        (lambda: ht.optim.AdamW(differentiable=True), "differentiable")])
def test_flags_that_change_the_step_are_refused_by_name(make, name):
    with pytest.raises(ValueError, match=rf"\({name}=True\) is not supported: hydra-torch's native step has no"):
        make()


def test_adam_with_decoupled_weight_decay_is_named_adamw():
    with pytest.raises(ValueError, match="use ht.optim.AdamW"):
        ht.optim.Adam(decoupled_weight_decay=True)
    assert ht.optim.Adam(decoupled_weight_decay=False) == ht.optim.Adam()


def test_numbers_as_torch_optim_takes_them_are_kept_as_floats():
    optimizer = ht.optim.AdamW(lr=torch.tensor(0.5), betas=[np.float64(0.8), torch.tensor(0.75)], eps=1,
                               weight_decay=np.float32(0.25))
    assert dataclasses.asdict(optimizer) == {"lr": 0.5, "betas": (0.8, 0.75), "eps": 1.0, "weight_decay": 0.25}
    assert all(type(v) is float for v in (optimizer.lr, *optimizer.betas, optimizer.eps, optimizer.weight_decay))
    assert ht.optim.Adam(betas=np.array([0.5, 0.25])).betas == ht.optim.Adam(betas=torch.tensor([0.5, 0.25])).betas \
        == (0.5, 0.25)
    sgd = ht.optim.SGD(lr=np.float32(0.5), momentum=torch.tensor(0.5, dtype=torch.float64))
    assert (sgd.lr, sgd.momentum) == (0.5, 0.5) and type(sgd.momentum) is float


@pytest.mark.parametrize("arguments, error, match", [
    (dict(lr="0.1"), TypeError, "lr must be a real number"), (dict(lr=True), TypeError, "lr must be a real number"),
    (dict(lr=torch.ones(2)), TypeError, "lr must be a real number"),
    (dict(betas=0.9), ValueError, "betas must be a pair"), (dict(betas=(0.9,)), ValueError, "betas must be a pair")])
def test_numbers_that_are_not_one_real_are_refused(arguments, error, match):
    with pytest.raises(error, match=match):
        ht.optim.AdamW(**arguments)


def test_a_tensor_lr_trains_and_checkpoints(tmp_path):
    # Kept as the tensor it was, it trained, but a checkpoint_dir made ht.train raise: the manifest is JSON.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    reference.load_state_dict(model.state_dict())
    data = [torch.randn(2, 4) for _ in range(3)]
    task = ht.ModelTask(model, data=data, loss_fn=lambda output, batch: output.square().mean(),
                        optimizer=ht.optim.AdamW(lr=torch.tensor(0.01)))
    result = ht.train([task], devices="cpu", progress=False, checkpoint_dir=tmp_path)
    assert result[0].error is None and result.checkpoint_failures == 0
    optimizer = torch.optim.AdamW(reference.parameters(), lr=torch.tensor(0.01).item())
    for batch in data:
        optimizer.zero_grad()
        reference(batch).square().mean().backward()
        optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lr", [torch.tensor(0.02, dtype=torch.float64), np.float32(0.5)])
def test_a_groups_lr_as_torch_optim_takes_it_trains_as_the_float(lr, tmp_path):
    # A NumPy float32 or a tensor was refused as "not a finite number".
    trained = []
    for group_lr in (lr, float(lr)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        task = ht.ModelTask(model, data=[torch.ones(2, 4)] * 2, loss_fn=lambda output, batch: output.sum(),
                            param_groups=[{"params": "*.bias", "lr": group_lr, "weight_decay": group_lr}])
        result = ht.train([task], devices="cpu", progress=False, checkpoint_dir=tmp_path / str(len(trained)))
        assert result[0].error is None and result.checkpoint_failures == 0
        trained.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*trained))


def test_a_clipping_norm_is_taken_as_clip_grad_norm_takes_it():
    # A tensor or NumPy max_norm (torch.nn.utils.clip_grad_norm_ takes either) is kept as the float a checkpoint
    # records; a str is refused by name, not by a failed comparison.
    model = nn.Sequential(nn.Linear(2, 2))
    for clip in (torch.tensor(0.5), np.float32(0.5), 0.5):
        task = ht.ModelTask(model, data=[torch.zeros(1, 2)], loss_fn=lambda out, batch: out.sum(), clip_grad_norm=clip)
        assert type(task.clip_grad_norm) is float and task.clip_grad_norm == 0.5
    with pytest.raises(TypeError, match="clip_grad_norm must be a real number, got '1.0'"):
        ht.ModelTask(model, data=[torch.zeros(1, 2)], loss_fn=lambda out, batch: out.sum(), clip_grad_norm="1.0")
