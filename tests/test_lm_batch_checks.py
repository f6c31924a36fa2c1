"""A language model's batches are checked before they reach a device, each as it is drawn: a label or token id
outside the vocabulary fails as an index error on the CPU, and on CUDA as a device-side assert that ends every task
of the process."""
import re

import pytest
import torch

import hydra_torch as ht

pytest.importorskip("transformers")
from test_hf_gpt2 import VOCAB, batches, tiny_gpt2  # noqa: E402


def with_labels(batch, change):
    labels = batch["labels"].clone()
    change(labels)
    return dict(batch, labels=labels)


def set_one(value):
    def change(labels):
        labels[0, 3] = value
    return change


@pytest.mark.parametrize("value", [VOCAB, -5, -101])
def test_a_label_outside_the_vocabulary_is_refused_when_the_task_is_built(value):
    data = [with_labels(batches(1)[0], set_one(value))]
    with pytest.raises(ValueError, match=rf"labels must lie in \[0, {VOCAB}\) or be -100 \(ignored\); found "):
        ht.ModelTask(tiny_gpt2(), data=data)
    with pytest.raises(ValueError, match=r"eval_data: labels must lie in"):
        ht.ModelTask(tiny_gpt2(), data=batches(1), eval_data=data)


@pytest.mark.parametrize("labels, match", [(lambda ids: ids.float(), "torch.float32"),
                                           (lambda ids: ids.tolist(), "list")])
def test_labels_that_are_no_integer_tensor_are_refused_by_name(labels, match):
    batch = batches(1)[0]
    with pytest.raises(ValueError, match=rf"labels must be an int64 \(or int32\) tensor .*{match}"):
        ht.ModelTask(tiny_gpt2(), data=[dict(batch, labels=labels(batch["labels"]))])


def test_int32_labels_train_as_int64_ones():
    data = batches(3)
    models = [tiny_gpt2(dropout=0.0), tiny_gpt2(dropout=0.0)]
    tasks = [ht.ModelTask(models[0], data=data, name="int64"),
             ht.ModelTask(models[1], data=[dict(b, labels=b["labels"].int()) for b in data], name="int32")]
    results = ht.train(tasks, devices="cpu", progress=False)
    assert all(r.error is None for r in results) and results[0].losses == results[1].losses
    assert all(torch.equal(a, b) for a, b in zip(*(m.parameters() for m in models)))


@pytest.mark.parametrize("field, change, match", [
    ("labels", set_one(VOCAB), "labels must lie in"),
    ("input_ids", set_one(VOCAB), "token ids must lie in"),
])
def test_a_later_bad_batch_stops_its_task_before_reaching_the_device(field, change, match):
    data = batches(4)
    values = data[2][field].clone()
    change(values)
    data[2] = dict(data[2], **{field: values})
    model, other = tiny_gpt2(dropout=0.0), tiny_gpt2(dropout=0.0)
    tasks = [ht.ModelTask(model, data=data, name="bad"), ht.ModelTask(other, data=batches(4), name="good")]
    with pytest.warns(RuntimeWarning, match="stopped"):
        bad, good = ht.train(tasks, devices="cpu", progress=False)
    assert isinstance(bad.error, ValueError) and match in str(bad.error), repr(bad.error)
    assert bad.steps == 2 and good.error is None and good.steps == 4
    reference = tiny_gpt2(dropout=0.0)
    ht.train([ht.ModelTask(reference, data=data[:2])], devices="cpu", progress=False)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters())), \
        "the weights of the last completed step are kept"


def test_a_later_bad_validation_batch_fails_its_evaluation_by_name():
    eval_data = batches(3, seed=1)
    eval_data[1] = with_labels(eval_data[1], set_one(VOCAB))
    task = ht.ModelTask(tiny_gpt2(dropout=0.0), data=batches(2), eval_data=eval_data)
    with pytest.warns(RuntimeWarning, match="stopped"):
        result = ht.train([task], devices="cpu", progress=False)[0]
    assert isinstance(result.error, ValueError) and "labels must lie in" in str(result.error), repr(result.error)


def test_a_batch_whose_loss_has_no_label_is_refused_by_name():
    # Its loss is 0 / 0 = nan, as plain PyTorch's: the task stopped on a nan loss, without saying why.
    batch = batches(1)[0]
    labels = batch["labels"].clone()
    labels[:, 1:] = -100  # the first position's label is never predicted (the loss shifts the labels)
    with pytest.raises(ValueError, match=r"every label the loss uses \(labels\[:, 1:\]\) is -100"):
        ht.ModelTask(tiny_gpt2(), data=[dict(batch, labels=labels)])
    for shape in ((2, 1), (0, 8)):  # one token, or no row: nothing to predict
        ids = torch.zeros(shape, dtype=torch.long)
        with pytest.raises(ValueError, match=re.escape(f"input_ids {shape} leave no token to predict: the batch's")):
            ht.ModelTask(tiny_gpt2(), data=[{"input_ids": ids, "labels": ids}])


