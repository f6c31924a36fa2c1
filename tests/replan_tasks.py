"""What the re-plan tests share: a tied transformer with a layer that raises torch.OutOfMemoryError when told to (as
a device allocation in its shard would), its plain PyTorch reference, and its task."""
import torch
from torch import nn

import hydra_torch as ht
from models import lm_loss, tied_transformer, train_plain

SEED = 123
TOLERANCE = 1e-5  # as the equivalence tests: spilled steps run on the host, resident ones as torch.optim's
ADAMW = (lambda: ht.optim.AdamW(lr=3e-3, weight_decay=0.05),
         lambda params: torch.optim.AdamW(params, lr=3e-3, weight_decay=0.05))


class OutOfMemoryWhen(nn.Module):
    """Passes its input through; raises torch.OutOfMemoryError when `fail(self)` says so (it sees `calls`, this
    call's number from 1, and `shard`, the modules of the shard holding it)."""

    def __init__(self, fail=None):
        super().__init__()
        self.fail = fail
        self.calls = 0
        self.task = None
        self.raised = 0

    @property
    def shard(self):
        return next(group for group in self.task.modules if any(m is self for m in group))

    def forward(self, x):
        self.calls += 1
        if self.fail is not None and self.fail(self):
            self.raised += 1
            raise torch.OutOfMemoryError("injected: the device has no room for this unit")
        return x


def model_with(fail=None, dropout=0.1, blocks=4):
    """tied_transformer's layers with the failing layer after the second block."""
    base = tied_transformer(seed=0, blocks=blocks, dropout=dropout)
    layers = list(base)
    oom = OutOfMemoryWhen(fail)
    return nn.Sequential(*layers[:3], oom, *layers[3:]), oom


def reference(data, accumulate=1, blocks=4):
    model, _ = model_with(blocks=blocks)
    losses = train_plain(model, data, ADAMW[1], accumulate=accumulate, seed=SEED)
    return model, losses


def untied_trainable(task, model) -> list[int]:
    """The task's shards that hold neither end of the tied embedding and head, and have weights to train."""
    return [s for s, group in enumerate(task.modules) if model[0] not in group and model[-1] not in group
            and any(p.requires_grad for m in group for p in m.parameters())]


def task_for(model, oom, data, **options):
    task = ht.ModelTask(model, optimizer=ADAMW[0](), loss_fn=lm_loss, data=data, **options)
    oom.task = task
    return task
