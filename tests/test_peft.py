"""A peft LoRA model passed as it is: only its adapters train, exactly as peft trains them plainly; the frozen base
holds its weights alone on the host and its gradients never come back from the device."""
import pytest
import torch

import hydra_torch as ht
from hydra_torch.models import memory

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_decoders import padded_batches, tiny  # noqa: E402


def lora(arch="llama", rank=4, seed=0):
    model = tiny(arch, seed)
    torch.manual_seed(seed + 1)  # LoRA's A is drawn at random
    targets = {"gpt2": ["c_attn"]}.get(arch, ["q_proj", "v_proj"])
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.1, target_modules=targets,
                             fan_in_fan_out=arch == "gpt2")
    return peft.get_peft_model(model, config)


def trainable_numel(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def frozen_numel(model):
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def trained_against_plain(make, data, seed=3):
    """(name, ours, theirs) of each trainable parameter: make() trained spilled by hydra-torch and plainly by
    torch.optim.AdamW over its trainable parameters, from the same generator state."""
    reference = make()
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    torch.manual_seed(seed)
    for batch in data:
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    model = make()
    torch.manual_seed(seed)
    weights = sum(p.numel() * 4 for p in model.parameters())
    result = ht.train([ht.ModelTask(model, data=data)], devices="cpu", memory_budget=int(0.7 * weights),
                      progress=False)[0]
    assert result.ok and not result.resident
    return [(n, a, b) for (n, a), b in zip(model.named_parameters(), reference.parameters()) if a.requires_grad]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_spilled_lora_matches_peft_trained_plainly(arch, accumulate):
    data = padded_batches(4)
    reference = lora(arch)
    # eps 1e-6, not Adam's 1e-8: a LoRA B element whose first gradient cancels to a few 1e-9 (GPT-2, accumulated)
    # steps by about g / (|g| + eps), so with 1e-8 the two runs' fp32 rounding of that sum (some 1e-10 apart) moved
    # it by 5% of a step: 2e-5 of the weights on a CPU without AVX-512, where the other elements agree within 2e-6.
    eps = 1e-6
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3, eps=eps)
    torch.manual_seed(9)
    for i, batch in enumerate(data):
        (reference(**batch).loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    model = lora(arch)
    base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    weights = sum(p.numel() * 4 for p in model.parameters())
    task = ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3, eps=eps), accumulate=accumulate)
    torch.manual_seed(9)
    results = ht.train([task], devices="cpu", memory_budget=int(0.7 * weights), progress=False)
    result = results[0]
    assert result.ok and not result.resident and max(result.shard_loads) > 1, result
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        if a.requires_grad:
            error = ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()
            assert error <= 1e-5, (name, error)
        else:
            assert torch.equal(a, base[name]), f"{name} is frozen and must not change"
    # The host holds the frozen base's weights alone: 4 bytes each in fp32; the adapters' 12 and (with
    # micro-batches) 4 more for the accumulator, all within the alignment padding of each shard.
    per_trainable = 12 + (4 if accumulate > 1 else 0)
    assert memory.host_state_bytes(task) <= result.host_bytes <= 1.01 * memory.host_state_bytes(task)
    expected = 4 * frozen_numel(model) + per_trainable * trainable_numel(model)
    assert expected <= result.host_bytes <= expected * 1.02, (result.host_bytes, expected)
    # Only the adapters' gradients come back: at most what the trainable parameters' gradients take, each shard's
    # tail of frozen weights stays on the device (the layout puts them last).
    copied = results.stats[0]["device_to_host_bytes"]
    padding = 16 * sum(1 for p in model.parameters() if p.requires_grad)  # each entry aligned to 16 elements
    assert 0 < copied <= len(data) * 4 * (trainable_numel(model) + padding)


def test_trained_lora_saves_its_adapter_as_peft_does(tmp_path):
    model = lora()
    ht.train([ht.ModelTask(model, data=padded_batches(2))], devices="cpu", memory_budget="1GiB", progress=False)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "adapter_config.json").exists()
    loaded = peft.PeftModel.from_pretrained(tiny("llama"), tmp_path)
    ours = {n: p for n, p in model.named_parameters() if "lora_" in n}
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    batch = padded_batches(1)[0]
    model.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, loaded(**batch).logits)


def test_a_peft_model_with_nothing_trainable_is_refused():
    model = lora()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ht.ModelTask(model, data=padded_batches(1))


def test_lora_ranks_train_together_in_one_call():
    tasks = [ht.ModelTask(lora(rank=rank), data=padded_batches(3), name=f"r{rank}") for rank in (2, 4, 8)]
    results = ht.train(tasks, devices="cpu", memory_budget="1GiB", progress=False)
    assert all(r.ok for r in results)
    assert len({round(r.final_loss, 6) for r in results}) == 3


def test_lora_with_a_trained_head_copy_matches_peft_trained_plainly():
    """modules_to_save: peft wraps the LM head and trains a copy of it beside the adapters."""
    def make():
        model = tiny("llama")
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                          modules_to_save=["lm_head"]))

    trained = trained_against_plain(make, padded_batches(4))
    assert any("modules_to_save" in n for n, _, _ in trained)
    for name, a, b in trained:
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5, name


def test_a_lora_run_stopped_and_resumed_ends_as_one_run(tmp_path):
    data = padded_batches(6)

    def run(max_steps=None, checkpoint_dir=None, seed=0):
        model = lora(seed=seed)  # then the same global generator state before each call: dropout draws alike
        torch.manual_seed(7)
        task = ht.ModelTask(model, data=data, name="lora", max_steps=max_steps)
        ht.train([task], devices="cpu", memory_budget="200KB", progress=False, checkpoint_dir=checkpoint_dir,
                 checkpoint_every=None if checkpoint_dir is None else 1)
        return model

    straight = run()
    run(max_steps=3, checkpoint_dir=tmp_path)
    resumed = run(checkpoint_dir=tmp_path, seed=5)  # other weights, which the checkpoint replaces
    for (name, a), b in zip(resumed.named_parameters(), straight.parameters()):
        assert torch.equal(a, b), name


def test_lora_on_the_lm_head_trains_it_as_peft_does():
    """A LoRA-wrapped head is more than its weight and bias: it is not fused into the loss, it runs as it is."""
    def make():
        model = tiny("llama")
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"],
                                                          init_lora_weights=False))

    trained = trained_against_plain(make, padded_batches(3))
    assert any("lm_head.lora" in n for n, _, _ in trained)
    for name, a, b in trained:
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5, name


@pytest.mark.parametrize("arch, variant", [("llama", {"use_dora": True}),
                                           ("qwen2", {"use_rslora": True, "bias": "lora_only"})])
def test_lora_variants_train_as_peft_does(arch, variant):
    """DoRA (its magnitude vector and the base weight's norm in every forward), rank-stabilised scaling and the
    targeted layers' biases (Qwen2's q and v projections have them) trained beside the adapters: the modules run as
    they are, so each trains as plainly."""
    def make():
        model = tiny(arch)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                          target_modules=["q_proj", "v_proj"], **variant))

    trained = trained_against_plain(make, padded_batches(4))
    assert any(("magnitude" if "use_dora" in variant else "proj.base_layer.bias") in n for n, _, _ in trained)
    for name, a, b in trained:
        assert ((a - b).abs().max() / b.abs().max()).item() <= 1e-5, name


def test_prompt_learning_is_refused():
    model = peft.get_peft_model(tiny("llama"), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(TypeError, match="prompt learning"):
        ht.ModelTask(model, data=padded_batches(1))
