"""A task's first batch is read to check it (a Hugging Face model's, when the task is built) and to measure the model
(shards="auto", ht.plan): reading it must leave what training draws as it was. A shuffling DataLoader draws its
order from its own generator or from torch's, so a read that moved either trained on another order than plain
PyTorch's, silently, and the next model built drew other initial weights."""
import copy
import functools
import random

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import hydra_torch as ht
from models import max_relative_error

pytest.importorskip("transformers")
from test_hf_gpt2 import VOCAB, tiny_gpt2  # noqa: E402

EXAMPLES, BATCH, EPOCHS = 16, 4, 2


class LoggedExamples(Dataset):
    """Token sequences that log the order they are read in."""

    def __init__(self):
        self.ids = torch.randint(0, VOCAB, (EXAMPLES, 12), generator=torch.Generator().manual_seed(3))
        self.read = []

    def __len__(self):
        return EXAMPLES

    def __getitem__(self, index):
        self.read.append(index)
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def shuffled(dataset, own_generator: bool, **options):
    generator = torch.Generator().manual_seed(0) if own_generator else None
    return DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator, **options)


def plain_order(own_generator: bool) -> list[int]:
    """The order plain training reads the examples in: its model made as the task's is (tiny_gpt2 seeds torch's
    generator, then draws from it), then its loader."""
    tiny_gpt2(dropout=0.0)
    dataset = LoggedExamples()
    loader = shuffled(dataset, own_generator)
    for _ in range(EPOCHS):
        for _ in loader:
            pass
    return dataset.read


@pytest.mark.parametrize("own_generator", [True, False], ids=["loader-generator", "torch-generator"])
@pytest.mark.parametrize("shards", [2, "auto"])
def test_a_shuffled_loader_trains_in_plain_pytorchs_order(own_generator, shards):
    want = plain_order(own_generator)
    model = tiny_gpt2(dropout=0.0)
    dataset = LoggedExamples()
    loader = shuffled(dataset, own_generator)
    task = ht.ModelTask(model, data=loader, optimizer=ht.optim.AdamW(lr=1e-3), epochs=EPOCHS,
                        shards=shards)
    checked = len(dataset.read)
    result = ht.train(task, devices="cpu", progress=False)[0]
    assert result.ok and result.steps == EPOCHS * EXAMPLES // BATCH
    assert dataset.read[checked:][-len(want):] == want, "the reads that trained are plain training's order"


def test_building_a_task_leaves_every_generator_as_it_was():
    import numpy

    model, dataset = tiny_gpt2(), LoggedExamples()
    loader, eval_loader = shuffled(dataset, own_generator=True), shuffled(LoggedExamples(), own_generator=False)
    states = (torch.get_rng_state(), loader.generator.get_state(), random.getstate(), numpy.random.get_state()[1])
    task = ht.ModelTask(model, data=loader, eval_data=eval_loader, optimizer=ht.optim.AdamW(lr=1e-3))
    assert dataset.read, "its first batch was checked"
    ht.plan(task, "cpu", budget=1 << 30, repeats=1)
    now = (torch.get_rng_state(), loader.generator.get_state(), random.getstate(), numpy.random.get_state()[1])
    assert torch.equal(now[0], states[0]) and torch.equal(now[1], states[1])
    assert now[2] == states[2] and (now[3] == states[3]).all()


def test_the_model_built_after_a_task_is_the_one_built_without_it():
    torch.manual_seed(5)
    tiny_gpt2()
    alone = copy.deepcopy(torch.nn.Linear(8, 8))  # what the next model draws, no task built between
    torch.manual_seed(5)
    ht.ModelTask(tiny_gpt2(), data=shuffled(LoggedExamples(), own_generator=False), optimizer=ht.optim.AdamW(lr=1e-3))
    after = torch.nn.Linear(8, 8)
    assert max_relative_error(after, alone) == 0


def touch(path, worker):
    path.touch()


def test_a_loader_with_workers_starts_none_when_its_task_is_built(tmp_path):
    started = tmp_path / "started"
    loader = shuffled(LoggedExamples(), own_generator=True, num_workers=1,
                      worker_init_fn=functools.partial(touch, started))
    task = ht.ModelTask(tiny_gpt2(), data=loader, optimizer=ht.optim.AdamW(lr=1e-3), max_steps=2)
    assert not started.exists(), "a worker process started only to check one batch"
    assert ht.train(task, devices="cpu", progress=False)[0].steps == 2
    assert started.exists()
