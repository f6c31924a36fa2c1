"""Hugging Face GPT-2 passed as it is: trained through hydra-torch exactly as plain PyTorch trains it."""
import pytest
import torch

import hydra_torch as ht

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

VOCAB, POSITIONS, WIDTH = 96, 32, 32


def tiny_gpt2(dropout=0.1, seed=0):
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=WIDTH, n_layer=4, n_head=4,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def batches(count, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (2, seq), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def weight_bytes(model):
    return sum(p.numel() * 4 for p in model.parameters())


def train_reference(model, data, make_optimizer, seed):
    optimizer = make_optimizer(model.parameters())
    torch.manual_seed(seed)
    for batch in data:
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()


def relative_errors(model, reference, skip_key_bias):
    errors = {}
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        a, b = a.detach(), b.detach()
        if skip_key_bias and name.endswith("attn.c_attn.bias"):
            # The key part of c_attn's bias has an exactly-zero gradient (softmax ignores a per-query constant);
            # Adam scales the rounding noise left there up to lr-sized steps, so it compares noise, not training.
            keep = torch.ones_like(a, dtype=torch.bool)
            keep[WIDTH:2 * WIDTH] = False
            a, b = a[keep], b[keep]
        errors[name] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    return errors


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_spilled_gpt2_matches_plain_training(kind):
    data = batches(8)
    ours = {"adamw": ht.optim.AdamW(lr=1e-3), "sgd": ht.optim.SGD(lr=0.1, momentum=0.9)}[kind]
    theirs = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)}[kind]
    reference = tiny_gpt2()
    train_reference(reference, data, theirs, seed=7)
    model = tiny_gpt2()
    torch.manual_seed(7)
    budget = int(0.6 * weight_bytes(model))
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ours)], devices="cpu", memory_budget=budget,
                      progress=False)[0]
    assert result.error is None and not result.resident
    assert max(result.shard_loads) > 1
    errors = relative_errors(model, reference, skip_key_bias=kind == "adamw")
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
    assert model.lm_head.weight is model.transformer.wte.weight, "wte and lm_head are still tied"


@pytest.mark.parametrize("spilled", [True, False])
def test_token_type_ids_train_as_gpt2_adds_them(spilled):
    # GPT2Model adds wte(token_type_ids) to the embeddings (a tokenizer asked for them returns zeros): they were
    # ignored, and the losses differed from plain PyTorch's from the first step.
    data = [dict(batch, token_type_ids=torch.randint(0, 3, batch["input_ids"].shape, generator=torch.Generator()
                                                     .manual_seed(i))) for i, batch in enumerate(batches(4))]
    reference = tiny_gpt2()
    train_reference(reference, data, lambda ps: torch.optim.AdamW(ps, lr=1e-3), seed=7)
    model = tiny_gpt2()
    torch.manual_seed(7)
    budget = int(0.6 * weight_bytes(model)) if spilled else "1GiB"
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3))], devices="cpu",
                      memory_budget=budget, progress=False)[0]
    assert result.error is None and result.resident == (not spilled)
    errors = relative_errors(model, reference, skip_key_bias=True)
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


@pytest.mark.parametrize("types, match", [(torch.zeros(2, 7, dtype=torch.long), "input_ids' shape"),
                                          (torch.zeros(2, 8), r"int64 \(or int32\) tensor"),
                                          (torch.full((2, 8), VOCAB, dtype=torch.long), r"\[0, 96\)")])
def test_token_type_ids_gpt2_cannot_embed_are_refused(types, match):
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        ht.ModelTask(tiny_gpt2(), data=[{"input_ids": ids, "labels": ids, "token_type_ids": types}])


def test_trained_model_generates_and_saves(tmp_path):
    model = tiny_gpt2(dropout=0.0)
    result = ht.train([ht.ModelTask(model, data=batches(3))], devices="cpu", memory_budget="1GiB",
                      progress=False)[0]
    assert result.error is None and result.steps == 3
    model.eval()
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    model.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    for a, b in zip(model.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)


def test_bad_gpt2_input():
    model = tiny_gpt2()
    with pytest.raises(KeyError, match="labels"):
        ht.ModelTask(model, data=[{"input_ids": torch.zeros(2, 8, dtype=torch.long)}])
    with pytest.raises(ValueError, match="n_positions"):
        ids = torch.zeros(2, POSITIONS + 1, dtype=torch.long)
        ht.ModelTask(model, data=[{"input_ids": ids, "labels": ids}])
    with pytest.raises(ValueError, match="tokenizer"):
        ids = torch.full((2, 8), VOCAB, dtype=torch.long)
        ht.ModelTask(model, data=[{"input_ids": ids, "labels": ids}])
    # Its pieces (embeddings, blocks, norm with head) are made for the task: groups of its own modules would name
    # something else.
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel is cut by start indices over its \d+ pieces"):
        ht.ModelTask(model, data=batches(1), shards=[[model.transformer.h[0]], [model.transformer.h[1]]])


def test_unsupported_hugging_face_model():
    from transformers import BertConfig, BertForMaskedLM

    bert = BertForMaskedLM(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32))
    with pytest.raises(TypeError, match="not supported: BertForMaskedLM"):
        ht.ModelTask(bert, data=batches(1))


@pytest.mark.parametrize("installed", ["4.57.1", "5.2.0", "6.0.0"])
def test_a_transformers_outside_the_tested_range_is_named(monkeypatch, installed):
    model = tiny_gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    from hydra_torch.models.hf import adapter

    monkeypatch.setattr(adapter, "installed_transformers", lambda: installed)
    with pytest.raises(ImportError, match=rf"need transformers >= 5\.17, < 6; transformers {installed} is installed"):
        ht.ModelTask(model, data=batches(1))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
