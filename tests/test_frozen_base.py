"""Tasks that share a frozen base (ht.FrozenBase): its weights held once on the host and copied once to a
device, each task ending exactly as it does trained alone."""
import copy

import pytest
import torch

import hydra_torch as ht
from hydra_torch.models import planner
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain

LEARNING_RATES = [1e-3, 3e-3, 1e-2, 3e-2]
FROZEN_BLOCKS = 3  # the embedding (tied with the head) and the first blocks


def partly_frozen(dropout=0.1):
    """The shared pretrained model: its embedding, head and first blocks frozen."""
    model = tied_transformer(seed=0, dropout=dropout)
    for layer in list(model)[:1 + FROZEN_BLOCKS]:
        layer.requires_grad_(False)
    return model


def frozen_numel(model):
    return sum(p.numel() for p in model.parameters() if not p.requires_grad)


def sweep(base_model, data, count, base=None, **options):
    """`count` tasks, each its own copy of `base_model` with its own learning rate."""
    models = [copy.deepcopy(base_model) for _ in range(count)]
    tasks = [ht.ModelTask(m, data=data, loss_fn=lm_loss, optimizer=ht.optim.AdamW(lr=lr), name=f"lr{lr:g}",
                          base=base, **options) for m, lr in zip(models, LEARNING_RATES)]
    return tasks, models


def alone(base_model, data, index, budget, threads=None, **options):
    """The task trained by itself without a base; `threads`: as many as each virtual device of a run has."""
    model = copy.deepcopy(base_model)
    task = ht.ModelTask(model, data=data, loss_fn=lm_loss, optimizer=ht.optim.AdamW(lr=LEARNING_RATES[index]),
                        **options)
    torch.manual_seed(5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        result = ht.train([task], devices="cpu", memory_budget=budget, progress=False)[0]
    finally:
        torch.set_num_threads(before)
    assert result.ok, result.error
    return model, result


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_tasks_sharing_a_base_match_training_alone(devices):
    base_model = partly_frozen()
    data = token_batches(4)
    budget = int(0.45 * model_bytes(base_model))
    expected = [alone(base_model, data, i, budget, threads=1 if len(devices) > 1 else None) for i in range(3)]
    tasks, models = sweep(base_model, data, 3, base=ht.FrozenBase())
    torch.manual_seed(5)
    results = ht.train(tasks, devices=devices, memory_budget=budget, progress=False)
    for model, result, (alone_model, alone_result) in zip(models, results, expected):
        assert result.ok and not result.resident, result
        assert result.losses == alone_result.losses
        for (name, a), b in zip(model.named_parameters(), alone_model.parameters()):
            assert torch.equal(a, b), f"{result.name}: {name} differs from training alone"
        assert model[0].weight is model[-1].weight
    for a, b in zip(base_model.parameters(), models[0].parameters()):
        if not b.requires_grad:
            assert torch.equal(a, b), "the base's weights are frozen"
    # After the call the tasks' base weights are one host copy.
    frozen = [[p for p in m.parameters() if not p.requires_grad] for m in models]
    for weights in zip(*frozen):
        assert len({p.data_ptr() for p in weights}) == 1 and all(p.device.type == "cpu" for p in weights)


def test_a_task_of_a_base_matches_plain_pytorch():
    base_model = partly_frozen()
    data = token_batches(4)
    reference = copy.deepcopy(base_model)
    train_plain(reference, data, lambda params: torch.optim.AdamW([p for p in params if p.requires_grad],
                                                                  lr=LEARNING_RATES[0]), seed=5)
    tasks, models = sweep(base_model, data, 2, base=ht.FrozenBase())
    torch.manual_seed(5)
    results = ht.train(tasks, devices="cpu", memory_budget=int(0.45 * model_bytes(base_model)), progress=False)
    assert all(r.ok for r in results)
    assert max_relative_error(models[0], reference) <= 1e-5


def test_the_base_is_held_once_on_the_host_and_copied_once_a_visit():
    base_model = partly_frozen(dropout=0.0)
    data = token_batches(4)
    budget = int(0.6 * model_bytes(base_model))
    held, copied = {}, {}
    for shared in (False, True):
        tasks, models = sweep(base_model, data, 4, base=ht.FrozenBase() if shared else None)
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
        assert all(r.ok and not r.resident for r in results)
        held[shared] = sum(r.host_bytes for r in results) + sum(b["host_bytes"] for b in results.bases.values())
        copied[shared] = results.stats[0]["host_to_device_bytes"]
        if shared:
            (base,) = results.bases.values()
            assert base["tasks"] == [t.name for t in tasks]
            assert base["host_bytes"] == pytest.approx(4 * frozen_numel(base_model), rel=0.01)
            copied["base"] = base["copied_bytes"]
    saved = 3 * 4 * frozen_numel(base_model)  # three of the four tasks' copies of the base
    assert held[True] == pytest.approx(held[False] - saved, rel=0.01)
    # What was copied of the base, against what the four tasks copied of their own copies of it.
    unshared_base = copied[False] - (copied[True] - copied["base"])
    assert 0 < copied["base"] < 0.8 * unshared_base, copied


def test_resident_tasks_share_one_copy_of_the_base():
    base_model = partly_frozen(dropout=0.0)
    data = token_batches(3)
    budget = 8 * model_bytes(base_model)
    expected = [alone(base_model, data, i, budget) for i in range(2)]
    tasks, models = sweep(base_model, data, 2, base=ht.FrozenBase())
    torch.manual_seed(5)
    results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    for model, result, (alone_model, _) in zip(models, results, expected):
        assert result.ok and result.resident, result
        for a, b in zip(model.parameters(), alone_model.parameters()):
            assert torch.equal(a, b)


def test_a_checkpoint_of_a_base_task_resumes_and_names_its_base(tmp_path):
    base_model = partly_frozen()
    data = token_batches(4)
    budget = int(0.45 * model_bytes(base_model))
    _, models_whole = sweep(base_model, data, 2)
    tasks, models_whole = sweep(base_model, data, 2, base=ht.FrozenBase("gpt"))
    torch.manual_seed(5)
    ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    tasks, models = sweep(base_model, data, 2, base=ht.FrozenBase("gpt"), max_steps=2)
    torch.manual_seed(5)
    ht.train(tasks, devices="cpu", memory_budget=budget, progress=False, checkpoint_dir=tmp_path)
    tasks, models = sweep(base_model, data, 2, base=ht.FrozenBase("gpt"))
    torch.manual_seed(5)
    results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False, checkpoint_dir=tmp_path)
    assert [r.steps for r in results] == [4, 4]
    for model, whole in zip(models, models_whole):
        for a, b in zip(model.parameters(), whole.parameters()):
            assert torch.equal(a, b)
    tasks, _ = sweep(base_model, data, 2)
    with pytest.raises(ValueError, match="sharing the frozen base 'gpt'"):
        ht.train(tasks, devices="cpu", memory_budget=budget, progress=False, checkpoint_dir=tmp_path)


