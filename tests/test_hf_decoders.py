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
        if name.endswith("attn.c_attn.bias"):  # GPT-2's fused [q | k | v]: drop k
            keep = torch.ones(3, WIDTH, dtype=torch.bool)
            keep[1] = False
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


@pytest.mark.parametrize("wrap, inner", [(torch.compile, "_orig_mod"), (torch.nn.DataParallel, "module")])
@pytest.mark.parametrize("kind", ["llama", "sequential"])
def test_a_wrapped_model_is_refused_naming_the_module_to_pass(wrap, inner, kind):
    # Before, a compiled Llama was called "not a causal language model" and a DataParallel one was asked for a
    # loss_fn; the wrapped module trains as it is.
    model = tiny("llama") if kind == "llama" else torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    loss_fn = None if kind == "llama" else (lambda output, batch: output.sum())
    data = padded_batches(1) if kind == "llama" else [torch.ones(2, 4)]
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=rf"is a {type(wrap(model)).__name__}, .*\(model\.{inner}\)"):
        ht.ModelTask(wrap(model), data=data, loss_fn=loss_fn)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    ht.ModelTask(getattr(wrap(model), inner), data=data, loss_fn=loss_fn)


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
def test_bad_batches_are_refused_when_the_task_is_built(batch, match):
    with pytest.raises((KeyError, ValueError), match=match):
        ht.ModelTask(tiny("qwen3"), data=[batch])


@pytest.mark.parametrize("arch, lowest", [("gpt2", 0), ("opt", -1)])
def test_position_ids_outside_learned_positions_are_refused(arch, lowest):
    ids = torch.zeros(2, 4, dtype=torch.long)
    for positions in (torch.full((2, 4), POSITIONS), torch.full((2, 4), lowest - 1)):
        with pytest.raises(ValueError, match="position_ids must lie in"):
            ht.ModelTask(tiny(arch), data=[{"input_ids": ids, "labels": ids, "position_ids": positions}])


@pytest.mark.parametrize("arch, stray", [
    ("llama", {"sliding_window": 4}),                                     # a key Llama ignores
    ("gemma", {"sliding_window": 4}),
    ("mistral", {"sliding_window": 4, "layer_types": ["full_attention"] * LAYERS}),  # Mistral reads the window
])
def test_masks_follow_what_the_models_forward_reads_not_every_config_key(arch, stray):
    model = tiny(arch)
    for key, value in stray.items():
        setattr(model.config, key, value)
    model.eval()
    batch = padded_batches(1, seq=12)[0]
    pieces = adapt(model).pieces
    pieces[-1].fused = False
    with torch.no_grad():
        expected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        x = (batch["input_ids"], batch["attention_mask"], None)
        for piece in pieces:
            x = piece(x)
    assert torch.equal(x, expected)


def test_bidirectional_gemma3_is_refused():
    model = tiny("gemma3")
    model.config.use_bidirectional_attention = True
    with pytest.raises(TypeError, match="use_bidirectional_attention"):
        ht.ModelTask(model, data=padded_batches(1))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_packed_sequences_train_as_the_models_own_forward_masks_them(arch, use_cache):
    """Position ids that restart and no attention_mask: a model that caches (the default) masks causally over the
    whole row, one that does not finds the packed sequences and masks each apart; the pieces do as the model."""
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(3):
        ids = torch.randint(3, VOCAB, (2, 12), generator=g)
        data.append({"input_ids": ids, "labels": ids, "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])})

    def make():
        model = tiny(arch)
        model.config.use_cache = use_cache
        return model

    reference = make()
    train_plainly(reference, data, seed=2)
    model = make()
    torch.manual_seed(2)
    weights = sum(p.numel() * 4 for p in model.parameters())
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3))], devices="cpu",
                      memory_budget=int(0.7 * weights), progress=False)[0]
    assert result.ok
    errors = max_relative_error(model, reference)
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}


def test_masks_and_rotary_tables_are_carried_along_without_gradients():
    """The first piece computes them once per micro-batch; at a shard boundary they stay as they are while the
    hidden states become leaves that take a gradient."""
    from hydra_torch.models.carried import Carried
    from hydra_torch.models.batch_tree import to_device
    from hydra_torch.run.compute import input_grads, requiring_grad

    model = tiny("gemma3")  # two mask types, two rotary tables
    model.config._attn_implementation = "eager"  # a float mask
    batch = padded_batches(1)[0]
    out = adapt(model).pieces[0]((batch["input_ids"], batch["attention_mask"], None))
    assert isinstance(out[1], Carried)
    masks, tables = out[1].values
    assert len(masks) == 2 and len(tables) == 2 and masks[0].is_floating_point()
    x = requiring_grad(to_device(out, "cpu"))
    carried_masks, carried_tables = x[1].values
    assert x[0].requires_grad
    assert not any(t.requires_grad for t in (*carried_masks, *carried_tables[0], *carried_tables[1]))
    assert len(input_grads(x)) == 1 + 2 + 4 + 1  # hidden, two masks, two (cos, sin), position ids


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_attention_with_padding_matches_plain_training(arch):
    data = padded_batches(3)

    def make():
        model = tiny(arch)
        model.config._attn_implementation = "eager"
        return model

    reference = make()
    train_plainly(reference, data, seed=4)
    model = make()
    weights = sum(p.numel() * 4 for p in model.parameters())
    torch.manual_seed(4)
    result = ht.train([ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3))], devices="cpu",
                      memory_budget=int(0.7 * weights), progress=False)[0]
    assert result.ok and not result.resident
    errors = max_relative_error(model, reference)
    assert max(errors.values()) <= 1e-5, {k: v for k, v in errors.items() if v > 1e-5}
