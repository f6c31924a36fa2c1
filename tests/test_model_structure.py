"""The model a task trains is the model as it is: every place of its own forward (a module reused at several
places trains at each, as one tied weight), and the model as it was when the task was built (a later edit is
refused, not ignored)."""
import copy
import json
import warnings

import pytest
import torch
from torch import nn

import hydra_torch as ht
from hydra_torch.state import checkpoint
from models import lm_loss, max_relative_error, train_plain
from test_bad_input import snapshot, unchanged
from test_equivalence import OPTIMIZERS, SEED, train_hydra

CLASSES = 4


def batches(count, rows=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 8, generator=g), torch.randint(0, CLASSES, (rows,), generator=g))
            for _ in range(count)]


def reused_tanh(seed=0):
    """Five layers, one Tanh at places 1 and 3."""
    torch.manual_seed(seed)
    act = nn.Tanh()
    return nn.Sequential(nn.Linear(8, 16), act, nn.Linear(16, 16), act, nn.Linear(16, CLASSES))


def reused_linear(seed=0):
    """Five layers, one Linear at places 1 and 3: weight sharing by reuse."""
    torch.manual_seed(seed)
    shared = nn.Linear(16, 16)
    return nn.Sequential(nn.Linear(8, 16), shared, nn.Tanh(), shared, nn.Linear(16, CLASSES))


def reused_batchnorm(seed=0):
    """Six layers, one BatchNorm1d (its running statistics) at places 1 and 4."""
    torch.manual_seed(seed)
    norm = nn.BatchNorm1d(16)
    # No bias before a norm: its gradient is exactly zero, and Adam would scale the rounding noise left there
    # up to full-size updates, which would compare noise, not training.
    return nn.Sequential(nn.Linear(8, 16, bias=False), norm, nn.Tanh(), nn.Linear(16, 16, bias=False), norm,
                         nn.Linear(16, CLASSES))


def spilled_budget(model, shards):
    """The least memory that trains `model` cut into `shards` spilled, so it cannot stay resident."""
    task = ht.ModelTask(model, loss_fn=lm_loss, data=batches(1), shards=shards)
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, False)
    return ht._C.DeviceEngine.spilled_need(store) + 1024


def check_trains_as_plain_pytorch(make, shards, spilled, container=lambda model: model, steps=4):
    ours, theirs = OPTIMIZERS["adamw"]
    data = batches(steps)
    reference = make()
    reference_losses = train_plain(reference, data, theirs, seed=SEED)
    model = make()
    budget = spilled_budget(model, shards) if spilled else 2**26
    result = train_hydra(container(model), data, ours(), budget, shards=shards)[0]
    assert result.resident == (not spilled)
    assert result.losses == pytest.approx(reference_losses, rel=1e-6)
    assert max_relative_error(model, reference) <= 1e-6
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-7), name  # buffers too


# Places 1 and 3 in shards of their own (None), in two shards ([0, 2]) and in one shard ([0, 1, 4]).
SHARDS = [None, 2, [0, 2], [0, 1, 4]]


@pytest.mark.parametrize("spilled", [False, True])
@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("make", [reused_tanh, reused_linear])
def test_a_module_used_twice_trains_at_both_places(make, shards, spilled):
    assert len(ht.ModelTask(make(), loss_fn=lm_loss, data=batches(1)).pieces) == 5
    check_trains_as_plain_pytorch(make, shards, spilled)


@pytest.mark.parametrize("make", [reused_tanh, reused_linear])
def test_a_module_used_twice_trains_at_both_places_with_planned_shards(make):
    check_trains_as_plain_pytorch(make, "auto", spilled=False)


@pytest.mark.parametrize("container", [list, nn.ModuleList])
def test_a_list_holding_a_module_twice_trains_it_at_both_places(container):
    check_trains_as_plain_pytorch(reused_linear, [0, 2], spilled=True, container=container)


def test_explicit_shards_listing_a_module_twice_run_it_at_both_places():
    def explicit(model):
        return [list(model[:3]), list(model[3:])]
    ours, theirs = OPTIMIZERS["adamw"]
    data = batches(4)
    reference = reused_linear()
    reference_losses = train_plain(reference, data, theirs, seed=SEED)
    model = reused_linear()
    result = train_hydra(model, data, ours(), spilled_budget(model, explicit(model)), shards=explicit(model))[0]
    assert not result.resident
    assert result.losses == pytest.approx(reference_losses, rel=1e-6)
    assert max_relative_error(model, reference) <= 1e-6