def check_refused(tasks, match):
    before = [[p.detach().clone() for p in t.model.parameters()] for t in tasks]
    with pytest.raises(ValueError, match=match):
        ht.train(tasks, devices="cpu", memory_budget=10**8, progress=False)
    for task, values in zip(tasks, before):
        for p, value in zip(task.model.parameters(), values):
            assert torch.equal(p, value) and p.device.type == "cpu"


def test_tasks_whose_frozen_weights_differ_are_refused():
    data = token_batches(2)
    base = ht.FrozenBase()
    tasks, models = sweep(partly_frozen(), data, 2, base=base)
    with torch.no_grad():
        models[1][2].qkv.weight[0, 0] += 1.0
    check_refused(tasks, "qkv.weight differs in value")
    other = tied_transformer(seed=0, blocks=5)
    other[0] = torch.nn.Embedding(48, 32).requires_grad_(False)  # the same names, another embedding
    other[-1].weight = other[0].weight
    for layer in list(other)[1:1 + FROZEN_BLOCKS]:
        layer.requires_grad_(False)
    tasks = sweep(partly_frozen(), data, 1, base=base)[0] + [
        ht.ModelTask(other, data=data, loss_fn=lm_loss, name="other", base=base)]
    check_refused(tasks, "differs in value")


def test_a_task_that_trains_a_weight_of_its_base_is_refused():
    data = token_batches(2)
    base = ht.FrozenBase()
    tasks, models = sweep(partly_frozen(), data, 2, base=base)
    models[1][1].qkv.weight.requires_grad_(True)  # after the task was built
    check_refused(tasks, "trains 1.qkv.weight")
    unfrozen = partly_frozen()
    unfrozen[3].requires_grad_(True)
    tasks = sweep(partly_frozen(), data, 1, base=base)[0] + [
        ht.ModelTask(unfrozen, data=data, loss_fn=lm_loss, name="deeper", base=base)]
    check_refused(tasks, "task 'deeper' trains 3.")


