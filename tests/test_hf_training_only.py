"""What a decoder's forward does in training alone (dropout on its embeddings, say) is invisible to the self-check
of an untested family in eval mode: a family outside decoder.TESTED is checked in training mode too, and
Starcoder2's embedding dropout (a number its forward reads, not a module) trains as its own forward applies it."""
import pytest
import torch

import hydra_torch as ht

transformers = pytest.importorskip("transformers")
from hydra_torch.models.hf import adapt, decoder  # noqa: E402
from test_hf_decoders import VOCAB, max_relative_error, padded_batches, tiny, train_plainly  # noqa: E402


def starcoder2(embedding_dropout: float, seed: int = 0):
    config = transformers.Starcoder2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                           embedding_dropout=embedding_dropout, residual_dropout=0.0,
                                           attention_dropout=0.0)
    torch.manual_seed(seed)
    return transformers.Starcoder2ForCausalLM(config).train()


@pytest.mark.parametrize("shards", [1, 3])
def test_starcoder2s_embedding_dropout_trains_as_plain_training_and_evaluates_without_it(shards):
    data, held_out = padded_batches(), padded_batches(1, seed=9)
    reference, model = starcoder2(0.3), starcoder2(0.3)
    train_plainly(reference, data, seed=5)
    task = ht.ModelTask(model, data=data, eval_data=held_out, optimizer=ht.optim.AdamW(lr=1e-3), shards=shards)
    torch.manual_seed(5)
    result = ht.train(task, devices="cpu", progress=False)[0]
    assert result.ok and result.steps == len(data)
    errors = max_relative_error(model, reference)
    assert max(errors.values()) <= 1e-5, sorted(errors.items(), key=lambda e: -e[1])[:3]
    with torch.no_grad():
        plain_eval = reference.eval()(**held_out[0]).loss.item()
    assert result.eval_losses[-1][1] == pytest.approx(plain_eval, rel=1e-5)
    assert model.training, "the model's mode is as it was"


def _scaled_in_training(forward):
    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            out.logits = out.logits * 2.0
        return out

    return scaled


def test_an_untested_familys_training_only_work_the_adapter_does_not_know_is_refused(monkeypatch):
    model = tiny("llama")
    monkeypatch.setattr(decoder, "TESTED", ())
    assert adapt(model) is not None
    monkeypatch.setattr(type(model), "forward", _scaled_in_training(type(model).forward))
    with pytest.raises(TypeError, match="in training mode"):
        adapt(model)
    assert model.training, "the model's modes are as they were"