@pytest.mark.parametrize("spilled", [False, True])
@pytest.mark.parametrize("shards", [None, [0, 2, 4], [0, 1, 5]])
def test_a_batchnorm_used_twice_updates_its_statistics_at_both_places(shards, spilled):
    check_trains_as_plain_pytorch(reused_batchnorm, shards, spilled)


def test_a_reused_module_takes_its_param_group_and_checkpoints_as_a_tie(tmp_path):
    groups = [{"params": "*.bias", "weight_decay": 0.0}]

    def adamw_without_decay_on_biases(model):
        named = dict(model.named_parameters())
        return torch.optim.AdamW([{"params": [p for n, p in named.items() if not n.endswith("bias")]},
                                  {"params": [p for n, p in named.items() if n.endswith("bias")],
                                   "weight_decay": 0.0}], lr=3e-3, weight_decay=0.05)

    data = batches(4)
    reference = reused_linear()
    train_plain(reference, data, lambda _: adamw_without_decay_on_biases(reference), seed=SEED)

    def run(model, **options):
        task = ht.ModelTask(model, loss_fn=lm_loss, data=data, optimizer=OPTIMIZERS["adamw"][0](),
                            param_groups=groups, name="reused", **options)
        torch.manual_seed(SEED)
        return ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)[0]

    assert run(reused_linear(), max_steps=2).steps == 2
    manifest = json.loads((tmp_path / "reused" / checkpoint.MANIFEST).read_text())
    assert manifest["ties"] == {"3.weight": "1.weight", "3.bias": "1.bias"}
    model = reused_linear()
    assert run(model, shards=[0, 2]).steps == 4, "resumed from step 2"
    assert max_relative_error(model, reference) <= 1e-6


def plain_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES))


EDITS = {
    "a layer replaced": lambda m: m.__setitem__(2, nn.Linear(16, 16)),
    "a layer without parameters replaced": lambda m: m.__setitem__(1, nn.ReLU()),
    "a layer appended": lambda m: m.append(nn.Tanh()),
    "a layer deleted": lambda m: m.__delitem__(3),
    "weights swapped to float64": lambda m: setattr(m[0].weight, "data", m[0].weight.data.double()),
    "weights swapped to another shape": lambda m: setattr(m[4].bias, "data", torch.zeros(5)),
    "a parameter replaced": lambda m: setattr(m[0], "weight", nn.Parameter(m[0].weight.detach().clone())),
    "a parameter removed": lambda m: setattr(m[4], "bias", None),
}


@pytest.mark.parametrize("container", [lambda m: m, list])
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_model_changed_after_its_task_was_built_is_refused_before_anything_changes(edit, container):
    model = container(plain_mlp())
    task = ht.ModelTask(model, loss_fn=lm_loss, data=batches(2))
    EDITS[edit](model)
    before = snapshot(nn.Sequential(*model))
    with pytest.raises(ValueError, match=f"{task.name}.*changed after its ModelTask was built"):
        ht.train(task, devices="cpu", progress=False)
    assert unchanged(nn.Sequential(*model), before)


def test_a_hugging_face_model_changed_after_its_task_was_built_is_refused():
    pytest.importorskip("transformers")
    from test_hf_gpt2 import batches as gpt2_batches, tiny_gpt2

    model = tiny_gpt2()
    task = ht.ModelTask(model, data=gpt2_batches(1))
    model.transformer.h[1] = copy.deepcopy(model.transformer.h[0])
    with pytest.raises(ValueError, match="changed after its ModelTask was built"):
        ht.train(task, devices="cpu", progress=False)
    model = tiny_gpt2()
    task = ht.ModelTask(model, data=gpt2_batches(1))
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    with pytest.raises(ValueError, match="changed after its ModelTask was built"):
        ht.train(task, devices="cpu", progress=False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("spilled, shards", [(False, None), (True, None), (False, "auto")])
def test_a_task_trained_again_continues(spilled, shards, precision):
    # ht.train rebinds the parameters' data while it trains and writes it back as it was: not a change.
    model = reused_linear()
    task = ht.ModelTask(model, loss_fn=lm_loss, data=batches(2), precision=precision, shards=shards,
                        param_groups=[{"params": "*.bias", "weight_decay": 0.0}])
    budget = spilled_budget(reused_linear(), None) if spilled else 2**26
    first = ht.train(task, devices="cpu", memory_budget=budget, progress=False)[0]
    after_first = [p.detach().clone() for p in model.parameters()]
    second = ht.train(task, devices="cpu", memory_budget=budget, progress=False)[0]
    assert first.ok and second.ok and second.steps == 2 and first.resident == second.resident
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), after_first))


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(batches(2))