def test_bad_bases_are_refused():
    data = token_batches(2)
    with pytest.raises(TypeError, match="FrozenBase"):
        ht.ModelTask(partly_frozen(), data=data, loss_fn=lm_loss, base="base")
    with pytest.raises(ValueError, match="no frozen parameters"):
        ht.ModelTask(tied_transformer(), data=data, loss_fn=lm_loss, base=ht.FrozenBase())
    with pytest.raises(TypeError, match="non-empty str"):
        ht.FrozenBase(name="")
    base = ht.FrozenBase()
    bf16 = ht.ModelTask(copy.deepcopy(partly_frozen()), data=data, loss_fn=lm_loss, precision="bf16", name="bf16",
                        base=base)
    check_refused(sweep(partly_frozen(), data, 1, base=base)[0] + [bf16], "one precision")
    tasks = sweep(partly_frozen(), data, 1, base=ht.FrozenBase("same"))[0] + [
        ht.ModelTask(copy.deepcopy(partly_frozen()), data=data, loss_fn=lm_loss, name="b", base=ht.FrozenBase("same"))]
    check_refused(tasks, "two FrozenBase objects are named 'same'")
    model = partly_frozen()
    cut = ht.ModelTask(model, data=data, loss_fn=lm_loss, name="cut", base=base, shards=[0, 2, 5])
    check_refused(sweep(partly_frozen(), data, 1, base=base)[0] + [cut], "cut into")


def test_a_lora_sweep_over_one_base_matches_each_configuration_alone():
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from test_hf_decoders import padded_batches, tiny

    configs = [dict(r=2, target_modules=["c_attn"]), dict(r=4, target_modules=["c_attn", "c_proj"]),
               dict(r=8, target_modules=["c_fc"], lora_dropout=0.0)]

    def lora(config):
        model = tiny("gpt2", 0)
        torch.manual_seed(1)
        return peft.get_peft_model(model, peft.LoraConfig(**{"lora_alpha": 8, "lora_dropout": 0.1,
                                                             "fan_in_fan_out": True, **config}))

    data = padded_batches(3)
    budget = int(0.7 * sum(p.numel() * 4 for p in tiny("gpt2", 0).parameters()))
    expected = []
    for config in configs:
        model = lora(config)
        torch.manual_seed(5)
        result = ht.train([ht.ModelTask(model, data=data)], devices="cpu", memory_budget=budget, progress=False)[0]
        assert result.ok and not result.resident
        expected.append(model)
    base = ht.FrozenBase("tiny-gpt2")
    models = [lora(config) for config in configs]
    tasks = [ht.ModelTask(m, data=data, name=f"lora{i}", base=base) for i, m in enumerate(models)]
    torch.manual_seed(5)
    results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    assert all(r.ok for r in results)
    for model, alone_model in zip(models, expected):
        for (name, a), b in zip(model.named_parameters(), alone_model.parameters()):
            assert torch.equal(a, b), name
    info = results.bases["tiny-gpt2"]
    frozen = sum(p.numel() for p in models[0].parameters() if not p.requires_grad)
    assert info["host_bytes"] == pytest.approx(4 * frozen, rel=0.02)


def test_a_failing_or_pruned_task_of_a_base_leaves_the_others_as_they_would_be_alone():
    base_model = partly_frozen()
    data, valid = token_batches(4), token_batches(1, seed=7)
    budget = int(0.45 * model_bytes(base_model))
    tasks, models = sweep(base_model, data, 4, base=ht.FrozenBase(), eval_data=valid)
    calls = [0]

    def failing(output, batch):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("boom in loss_fn")
        return lm_loss(output, batch)
    tasks[1].loss_fn = failing
    torch.manual_seed(5)
    with pytest.warns(RuntimeWarning, match="boom in loss_fn"):
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False,
                           selection=ht.SuccessiveHalving(min_steps=2, reduction_factor=4))
    assert isinstance(results[1].error, RuntimeError)
    # Which tasks the asynchronous rule stops depends on the order they reach its rung; whichever it stopped,
    # every other task is as it would be alone for as many steps.
    for i, (model, result) in enumerate(zip(models, results)):
        if i == 1:
            continue
        alone_model, _ = alone(base_model, data, i, budget, eval_data=valid, max_steps=result.steps)
        for a, b in zip(model.parameters(), alone_model.parameters()):
            assert torch.equal(a, b), f"{result.name} differs from training alone for its {result.steps} steps"


