"""Batches that are mappings but not dicts, as Hugging Face's tokenizers and data collators return them
(transformers.BatchEncoding, a UserDict): taken as dict batches are, moved to the device with their tensors."""
import collections

import pytest
import torch
from torch import nn

import hydra_torch as ht
from hydra_torch.models.batch_tree import to_device

transformers = pytest.importorskip("transformers")
from test_hf_gpt2 import batches, relative_errors, tiny_gpt2, train_reference, weight_bytes  # noqa: E402


def encodings(data):
    return [transformers.BatchEncoding(dict(batch, attention_mask=torch.ones_like(batch["input_ids"])))
            for batch in data]


def test_a_gpt2_trained_on_batch_encodings_equals_plain_pytorch():
    # They were refused as "a language-model batch is a dict with 'input_ids' and 'labels'", and moved to no device.
    data = encodings(batches(4))
    reference = tiny_gpt2()
    train_reference(reference, data, lambda params: torch.optim.AdamW(params, lr=1e-3), seed=7)
    model = tiny_gpt2()
    torch.manual_seed(7)
    task = ht.ModelTask(model, data=data, eval_data=data[:2], optimizer=ht.optim.AdamW(lr=1e-3))
    result = ht.train([task], devices="cpu", memory_budget=int(0.6 * weight_bytes(model)), progress=False)[0]
    assert result.error is None and not result.resident and len(result.losses) == 4 and result.eval_losses
    errors = relative_errors(model, reference, skip_key_bias=True)
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


def test_a_batch_encoding_that_is_no_language_model_batch_is_refused_by_name():
    model = tiny_gpt2()
    bad = transformers.BatchEncoding({"input_ids": batches(1)[0]["input_ids"]})  # no labels
    with pytest.raises(KeyError, match="'labels'"):
        ht.ModelTask(model, data=[bad])


def test_to_device_moves_the_tensors_of_a_mapping_that_is_not_a_dict_and_keeps_its_type():
    ids = torch.arange(6).view(2, 3)
    for batch in (transformers.BatchEncoding({"input_ids": ids, "labels": [ids]}),
                  collections.UserDict({"input_ids": ids, "n": 3})):
        moved = to_device(batch, "meta")
        assert type(moved) is type(batch) and moved is not batch
        assert moved["input_ids"].device.type == "meta"
        assert batch["input_ids"].device.type == "cpu"  # the batch itself is left as it was
    assert to_device(transformers.BatchEncoding({"labels": [ids]}), "meta")["labels"][0].device.type == "meta"


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.embed(ids))


def test_a_sequential_model_takes_a_user_dict_batch_by_its_input_ids():
    g = torch.Generator().manual_seed(0)
    data = [collections.UserDict(input_ids=torch.randint(0, 16, (2, 5), generator=g),
                                 target=torch.randint(0, 16, (2, 5), generator=g)) for _ in range(3)]

    def loss_fn(out, batch):
        return nn.functional.cross_entropy(out.reshape(-1, 16), batch["target"].reshape(-1))

    model, reference = Lookup(), Lookup()
    task = ht.ModelTask(nn.Sequential(model.embed, model.head), data=data, loss_fn=loss_fn,
                        optimizer=ht.optim.SGD(lr=0.1))
    assert ht.train([task], devices="cpu", progress=False)[task.name].error is None
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in data:
        optimizer.zero_grad()
        loss_fn(reference(batch["input_ids"]), batch).backward()
        optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
