"""Hugging Face Llama passed as it is: trained through hydra-torch exactly as plain PyTorch trains it."""
import pytest
import torch

import hydra_torch as ht

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

VOCAB = 96


def tiny_llama(tie: bool):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tie))


def batches(count=6, seq=16):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (2, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_spilled_llama_matches_plain_training(tie, kind):
    ours = {"adamw": ht.optim.AdamW(lr=1e-3), "sgd": ht.optim.SGD(lr=0.1, momentum=0.9)}[kind]
    theirs = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[kind]
    data = batches()
    reference = tiny_llama(tie)
    optimizer = theirs(reference.parameters())
    for batch in data:
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    model = tiny_llama(tie)
    weights = sum(p.numel() * 4 for p in model.parameters())
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ours)], devices="cpu",
                      memory_budget=int(0.8 * weights), progress=False)[0]
    assert result.ok and not result.resident and max(result.shard_loads) > 1
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5, name
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 6)


def test_llama_batch_checks():
    model = tiny_llama(False)
    with pytest.raises(ValueError, match="tokenizer"):
        ids = torch.full((2, 8), VOCAB, dtype=torch.long)
        ht.ModelTask(model, data=[{"input_ids": ids, "labels": ids}])
