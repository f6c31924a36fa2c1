"""Every tested decoder-only family (hydra_torch.demo.architectures), passed as it is: trained through hydra-torch,
spilled and resident, with padding, exactly as plain PyTorch trains it; then used as a model again."""
import pytest
import torch

import hydra_torch as ht

transformers = pytest.importorskip("transformers")
from hydra_torch.demo import architectures  # noqa: E402
from hydra_torch.models.hf import adapt, decoder  # noqa: E402

VOCAB, WIDTH, LAYERS, HEADS, POSITIONS = 96, 32, 3, 4, 64
DECODERS = [name for name in architectures.CONFIGS if name != "gpt2"]  # GPT-2 has test_hf_gpt2.py


def tiny(arch, seed=0):
    return architectures.build(arch, VOCAB, WIDTH, LAYERS, HEADS, POSITIONS, seed=seed)


def padded_batches(count=4, seq=12, seed=0):
    """Right padding in one row, left padding in another; the padded positions' labels are -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (3, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -4:] = 0
        mask[1, :3] = 0
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def train_plainly(model, data, seed):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(seed)
    for batch in data:
        optimizer.zero_grad()
        model(**batch).loss.backward()
        optimizer.step()


def max_relative_error(model, reference):
    errors = {}
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        if name.endswith("k_proj.bias"):
            # A key bias has an exactly-zero gradient (softmax ignores a per-query constant); Adam scales the
            # rounding noise left there up to lr-sized steps, so it would compare noise, not training.
            continue
        if name.endswith("query_key_value.bias"):  # GPT-NeoX's fused [q | k | v] per head: drop each k
            keep = torch.ones(HEADS, 3, WIDTH // HEADS, dtype=torch.bool)
            keep[:, 1] = False
            a, b = a[keep.flatten()], b[keep.flatten()]
        a, b = a.detach(), b.detach()
        if type(model.get_submodule(name.rpartition(".")[0])).__name__.startswith("Gemma") and "norm" in name:
            # Gemma's RMSNorm scales by 1 + weight, its weight starting at 0: compare the scale it applies, as a
            # weight near 0 would make rounding noise look large.
            a, b = 1 + a, 1 + b
        errors[name] = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
    return errors


@pytest.mark.parametrize("arch", DECODERS)
def test_pieces_compute_the_models_own_logits(arch):
    model = tiny(arch).eval()
    batch = padded_batches(1)[0]
    pieces = adapt(model).pieces
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        x = (batch["input_ids"], batch["attention_mask"], None)
        for piece in pieces[:-1]:
            x = piece(x)
        pieces[-1].fused = False
        got = pieces[-1](x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", DECODERS)
def test_spilled_training_matches_plain_training(arch, tmp_path):
    data = padded_batches()
    reference = tiny(arch)
    train_plainly(reference, data, seed=5)
    model = tiny(arch)
    weights = sum(p.numel() * 4 for p in model.parameters())
    torch.manual_seed(5)
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3))], devices="cpu",
                      memory_budget=int(0.7 * weights), progress=False)[0]
    assert result.ok and not result.resident and max(result.shard_loads) > 1, result
    errors = max_relative_error(model, reference)
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
    # The trained model is a model again: its forward, generate() and save/load round trip.
    model.eval()
    reference.eval()
    prompt = torch.tensor([[5, 6, 7]])
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False),
                       reference.generate(prompt, max_new_tokens=4, do_sample=False))
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("arch", DECODERS)
def test_resident_training_with_position_ids_matches_plain_training(arch):
    data = padded_batches(3)
    for batch in data:  # positions counted over the attended tokens, as a packed or left-padded batch gives them
        batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp_min(0)
    reference = tiny(arch)
    train_plainly(reference, data, seed=3)
    model = tiny(arch)
    torch.manual_seed(3)
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3))], devices="cpu",
                      memory_budget="1GiB", progress=False)[0]
    assert result.ok and result.resident
    errors = max_relative_error(model, reference)
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


def test_tied_embeddings_stay_tied():
    model = tiny("qwen2")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ht.train([ht.ModelTask(model, data=padded_batches(2))], devices="cpu", memory_budget="1GiB", progress=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_an_untested_family_is_checked_against_its_own_forward(monkeypatch):
    """A family outside TESTED trains only once its pieces reproduce its logits; a forward the adapter does not
    know (here: one that scales its logits) is refused before anything trains."""
    model = tiny("llama")
    monkeypatch.setattr(decoder, "TESTED", ())
    assert adapt(model) is not None
    head = model.lm_head
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda x: original(x) * 1.5)
    monkeypatch.setattr(type(model), "forward", _scaled_forward(type(model).forward))
    with pytest.raises(TypeError, match="differ from its own forward"):
        adapt(model)


def _scaled_forward(forward):
    def scaled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 2.0
        return out

    return scaled


def test_encoder_decoder_and_encoder_only_models_are_refused():
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2))
    with pytest.raises(TypeError, match="encoder-decoder"):
        ht.ModelTask(t5, data=padded_batches(1))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))
    with pytest.raises(TypeError, match="not a causal language model"):
        ht.ModelTask(bert, data=padded_batches(1))


def test_a_decoder_with_parts_the_adapter_does_not_know_is_refused_by_name():
    model = tiny("llama")
    model.model.extra_gate = torch.nn.Linear(WIDTH, WIDTH)
    with pytest.raises(TypeError, match="extra_gate"):
        ht.ModelTask(model, data=padded_batches(1))
    model = tiny("llama")
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(WIDTH, WIDTH)])
    with pytest.raises(TypeError, match="list of decoder layers"):
        ht.ModelTask(model, data=padded_batches(1))


def test_router_logits_are_refused():
    model = tiny("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(TypeError, match="output_router_logits"):
        ht.ModelTask(model, data=padded_batches(1))


@pytest.mark.parametrize("batch, match", [
    ({"labels": torch.zeros(2, 4, dtype=torch.long)}, "input_ids"),
    ({"inputs_embeds": torch.zeros(2, 4, WIDTH), "labels": torch.zeros(2, 4, dtype=torch.long)}, "inputs_embeds"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "inputs_embeds": torch.zeros(2, 4, WIDTH),
      "labels": torch.zeros(2, 4, dtype=torch.long)}, "inputs_embeds"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
      "labels": torch.zeros(2, 4, dtype=torch.long)}, "attention_mask"),
    ({"input_ids": torch.zeros(2, 4, dtype=torch.long), "position_ids": torch.zeros(3, 4, dtype=torch.long),
      "labels": torch.zeros(2, 4, dtype=torch.long)}, "position_ids"),
])
def test_bad_batches_are_refused_before_training(batch, match):
    model = tiny("qwen3")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises((KeyError, ValueError), match=match):
        ht.ModelTask(model, data=[batch])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
