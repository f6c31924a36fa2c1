"""A parameter that receives no gradient in a step is left alone, as torch.optim leaves a parameter whose .grad
is None: no update (not even weight decay), no change to its optimizer state, and its own step count (Adam's
bias correction, SGD's first momentum step) does not advance. Compared with plain PyTorch on the same model,
data and seed: never-used layers, layers used only on some batches, tied weights used through either shard,
resident and spilled, with gradient accumulation and with clipping."""
import pytest
import torch
from torch import nn

import hydra_torch as ht
from models import lm_loss, max_relative_error, model_bytes, train_plain

IN, WIDTH, CLASSES = 6, 8, 5
# Batch sizes choose the branches below: 4 -> the "b4" layers, 3 -> the "b3" layers, 5 -> neither. Each branch
# skips steps, and the b3 layers first run in the third batch, so per-parameter step counts drift apart.
SIZES = [4, 5, 3, 4, 4, 3, 5, 5, 3, 3, 4, 5]
SEED = 7
TOLERANCE = 1e-6

OPTIMIZERS = {
    "adamw": (lambda: ht.optim.AdamW(lr=1e-2, weight_decay=0.05),
              lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)),
    "sgd_momentum": (lambda: ht.optim.SGD(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
                     lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1,
                                                    weight_decay=1e-3)),
}


class Pick(nn.Module):
    """Applies the layer listed for the batch size (then tanh); a batch size it does not list passes through."""

    def __init__(self, **layers: nn.Module):
        super().__init__()
        self.layers = nn.ModuleDict(layers)

    def forward(self, x):
        key = f"b{x.shape[0]}"
        return torch.tanh(self.layers[key](x)) if key in self.layers else x


class WithSpares(nn.Module):
    """A used layer between two that the forward never uses: the shard's parameters that step form one run in
    the middle of its buffer."""

    def __init__(self):
        super().__init__()
        self.before, self.used, self.after = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.used(x))


def branchy_model() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, WIDTH), WithSpares(),
                         Pick(b4=nn.Linear(WIDTH, WIDTH), b3=nn.Linear(WIDTH, WIDTH)),
                         nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, CLASSES))


def tied_model() -> nn.Sequential:
    """One weight used by shard 1 on batches of 4 and by shard 3 on batches of 3: stepped whenever either use
    gave it a gradient (at 3, through the borrower only), left alone on batches of 5."""
    torch.manual_seed(SEED)
    first, last = Pick(b4=nn.Linear(WIDTH, WIDTH)), Pick(b3=nn.Linear(WIDTH, WIDTH))
    last.layers["b3"].weight = first.layers["b4"].weight
    return nn.Sequential(nn.Linear(IN, WIDTH), first, nn.Linear(WIDTH, WIDTH), last, nn.Linear(WIDTH, CLASSES))


MODELS = {"branchy": branchy_model, "tied": tied_model}


def batches():
    """(features, class labels): lm_loss is cross-entropy over the last dimension, as the reference uses."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(n, IN, generator=g), torch.randint(0, CLASSES, (n,), generator=g)) for n in SIZES]


# The reference is models.train_plain: its optimizer.zero_grad() sets every .grad to None, so a parameter that no
# batch of a step reached is skipped by that step.


def train_hydra(model, data, optimizer, resident, **options):
    task = ht.ModelTask(model, optimizer=optimizer, loss_fn=lm_loss, data=data, **options)
    if resident:
        budget = 100 * model_bytes(model)
    else:  # room for one shard at a time: every shard is spilled and stepped on the host
        store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, False)
        budget = ht._C.DeviceEngine.spilled_need(store) + 1024
    result = ht.train([task], devices="cpu", memory_budget=budget, progress=False)[0]
    assert result.error is None, result.error
    assert result.resident == resident
    return result


def check_against_plain(make_model, optimizer, resident, accumulate=1, clip=None):
    ours, theirs = OPTIMIZERS[optimizer]
    data = batches()
    reference = make_model()
    reference_losses = train_plain(reference, data, theirs, accumulate=accumulate, clip=clip)
    model = make_model()
    spare = {name: p.detach().clone() for name, p in model.named_parameters() if ".before." in name or ".after." in name}
    result = train_hydra(model, data, ours(), resident, accumulate=accumulate, clip_grad_norm=clip)
    for name, p in model.named_parameters():
        if name in spare:
            assert torch.equal(p, spare[name]), f"{name} is never used and must not move"
    assert max_relative_error(model, reference) <= TOLERANCE
    assert result.losses == pytest.approx(reference_losses, rel=TOLERANCE)


@pytest.mark.parametrize("resident", [False, True], ids=["spilled", "resident"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_unused_parameters_are_left_alone(model, optimizer, resident):
    check_against_plain(MODELS[model], optimizer, resident)


@pytest.mark.parametrize("resident", [False, True], ids=["spilled", "resident"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_a_parameter_used_by_any_micro_batch_steps(model, optimizer, resident):
    check_against_plain(MODELS[model], optimizer, resident, accumulate=2)


@pytest.mark.parametrize("resident", [False, True], ids=["spilled", "resident"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("model", list(MODELS))
def test_clipped_steps_leave_unused_parameters_alone(model, optimizer, resident):
    check_against_plain(MODELS[model], optimizer, resident, clip=0.5)


@pytest.mark.parametrize("resident", [False, True], ids=["spilled", "resident"])
def test_modules_come_back_clean(resident):
    """No hook or other trace of the training is left on the parameters: a hook of the user's keeps working
    (it was called during training, as in plain PyTorch), and plain PyTorch training afterwards matches."""
    data = batches()
    reference, model = branchy_model(), branchy_model()
    calls = []

    def user_hook(grad):
        calls.append(grad.shape)

    hooked = model[3].weight
    handle = hooked.register_hook(user_hook)
    ours, theirs = OPTIMIZERS["adamw"]
    train_plain(reference, data, theirs)
    train_hydra(model, data, ours(), resident)
    assert len(calls) == len(data), "the user's hook is called once per batch, as in plain PyTorch"
    for name, p in model.named_parameters():
        hooks = p._backward_hooks
        if p is hooked:
            assert list(hooks.values()) == [user_hook], name
        else:
            assert not hooks, f"{name} has hooks left: {hooks}"
        assert not getattr(p, "_post_accumulate_grad_hooks", None), name
        assert p.grad is None, name
    handle.remove()
    # Plain PyTorch goes on from here exactly as from the reference's state (both optimizers start fresh).
    train_plain(reference, data, theirs)
    train_plain(model, data, theirs)
    assert max_relative_error(model, reference) <= TOLERANCE
