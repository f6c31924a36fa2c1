"""A shuffling DataLoader given a generator of its own draws each epoch's order from it, outside the task's random
streams: a resume must put it where the interrupted run had it, or the resumed run trains on another order (epoch
2 replaying epoch 1's after a crash; any epoch's, with the same objects again in a notebook)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import hydra_torch as ht

_g = torch.Generator().manual_seed(1)
SAMPLES = [(torch.randn(4, generator=_g), torch.randn(2, generator=_g)) for _ in range(12)]  # 4 steps an epoch


def made(stop_at=None, generators=1):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    own = torch.Generator().manual_seed(42)
    sampler = torch.utils.data.RandomSampler(SAMPLES, generator=torch.Generator().manual_seed(43)) \
        if generators == 2 else None
    loader = DataLoader(SAMPLES, batch_size=3, shuffle=sampler is None, sampler=sampler, generator=own)
    calls = [0]

    def loss(out, batch):
        calls[0] += 1
        if calls[0] == stop_at:
            task.request_stop("interrupted")
        return F.mse_loss(out, batch[1])
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-2), loss_fn=loss, data=loader, epochs=3, name="t")
    return task, model


def train(task, **options):
    torch.manual_seed(7)
    return ht.train(task, devices="cpu", progress=False, **options)[0]


@pytest.mark.parametrize("generators", [1, 2], ids=["loader's", "loader's and sampler's"])
@pytest.mark.parametrize("stop_at", [2, 4, 6], ids=["epoch 1", "epoch boundary", "epoch 2"])
@pytest.mark.parametrize("again", ["fresh objects", "same objects"])
def test_a_resume_reads_the_uninterrupted_runs_order(tmp_path, stop_at, again, generators):
    task, whole = made(generators=generators)
    uninterrupted = train(task)
    task, model = made(stop_at, generators)
    assert train(task, checkpoint_dir=tmp_path).steps == stop_at
    if again == "fresh objects":  # as after a crash: the loader's generators at their seeds again
        task, model = made(generators=generators)
    else:
        task.loss_fn = made()[0].loss_fn  # the same loader, its generators where the first call left them
    resumed = train(task, checkpoint_dir=tmp_path)
    assert resumed.losses == uninterrupted.losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), whole.parameters()))
