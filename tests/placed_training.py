"""One tied test model trained alone under a given placement: what the tests of shards placed apart (resident
ends, device-stepped shards) share."""
import torch

import hydra_torch as ht
from hydra_torch.run import measuring
from models import lm_loss, model_bytes, tied_transformer, train_plain

SEED = 123


def adamw():
    return ht.optim.AdamW(lr=3e-3, weight_decay=0.05)


def budget_of(fraction, task, device="cpu"):
    """A budget whose arena is `fraction` times the task's fp32 weights, beside what ht.train keeps on `device` for
    one unit's working set and one micro-batch's saved inputs (measured there; nothing on a plain CPU device)."""
    return int(fraction * model_bytes(task.model)) + measuring.kept_beside_arena([task], device=device)


def train(model, data, placement, budget_fraction, devices="cpu", checkpoint_dir=None, host_threads=None, **options):
    """ht.train of one task of `model` under a budget whose arena is `budget_fraction` times its fp32 weights; it must
    end ok."""
    torch.manual_seed(SEED)
    task = ht.ModelTask(model, optimizer=options.pop("optimizer", None) or adamw(), loss_fn=lm_loss, data=data,
                        **options)
    budget = budget_of(budget_fraction, task, devices if isinstance(devices, str) else devices[0])
    results = ht.train([task], devices=devices, memory_budget=budget, progress=False, placement=placement,
                       checkpoint_dir=checkpoint_dir, host_threads=host_threads)
    assert results[0].ok, results[0].error
    return results


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def plain_reference(data):
    """The tied test model trained on `data` by plain PyTorch with the AdamW of adamw(): (model, losses)."""
    reference = tied_transformer()
    losses = train_plain(reference, data, lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05), seed=SEED)
    return reference, losses