def test_with_a_loss_of_its_own_a_batch_needs_no_labels_and_its_labels_are_the_losss():
    # A loss_fn of the user's (distillation, targets under another name, soft labels) takes the logits: batches
    # without labels, or with labels no causal-LM loss could take, were refused as "not a language-model batch".
    g = torch.Generator().manual_seed(0)
    data = [dict(input_ids=b["input_ids"], target=b["labels"], labels=torch.rand(*b["input_ids"].shape, VOCAB,
                                                                                generator=g)) for b in batches(3)]

    def loss_fn(logits, batch):
        hard = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["target"][:, 1:].reshape(-1))
        return hard + 0.1 * torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                              batch["labels"].reshape(-1, VOCAB))

    model, reference = tiny_gpt2(dropout=0.0), tiny_gpt2(dropout=0.0)
    unlabelled = [{key: b[key] for key in ("input_ids", "target")} for b in data]
    assert ht.ModelTask(tiny_gpt2(), data=unlabelled, loss_fn=lambda logits, batch: logits.sum()) is not None
    task = ht.ModelTask(model, data=data, eval_data=data[:1], loss_fn=loss_fn, optimizer=ht.optim.SGD(lr=0.1))
    result = ht.train([task], devices="cpu", progress=False)[0]
    assert result.error is None and result.steps == 3 and result.eval_losses
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in data:
        optimizer.zero_grad()
        loss_fn(reference(input_ids=batch["input_ids"]).logits, batch).backward()
        optimizer.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"token ids must lie in"):  # what the model takes is still checked
        ht.ModelTask(tiny_gpt2(), data=[dict(unlabelled[0], input_ids=unlabelled[0]["input_ids"] + VOCAB)],
                     loss_fn=loss_fn)


@pytest.mark.parametrize("inputs", [lambda batch: batch["input_ids"], lambda batch: (batch["input_ids"], None, None)])
def test_inputs_of_ones_own_for_a_hugging_face_model_are_refused_by_name(inputs):
    # Its first shard takes what the adapter reads from the batch dict: another input failed mid-run with
    # "not enough values to unpack (expected 4, got 2)".
    with pytest.raises(TypeError, match=r"inputs= is for models cut by hand: a GPT2LMHeadModel takes its inputs from "
                                        r"the batch's 'input_ids', 'attention_mask' and 'position_ids'"):
        ht.ModelTask(tiny_gpt2(), data=batches(1), inputs=inputs)


@pytest.mark.parametrize("example", [lambda ids: ids, lambda ids: ids.tolist()])
def test_a_dataset_of_examples_passed_as_data_is_told_to_batch_them(example):
    # A tokenized datasets.Dataset (or a list of examples) passed as data: each item is one example, 1-d.
    ids = torch.arange(8)
    with pytest.raises(ValueError, match=r"input_ids must be an int64 \(or int32\) tensor .*each item of data is "
                                         r"one batch, not one example: batch the examples with a DataLoader"):
        ht.ModelTask(tiny_gpt2(), data=[{"input_ids": example(ids), "labels": example(ids)}] * 2)


@pytest.mark.parametrize("field", ["input_ids", "labels", "attention_mask", "token_type_ids"])
@pytest.mark.parametrize("form, named", [(lambda t: t.numpy(), r"a NumPy array \(2, 16\) int64"),
                                         (lambda t: t.tolist(), "a list")])
def test_a_tokenizers_output_without_tensors_is_told_to_ask_for_them(field, form, named):
    # return_tensors="np", or none: the message read "must be a 2-d integer tensor, got (2, 16) int64".
    batch = dict(batches(1)[0], attention_mask=torch.ones(2, 16, dtype=torch.long),
                 token_type_ids=torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=rf"{field} must be .*, got {named}: give the batch torch tensors "
                                         r"\(a tokenizer's return_tensors='pt', or a DataLoader's collator\)"):
        ht.ModelTask(tiny_gpt2(), data=[dict(batch, **{field: form(batch[field])})])


@pytest.mark.parametrize("data, got", [
    (lambda b: [(b["input_ids"], b["labels"])], r"got a tuple"),
    (lambda b: b["input_ids"], r"got \(16,\) torch.int64"),  # a tensor's rows taken as batches
    (lambda b: [{"input_ids": b["input_ids"]}], r"got a dict of 'input_ids'"),
])
def test_a_batch_that_is_no_language_model_batch_is_named(data, got):
    with pytest.raises(KeyError, match=rf"a language-model batch is a dict with 'input_ids' and 'labels' .*; {got}"):
        ht.ModelTask(tiny_gpt2(), data=data(batches(1)[0]))


def test_a_dataset_of_examples_is_told_to_be_batched_by_a_data_loader():
    class Examples(torch.utils.data.Dataset):  # map-style: sized, iterable only through __getitem__
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return batches(1)[0]

    with pytest.raises(TypeError, match=r"data is a Dataset \(Examples\): batch its examples with a DataLoader"):
        ht.ModelTask(tiny_gpt2(), data=Examples())


@pytest.mark.parametrize("field", ["input_ids", "labels", "token_type_ids", "position_ids"])
@pytest.mark.parametrize("dtype", [torch.int16, torch.uint8, torch.float32])
def test_ids_of_a_dtype_no_embedding_takes_are_refused_naming_the_ones_it_does(field, dtype):
    # An int16 id was "must be an integer tensor, got ... torch.int16"; a float position id of a model with learned
    # positions (GPT-2) failed mid-run in the embedding's lookup.
    batch = dict(batches(1)[0], token_type_ids=torch.zeros(2, 16, dtype=torch.long),
                 position_ids=torch.arange(16).unsqueeze(0))
    with pytest.raises(ValueError, match=rf"{field} must be .*an int64 \(or int32\) tensor.*, got .*{dtype}"):
        ht.ModelTask(tiny_gpt2(), data=[dict(batch, **{field: batch[field].to(dtype)})])