def test_tasks_of_a_base_join_a_running_call_and_a_mismatched_one_is_refused():
    import queue
    import threading

    from hydra_torch.arrivals import Arrivals
    from hydra_torch.state import task_rng

    base_model = partly_frozen(dropout=0.0)
    data = token_batches(3)
    budget = int(0.45 * model_bytes(base_model))
    base, late_base = ht.FrozenBase("first"), ht.FrozenBase("late")
    with task_rng.exclusive():
        tasks, models = sweep(base_model, data, 3, base=base)
        late_tasks, late_models = sweep(base_model, data, 2, base=late_base)
        wrong = copy.deepcopy(base_model)
        with torch.no_grad():
            wrong[2].qkv.weight.mul_(2.0)
        mismatched = ht.ModelTask(wrong, data=data, loss_fn=lm_loss, name="wrong", base=base)
        namesake = ht.ModelTask(copy.deepcopy(base_model), data=data, loss_fn=lm_loss, name="namesake",
                                base=ht.FrozenBase("first"))
    for t, name in zip(late_tasks, ("late0", "late1")):
        t.name = name
    ended, outcomes = queue.SimpleQueue(), {}
    arrivals = Arrivals(on_ended=ended.put)

    def driver():
        try:
            for t in tasks[1:] + late_tasks:
                arrivals.add(t)
            with pytest.raises(ValueError, match="qkv.weight differs in value"):
                arrivals.add(mismatched)
            with pytest.raises(ValueError, match="another FrozenBase named 'first'"):
                arrivals.add(namesake)
        except BaseException as error:
            outcomes["error"] = error
        finally:
            arrivals.close()
    thread = threading.Thread(target=driver)
    torch.manual_seed(5)
    thread.start()
    results = ht.train(tasks[:1], devices="cpu", memory_budget=budget, progress=False, arrivals=arrivals)
    thread.join()
    assert "error" not in outcomes, outcomes.get("error")
    assert sorted(results.bases) == ["first", "late"]
    assert results.bases["first"]["tasks"] == [t.name for t in tasks]
    for model, task in zip(models + late_models, tasks + late_tasks):
        index = LEARNING_RATES.index(task.optimizer.lr)
        alone_model, _ = alone(base_model, data, index, budget)
        for a, b in zip(model.parameters(), alone_model.parameters()):
            assert torch.equal(a, b), task.name
    assert all(p.device.type == "cpu" for p in wrong.parameters())


class TransposedLinear(torch.nn.Module):
    """A linear layer whose forward saves a view of its weight (its transpose) for the backward."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width) / width ** 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight.t())


def test_a_resident_task_of_a_base_reads_no_stale_copy_of_a_base_shard():
    """A resident task keeps its autograd graph from forward to backward, and each frozen layer's forward here
    saves a view of its base weight: the base's shards must not leave their memory meanwhile, though a large
    spilled model beside the tasks needs room. With a task of the base resident they are copied in once."""
    torch.manual_seed(0)
    width = 32
    # Trained layers before and after the frozen ones: the first one's gradient goes through their weights.
    pretrained = torch.nn.Sequential(torch.nn.Linear(width, width), *[TransposedLinear(width) for _ in range(4)],
                                     torch.nn.Linear(width, 8))
    for layer in list(pretrained)[1:5]:
        layer.requires_grad_(False)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, width, generator=g), torch.randn(4, 8, generator=g)) for _ in range(3)]

    def mse(output, batch):
        return ((output - batch[1]) ** 2).mean()
    big = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)], torch.nn.Linear(width, 8))
    weights = sum(p.numel() * 4 for p in pretrained.parameters())

    def run(shared, budget):
        base = ht.FrozenBase() if shared else None
        models = [copy.deepcopy(pretrained) for _ in range(2)]
        tasks = [ht.ModelTask(m, data=data, loss_fn=mse, optimizer=ht.optim.AdamW(lr=lr), name=f"t{i}", base=base)
                 for i, (m, lr) in enumerate(zip(models, (1e-2, 3e-2)))]
        tasks.append(ht.ModelTask(copy.deepcopy(big), data=data, loss_fn=mse, name="big"))
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
        assert all(r.ok for r in results)
        return models, results
    frozen = sum(p.numel() * 4 for layer in list(pretrained)[1:5] for p in layer.parameters())
    checked = 0
    for factor in (3, 4, 5, 6, 8):
        models, results = run(True, factor * weights)
        if not any(r.resident for r in results[:2]):
            continue
        (base,) = results.bases.values()
        assert base["copied_bytes"] <= frozen, "with a task of the base resident, each base shard comes in once"
        assert not results[2].resident and max(results[2].shard_loads) > 1, "the large model spills beside them"
        alone, _ = run(False, factor * weights)
        for a, b in zip(models, alone):
            for p, q in zip(a.parameters(), b.parameters()):
                assert torch.equal(p, q)
        checked += 1
    assert checked, "some budget made a task of the base resident"


def test_a_base_task_left_to_the_planner_is_not_cut_like_shards_out_of_layer_order():
    """planner.cut_like copies the first task's cut by where its shards start among its layers: shards that are not
    its layers in order (an adapter's model given module groups) have no such starts, and are refused by name."""
    base = ht.FrozenBase()
    (first, second), _ = sweep(partly_frozen(), token_batches(2), 2, base=base)
    layers = list(first.pieces)
    first.modules = [layers[1:], layers[:1]]  # every layer, the embedding last
    with pytest.raises(ValueError, match="not its layers in order"):
        planner.cut_like(second, first)
    first.modules = [layers[:3], layers[3:]]
    planner.cut_like(second, first)
    assert [len(group) for group in second.modules] == [3, len(layers) - 3]
    assert all(a is b for a, b in zip(sum(second.modules, []), second.pieces))
