"""The default causal-LM loss computes the LM head chunk by chunk: the same loss and gradients as the plain one."""
import pytest
import torch
import torch.nn.functional as F

import hydra_torch as ht
from hydra_torch.models.hf import causal_lm

pytest.importorskip("transformers")
from test_hf_gpt2 import VOCAB, batches, relative_errors, tiny_gpt2, train_reference  # noqa: E402
from test_hf_llama import tiny_llama  # noqa: E402


def plain_loss(hidden, weight, bias, labels):
    """The loss as it was computed before the fused head: whole logits, sliced, cross-entropy's mean."""
    logits = F.linear(hidden, weight, bias)
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=causal_lm.IGNORE_INDEX)


def relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def leaves(with_bias, seed=0, batch=3, seq=17, width=24, vocab=101):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, width, generator=g, requires_grad=True)
    weight = torch.randn(vocab, width, generator=g).mul_(0.3).requires_grad_()
    bias = torch.randn(vocab, generator=g).requires_grad_() if with_bias else None
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[torch.rand(batch, seq, generator=g) < 0.3] = causal_lm.IGNORE_INDEX
    return hidden, weight, bias, labels


def grads(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("rows", [7, 1, 10_000])  # 8 chunks (the last one short), one token a chunk, one chunk
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_loss_and_gradients_equal_the_plain_ones(monkeypatch, rows, with_bias):
    hidden, weight, bias, labels = leaves(with_bias)
    monkeypatch.setattr(causal_lm, "CHUNK_BYTES", rows * 4 * weight.shape[0])
    expected = plain_loss(hidden, weight, bias, labels)
    fused = causal_lm.causal_lm_loss(causal_lm.HeadOutput(hidden, weight, bias), {"labels": labels})
    assert relative(fused, expected) <= 1e-6
    for ours, theirs in zip(grads(fused, (hidden, weight, bias)), grads(expected, (hidden, weight, bias))):
        assert relative(ours, theirs) <= 1e-6


def test_logits_loss_equals_the_sliced_one():
    hidden, weight, bias, labels = leaves(True)
    logits = F.linear(hidden, weight, bias)
    assert relative(causal_lm.causal_lm_loss(logits, {"labels": labels}), plain_loss(hidden, weight, bias, labels)) \
        <= 1e-6


def test_every_label_ignored_gives_nan_as_plain_cross_entropy(monkeypatch):
    hidden, weight, bias, labels = leaves(False)
    labels[:] = causal_lm.IGNORE_INDEX
    monkeypatch.setattr(causal_lm, "CHUNK_BYTES", 7 * 4 * weight.shape[0])
    assert plain_loss(hidden, weight, bias, labels).isnan()
    assert causal_lm.causal_lm_loss(causal_lm.HeadOutput(hidden, weight, bias), {"labels": labels}).isnan()


def test_only_the_default_loss_fuses_the_head():
    model = tiny_gpt2()
    data = batches(1)
    assert isinstance(ht.ModelTask(model, data=data).pieces[-1](model_inputs(model, data[0])), causal_lm.HeadOutput)
    user = ht.ModelTask(model, data=data, loss_fn=causal_lm.causal_lm_loss)
    assert user.pieces[-1](model_inputs(model, data[0])).shape == (2, 16, VOCAB)


def model_inputs(model, batch):
    return (model.transformer(batch["input_ids"]).last_hidden_state,)


def with_labels_ignored(data):
    """Padding-like -100 labels at the end of every second row."""
    for batch in data:
        batch["labels"][1, -5:] = causal_lm.IGNORE_INDEX
    return data


# SGD shows the gradients' agreement as it is; Adam, dividing by the root of the second moment, scales up where
# a chunked sum's other order rounds a near-zero gradient otherwise, hence the tolerance of the other HF tests.
@pytest.mark.parametrize("kind, tolerance", [("sgd", 1e-6), ("adamw", 1e-5)])
def test_gpt2_trained_with_several_chunks_matches_plain_training(monkeypatch, kind, tolerance):
    monkeypatch.setattr(causal_lm, "CHUNK_BYTES", 5 * 4 * VOCAB)  # 32 tokens a batch: 7 chunks
    data = with_labels_ignored(batches(6))
    ours, theirs = {"sgd": (ht.optim.SGD(lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1)),
                    "adamw": (ht.optim.AdamW(lr=1e-3), lambda ps: torch.optim.AdamW(ps, lr=1e-3))}[kind]
    reference = tiny_gpt2()
    train_reference(reference, data, theirs, seed=7)
    model = tiny_gpt2()
    torch.manual_seed(7)
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ours, shards=2)],
                      devices="cpu", memory_budget="1GiB", progress=False)[0]
    assert result.ok
    errors = relative_errors(model, reference, skip_key_bias=kind == "adamw")
    assert max(errors.values()) <= tolerance, {k: v for k, v in errors.items() if v > tolerance}
    assert model.lm_head.weight is model.transformer.wte.weight, "wte and lm_head are still tied"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_default_loss_trains_and_evaluates_as_a_user_loss_on_logits(monkeypatch, precision):
    """The fused default loss against the same loss given by the user, who receives the logits (fp32 ones for
    a bf16 model, as before). SGD, since Adam would scale the rounding of bf16's near-zero gradients up to
    lr-sized steps."""
    monkeypatch.setattr(causal_lm, "CHUNK_BYTES", 5 * 4 * VOCAB)
    seen = []

    def user_loss(output, batch):
        seen.append((type(output), tuple(output.shape), output.dtype))
        return causal_lm.causal_lm_loss(output, batch)

    data, eval_data = with_labels_ignored(batches(4)), batches(2, seed=1)
    results, models = [], []
    for loss_fn in (None, user_loss):
        models.append(tiny_llama(tie=True))
        results.append(ht.train([ht.ModelTask(models[-1], data=data, loss_fn=loss_fn, precision=precision,
                                              optimizer=ht.optim.SGD(lr=0.1), eval_data=eval_data, eval_every=2,
                                              shards=2)],
                                devices="cpu", memory_budget="1GiB", progress=False)[0])
    assert all(r.ok for r in results)
    assert set(seen) == {(torch.Tensor, (2, 16, VOCAB), torch.float32)}
    # bf16: each chunk's head gradient is rounded to bf16 before its fp32 sum, the plain one once: about one
    # bf16 ulp (2**-8) apart after the steps.
    tolerance = 1e-5 if precision == "fp32" else 4e-3
    fused, user = results
    assert max(abs(a - b) / abs(b) for a, b in zip(fused.losses, user.losses)) <= tolerance
    assert max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(fused.eval_losses, user.eval_losses)) <= tolerance
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert relative(a.detach().float(), b.detach().float()) <= tolerance, name
