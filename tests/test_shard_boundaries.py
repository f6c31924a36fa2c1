"""What a shard hands on, reads and changes, against the recompute of a spilled shard's forward in its backward.

A spilled shard's forward runs twice: without gradients, then again from its saved input in its backward. What it
read must be what it reads again (a buffer it reads and then updates, as spectral_norm's power iteration does,
was read updated the second time, silently), and what it hands on must be what later shards can take: an object
that is not a pytree node hid its tensors from the gradient, a parameter handed on pointed into device memory
the next shards reuse, an input changed in place was the saved input changed. Those are refused by name before
any step, as is an embedding whose forward renormalises its weight in place (max_norm)."""
import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydra_torch as ht
from models import max_relative_error

SEED = 123


def batches(count=4, rows=8, width=8, classes=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, width, generator=g), torch.randint(0, classes, (rows,), generator=g))
            for _ in range(count)]


def ce(out, batch):
    return F.cross_entropy(out, batch[1])


def plain(model, data):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    torch.manual_seed(SEED)
    for batch in data:
        optimizer.zero_grad()
        ce(model(batch[0]), batch).backward()
        optimizer.step()


def spilled(model, data, **options):
    torch.manual_seed(SEED)
    task = ht.ModelTask(model, data=data, loss_fn=ce, inputs=lambda b: b[0], optimizer=ht.optim.AdamW(
        lr=1e-2, weight_decay=0.01), **options)
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, False)
    budget = ht._C.DeviceEngine.spilled_need(store) + 1024  # one shard on the device at a time
    return ht.train(task, devices="cpu", memory_budget=budget, placement="host", progress=False)[0]


class ReadsThenDoubles(nn.Module):
    """Reads its buffer, then updates it in place, as a power iteration does."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        y = torch.tanh(self.lin(x) * self.scale.clone())
        self.scale.mul_(2)
        return y


@pytest.mark.parametrize("middle", ["reads then doubles", "spectral_norm"])
def test_a_buffer_a_shard_reads_then_updates_is_read_in_the_recompute_as_its_forward_read_it(middle):
    def make():
        torch.manual_seed(0)
        inner = ReadsThenDoubles() if middle == "reads then doubles" else \
            nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        return nn.Sequential(nn.Linear(8, 8), inner, nn.Tanh(), nn.Linear(8, 4))
    data, reference, model = batches(), make(), make()
    plain(reference, data)
    result = spilled(model, data)
    assert result.ok and not result.resident, result.error
    assert max_relative_error(model, reference) <= 1e-5
    # Updated once a batch (the power iteration's vectors to rounding: they follow the weights).
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(model.buffers(), reference.buffers()))


@dataclasses.dataclass
class Hidden:
    h: torch.Tensor


class Handing(nn.Module):
    def __init__(self, hand):
        super().__init__()
        self.lin, self.hand = nn.Linear(8, 8), hand

    def forward(self, x):
        return self.hand(self, torch.tanh(self.lin(x[0] if isinstance(x, tuple) else x)))


class Taking(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        if isinstance(x, Hidden):
            return self.lin(x.h)
        h, weight = x
        return self.lin(h) + F.linear(h, weight)[:, :4]


@pytest.mark.parametrize("hand, says", [
    (lambda module, h: Hidden(h), "hands on a Hidden, which holds tensors but is no pytree node"),
    (lambda module, h: (h, module.lin.weight), "hands on its own parameter"),
    (lambda module, h: (h, module.lin.weight[:8]), "hands on its own parameter"),
], ids=["dataclass", "parameter", "a view of a parameter"])
def test_what_a_shard_hands_on_that_later_shards_cannot_take_is_refused_before_any_step(hand, says):
    model = nn.Sequential(nn.Linear(8, 8), Handing(hand), Taking())
    before = [p.detach().clone() for p in model.parameters()]
    result = spilled(model, batches())
    assert not result.ok and says in str(result.error) and "shard 1" in str(result.error), result.error
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "no step taken"


@pytest.mark.parametrize("inplace", [nn.ReLU(inplace=True), nn.Hardtanh(inplace=True)], ids=["ReLU", "Hardtanh"])
def test_a_shard_that_changes_its_input_in_place_is_refused_by_name_before_any_step(inplace):
    model = nn.Sequential(nn.Linear(8, 8), inplace, nn.Linear(8, 4))
    before = [p.detach().clone() for p in model.parameters()]
    result = spilled(model, batches())
    assert not result.ok and "shard 1 changes its input in place" in str(result.error), result.error
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before)), "no step taken"
    # Cut elsewhere, it trains as plain PyTorch does.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 4))
    reference, data = copy.deepcopy(model), batches()
    plain(reference, data)
    assert spilled(model, data, shards=[0, 2]).ok
    assert max_relative_error(model, reference) <= 1e-5


def test_an_embedding_that_renormalises_its_weight_in_place_is_refused():
    with pytest.raises(ValueError, match=r"renormalises its weight in place .*max_norm=1.0"):
        ht.ModelTask(nn.Sequential(nn.Embedding(10, 8, max_norm=1.0), nn.Linear(8, 4)), data=batches(),
                     loss_fn=ce)
