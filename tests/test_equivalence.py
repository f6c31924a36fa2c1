"""Training through hydra-torch must be plain PyTorch training, to float rounding: same model, data, seed."""
import pytest
import torch

import hydra_torch as ht
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain

STEPS = 20
SEED = 123


def train_hydra(model, data, optimizer, budget, **task_options):
    torch.manual_seed(SEED)
    task = ht.ModelTask(model, optimizer=optimizer, loss_fn=lm_loss, data=data, **task_options)
    results = ht.train([task], devices="cpu", memory_budget=budget)
    assert results[0].error is None, results[0].error
    return results


OPTIMIZERS = {
    "adamw": (lambda: ht.optim.AdamW(lr=3e-3, weight_decay=0.05),
              lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05)),
    "adam_l2": (lambda: ht.optim.Adam(lr=2e-3, betas=(0.8, 0.99), weight_decay=0.01),
                lambda params: torch.optim.Adam(params, lr=2e-3, betas=(0.8, 0.99), weight_decay=0.01)),
    "sgd_momentum": (lambda: ht.optim.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
                     lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3)),
    "sgd_nesterov": (lambda: ht.optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
                     lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_spilled_matches_plain_pytorch(name):
    ours, theirs = OPTIMIZERS[name]
    data = token_batches(STEPS)
    reference = tied_transformer()
    reference_losses = train_plain(reference, data, theirs, seed=SEED)
    model = tied_transformer()
    budget = int(0.4 * model_bytes(model))
    results = train_hydra(model, data, ours(), budget)
    result = results[0]
    assert not result.resident
    assert max(result.shard_loads) > 1, "a 40% budget must force shards to be copied in more than once"
    assert model[0].weight is model[-1].weight, "the tie between embedding and head must survive training"
    assert max_relative_error(model, reference) <= 1e-5
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert results.stats[0]["high_water_bytes"] <= budget


def test_resident_matches_plain_pytorch():
    ours, theirs = OPTIMIZERS["adamw"]
    data = token_batches(STEPS)
    reference = tied_transformer()
    train_plain(reference, data, theirs, seed=SEED)
    model = tied_transformer()
    result = train_hydra(model, data, ours(), 10 * 2**20)[0]
    assert result.resident
    assert max_relative_error(model, reference) <= 1e-5
    assert model[0].weight is model[-1].weight


@pytest.mark.parametrize("budget_fraction", [0.4, 100.0])
def test_gradient_accumulation_matches_loss_averaging(budget_fraction):
    ours, theirs = OPTIMIZERS["adamw"]
    data = token_batches(12)
    reference = tied_transformer()
    reference_losses = train_plain(reference, data, theirs, accumulate=3, seed=SEED)
    model = tied_transformer()
    result = train_hydra(model, data, ours(), int(budget_fraction * model_bytes(model)), accumulate=3)[0]
    assert result.steps == 4
    assert result.losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5


@pytest.mark.parametrize("budget_fraction", [0.4, 100.0])
def test_global_norm_clipping_matches_clip_grad_norm(budget_fraction):
    ours, theirs = OPTIMIZERS["sgd_momentum"]
    data = token_batches(10)
    reference = tied_transformer()
    train_plain(reference, data, theirs, clip=0.5, seed=SEED)
    model = tied_transformer()
    train_hydra(model, data, ours(), int(budget_fraction * model_bytes(model)), clip_grad_norm=0.5)
    assert max_relative_error(model, reference) <= 1e-5


def test_explicit_shards_and_frozen_layer():
    """Explicit boundaries, and a frozen layer that must neither change nor decay."""
    ours, theirs = OPTIMIZERS["adamw"]
    data = token_batches(8)
    reference, model = tied_transformer(), tied_transformer()
    for m in (reference, model):
        m[6].requires_grad_(False)  # the final LayerNorm
    train_plain(reference, data, lambda ps: theirs([p for p in ps if p.requires_grad]), seed=SEED)
    frozen_before = model[6].weight.detach().clone()
    train_hydra(model, data, ours(), int(0.9 * model_bytes(model)), shards=[0, 1, 3, 5, 6])
    assert torch.equal(model[6].weight, frozen_before)
    assert max_relative_error(model, reference) <= 1e-5


def test_bf16_tracks_fp32():
    """bf16 weights on the device, fp32 master and optimizer state: the loss curve stays within 5% of fp32."""
    data = token_batches(STEPS)
    fp32, bf16 = tied_transformer(dropout=0.0), tied_transformer(dropout=0.0)
    budget = int(0.5 * model_bytes(fp32))
    loss32 = train_hydra(fp32, data, ht.optim.AdamW(lr=3e-3), budget)[0].losses
    result = train_hydra(bf16, data, ht.optim.AdamW(lr=3e-3), budget, precision="bf16")[0]
    loss16 = result.losses
    assert loss16[-1] < loss16[0]
    relative = [abs(a - b) / a for a, b in zip(loss32, loss16)]
    assert max(relative) <= 0.05, relative
    assert all(p.dtype == torch.float32 for p in bf16.parameters()), "weights come back in their own dtype"
    assert bf16[0].weight is bf16[-1].weight


@pytest.mark.parametrize("spilled", [True, False])
def test_batchnorm_statistics_update_once_per_batch(spilled):
    """Spilled shards re-run their forward in backward; running statistics must still move once per batch."""
    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))

    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)) for _ in range(4)]
    mse = lambda out, batch: torch.nn.functional.mse_loss(out, batch[1])  # noqa: E731
    reference = make()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in data:
        optimizer.zero_grad()
        mse(reference(x), (x, y)).backward()
        optimizer.step()
    model = make()
    task = ht.ModelTask(model, loss_fn=mse, data=data, optimizer=ht.optim.SGD(lr=0.1))
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, False)
    budget = ht._C.DeviceEngine.spilled_need(store) + 1024 if spilled else 100 * model_bytes(model)
    result = ht.train([task], devices="cpu", memory_budget=budget, progress=False)[0]
    assert result.ok and result.resident == (not spilled)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-7), name
