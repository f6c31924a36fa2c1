"""Parameter groups: some parameters with another learning rate or weight decay, as torch.optim's param_groups,
checked against torch.optim given the same groups, spilled and resident; transformers.Trainer's no-decay rule;
groups that cannot be used are refused when the task is made."""
import copy

import pytest
import torch
from torch import nn
from transformers.trainer_pt_utils import get_parameter_names

import hydra_torch as ht
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain

LR, DECAY = 1e-2, 0.1


def torch_groups(model, decayed_names, **others):
    """torch.optim param groups: the named parameters decay, the rest do not."""
    decayed = [p for n, p in model.named_parameters() if n in decayed_names]
    rest = [p for n, p in model.named_parameters() if n not in decayed_names]
    return [{"params": decayed}, {"params": rest, "weight_decay": 0.0, **others}]


@pytest.mark.parametrize("resident", [True, False])
def test_no_weight_decay_on_biases_and_norms_equals_torch_optim_with_trainers_groups(resident):
    model = tied_transformer(seed=8, dropout=0.0, blocks=2)
    reference = copy.deepcopy(model)
    # transformers.Trainer.get_decay_parameter_names' rule, computed by transformers itself
    decayed = set(get_parameter_names(reference, [nn.LayerNorm],
                                      [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]))
    assert any("bias" in n for n, _ in reference.named_parameters() if n not in decayed)
    data = token_batches(6)
    train_plain(reference, data, lambda p: torch.optim.AdamW(torch_groups(reference, decayed), lr=LR,
                                                               weight_decay=DECAY))
    task = ht.ModelTask(model, data=data, loss_fn=lm_loss, optimizer=ht.optim.AdamW(lr=LR, weight_decay=DECAY),
                        param_groups=[{"params": ht.optim.NO_WEIGHT_DECAY, "weight_decay": 0.0}])
    budget = "1GiB" if resident else int(1.5 * model_bytes(model))
    result = ht.train(task, devices="cpu", memory_budget=budget, progress=False)[0]
    assert result.error is None and result.resident == resident
    assert max_relative_error(model, reference) <= 1e-6


@pytest.mark.parametrize("resident", [True, False])
def test_groups_by_pattern_and_module_type_set_their_own_rate(resident):
    model = tied_transformer(seed=9, dropout=0.0, blocks=2)
    reference = copy.deepcopy(model)
    slow = {n for n, _ in reference.named_parameters() if n.endswith(".bias") or n.startswith("3.")}  # 3: LayerNorm
    fast = [p for n, p in reference.named_parameters() if n not in slow]
    data = token_batches(6)
    train_plain(reference, data, lambda p: torch.optim.SGD(
        [{"params": fast}, {"params": [p for n, p in reference.named_parameters() if n in slow], "lr": 0.01}],
        lr=0.1, momentum=0.9))
    task = ht.ModelTask(model, data=data, loss_fn=lm_loss, optimizer=ht.optim.SGD(lr=0.1, momentum=0.9),
                        param_groups=[{"params": ["*.bias", lambda name, p: name.startswith("3.")], "lr": 0.01}])
    budget = "1GiB" if resident else int(1.5 * model_bytes(model))
    result = ht.train(task, devices="cpu", memory_budget=budget, progress=False)[0]
    assert result.error is None and result.resident == resident
    assert max_relative_error(model, reference) <= 1e-6


def test_the_first_group_that_selects_a_parameter_wins():
    model = tied_transformer(seed=10, dropout=0.0, blocks=1)
    task = ht.ModelTask(model, data=token_batches(2), loss_fn=lm_loss, optimizer=ht.optim.AdamW(lr=LR),
                        param_groups=[{"params": nn.LayerNorm, "lr": 0.5}, {"params": "*.bias", "lr": 0.25}])
    by_name = {n: task.param_options[id(p)][1] for n, p in model.named_parameters() if id(p) in task.param_options}
    assert by_name["1.ln1.bias"] == 0.5 and by_name["1.proj.bias"] == 0.25 and "1.proj.weight" not in by_name


@pytest.mark.parametrize("groups,error,match", [
    ([{"params": "*.nothing", "lr": 0.1}], ValueError, r"param_groups\[0\] selects no parameter"),
    ([{"params": nn.Conv2d, "weight_decay": 0.0}], ValueError, "selects no parameter"),
    ([{"params": "*.bias", "momentum": 0.5}], ValueError, "sets only 'lr' and 'weight_decay'"),
    ([{"params": "*.bias", "lr": -1.0}], ValueError, r"\['lr'\] must be a finite number >= 0"),
    ([{"params": "*.bias", "weight_decay": float("nan")}], ValueError, "must be a finite number"),
    ([{"lr": 0.1}], TypeError, "must be a dict with 'params'"),
    ([{"params": 3, "lr": 0.1}], TypeError, "use a name pattern"),
    ({"params": "*.bias"}, TypeError, "param_groups must be a list"),
])
def test_groups_that_cannot_be_used_are_refused_when_the_task_is_made(groups, error, match):
    with pytest.raises(error, match=match):
        ht.ModelTask(tied_transformer(blocks=1), data=token_batches(2), loss_fn=lm_loss, param_groups=groups)


def test_a_checkpoint_taken_with_other_groups_is_refused(tmp_path):
    def task(decay):
        return ht.ModelTask(tied_transformer(blocks=1), data=token_batches(2), loss_fn=lm_loss, name="t",
                            param_groups=[{"params": "*.bias", "weight_decay": decay}])
    ht.train(task(0.0), devices="cpu", progress=False, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="resume with the same optimizer"):
        ht.train(task(0.5), devices="cpu", progress=False, checkpoint_dir=tmp_path)
