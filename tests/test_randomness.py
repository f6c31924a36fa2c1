"""Every task draws from random streams of its own: dropout masks and shuffled data orders are those it would
draw training alone from the same seed, whichever devices run it and whatever trains beside it."""
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import hydra_torch as ht
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches

SEED = 7
BUDGET = int(0.45 * model_bytes(tied_transformer()))


class LoggedTokens(Dataset):
    """Token sequences that record the order they are read in."""

    def __init__(self, count: int, seed: int):
        self.items = [(x[0], y[0]) for x, y in token_batches(count, batch=1, seed=seed)]
        self.read = []

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        self.read.append(i)
        return self.items[i]


def dropout_task(index: int):
    model = tied_transformer(seed=index, dropout=0.2)
    data = LoggedTokens(16, seed=index + 1)
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=3e-3), loss_fn=lm_loss, epochs=2, name=f"task{index}",
                        data=DataLoader(data, batch_size=4, shuffle=True))
    return task, model, data


def train(indices, devices):
    made = [dropout_task(i) for i in indices]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each virtual CPU device has: the same kernels, the same rounding
    torch.manual_seed(SEED)
    try:
        results = ht.train([t for t, _, _ in made], devices=devices, memory_budget=BUDGET, progress=False)
    finally:
        torch.set_num_threads(threads)
    assert all(r.ok for r in results), [r.error for r in results]
    return results, [m for _, m, _ in made], [d.read for _, _, d in made]


def test_a_dropout_task_beside_others_on_two_devices_draws_as_if_alone():
    alone, (alone_model,), (alone_order,) = train([0], ["cpu"])
    # Which device takes which unit is the devices' timing: on a busy machine one may keep task 0 throughout, so
    # the run is repeated (each as deterministic as the others) until task 0 has moved.
    for _ in range(5):
        together, models, orders = train([0, 1, 2, 3], ["cpu", "cpu"])
        if len({e.device for e in together.trace if e.task == 0}) == 2:
            break
    assert len({e.device for e in together.trace if e.task == 0}) == 2, "task 0 never ran on both devices"
    assert together[0].losses == alone[0].losses
    assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), alone_model.parameters()))
    assert orders[0] == alone_order
    assert sorted(alone_order[:16]) == list(range(16)) and alone_order[:16] != alone_order[16:], \
        "each epoch is a new permutation"
    again, models_again, orders_again = train([0, 1, 2, 3], ["cpu", "cpu"])
    assert orders_again == orders
    for a, b in zip(together, again):
        assert a.losses == b.losses, "the same run twice is bit-identical"
    for model, model_again in zip(models, models_again):
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model_again.parameters()))


def test_dropout_and_shuffling_match_plain_pytorch():
    _, (model,), (order,) = train([0], ["cpu"])
    reference, reference_data = tied_transformer(seed=0, dropout=0.2), LoggedTokens(16, seed=1)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3)
    torch.manual_seed(SEED)
    for _ in range(2):
        for batch in DataLoader(reference_data, batch_size=4, shuffle=True):
            optimizer.zero_grad()
            lm_loss(reference(batch[0]), batch).backward()
            optimizer.step()
    assert order == reference_data.read
    assert max_relative_error(model, reference) <= 1e-5


class SometimesRandom(torch.nn.Module):
    """Draws from the CPU generator from its 4th call on: not on the visit that classifies it."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + 1e-3 * torch.randn_like(x) if self.calls > 3 else x


def test_a_shard_that_starts_drawing_late_is_noticed():
    model = tied_transformer(dropout=0.0)
    model.insert(2, SometimesRandom())
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=token_batches(8),
                        shards=6)
    with pytest.warns(RuntimeWarning, match="drew from the CPU random generator on some of its runs only"):
        result = ht.train([task], devices="cpu", memory_budget=BUDGET, progress=False)[0]
    assert result.ok and result.steps == 8