def test_a_loader_over_an_iterable_dataset_is_unsized_data():
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    with pytest.raises(TypeError, match="data must be a sized iterable of batches"):
        ht.ModelTask(plain_mlp(), loss_fn=lm_loss, data=loader)
    with pytest.raises(TypeError, match="eval_data must be a sized iterable of batches"):
        ht.ModelTask(plain_mlp(), loss_fn=lm_loss, data=batches(1), eval_data=loader)


@pytest.mark.parametrize("name", ["", ".", ".."])
def test_a_name_that_names_no_directory_of_its_own_is_refused(name):
    with pytest.raises(ValueError, match="task name"):
        ht.ModelTask(plain_mlp(), loss_fn=lm_loss, data=batches(1), name=name)


@pytest.mark.parametrize("name", [5, b"bytes", ("a",)])
def test_a_name_that_is_not_a_str_is_refused(name):
    with pytest.raises(TypeError, match="name must be a str"):
        ht.ModelTask(plain_mlp(), loss_fn=lm_loss, data=batches(1), name=name)


def with_dropout(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, CLASSES))


@pytest.mark.parametrize("spilled", [False, True])
def test_a_model_in_eval_mode_trains_so_and_the_call_says_so(spilled):
    """A model left in eval mode (as from_pretrained leaves one) trains as a plain loop would train it, without
    dropout; since transformers.Trainer would train it in train mode, the call warns, naming the task."""
    ours, theirs = OPTIMIZERS["adamw"]
    data = batches(3)
    reference = with_dropout().eval()
    reference_losses = train_plain(reference, data, theirs, seed=SEED)
    model = with_dropout().eval()
    budget = spilled_budget(model, None) if spilled else 2**26
    with pytest.warns(UserWarning, match=r"task 'task\d+'.* eval mode .*1 dropout.*model\.train\(\)"):
        result = train_hydra(model, data, ours(), budget)[0]
    assert result.resident == (not spilled)
    assert result.losses == pytest.approx(reference_losses, rel=1e-6)
    assert max_relative_error(model, reference) <= 1e-6
    assert not any(m.training for m in model.modules()), "the model's mode is left as it was"
    frozen_norm = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, CLASSES))
    frozen_norm[1].eval()  # frozen on purpose in a model that trains
    batch_statistics = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, track_running_stats=False),
                                     nn.Linear(16, CLASSES)).eval()
    for quiet in (with_dropout(), nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, CLASSES)).eval(),
                  frozen_norm, batch_statistics):
        # In train mode, with nothing whose mode changes what it computes, or a layer in eval mode on purpose.
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*eval mode.*")
            assert train_hydra(quiet, data, ours(), 2**26)[0].ok


def test_explicit_groups_may_cut_inside_a_nested_sequential():
    """A plain nn.Sequential in the model runs its layers one after another: groups may cut between them, or hold
    the whole model, and train as plain PyTorch does."""
    def nested(seed=0):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 16), nn.Tanh()),
                             nn.Linear(16, CLASSES))
    ours, theirs = OPTIMIZERS["adamw"]
    data = batches(3)
    reference = nested()
    reference_losses = train_plain(reference, data, theirs, seed=SEED)
    for cut in (lambda m: [[m[0], m[1][0]], [m[1][1], m[1][2], m[2]]], lambda m: [[m]]):
        model = nested()
        result = train_hydra(model, data, ours(), 2**26, shards=cut(model))[0]
        assert result.losses == pytest.approx(reference_losses, rel=1e-6)
        assert max_relative_error(model, reference) <= 1e-6
    model = nested()
    with pytest.raises(ValueError, match=r"layer 2 \(Linear\) is missing"):
        ht.ModelTask(model, loss_fn=lm_loss, data=data, shards=[[model[0], model[1][0]], [model[2]]])
