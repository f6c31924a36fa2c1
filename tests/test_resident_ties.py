"""A tied embedding resident alone, the head that borrows it spilled: where the lane model wishes it (here its choice
is replaced by that wish), the engine keeps the embedding's state on the device, and the head's visits read the
shared weight in its home and sum their gradient of it there, copying none of it. Training must still be plain
PyTorch training, and the same, bit for bit, as with every shard stepped on the host; a checkpoint resumes under
another placement."""
import _thread
import contextlib
import signal
from unittest import mock

import pytest
import torch

from hydra_torch import testing
from hydra_torch.run import lane_choice
from models import lm_loss, max_relative_error, tied_transformer, token_batches, train_plain
import placed_training
from placed_training import SEED, params

# tied_transformer(): the embedding, five blocks, the final norm and the tied head, cut so that the last shard owns
# blocks 4-5 and the norm besides the head: at twice the fp32 weights the engine's rule keeps no end resident (both
# ends' homes do not fit), and the embedding's alone does.
CUT = [0, 1, 4]
OWNER_ALONE = "spilled, shard 0 resident"


def train(placement, budget_fraction=2.0, model=None, wish=None, **options):
    """One task of the tied model cut at CUT; with `wish` (per shard: "host", "device" or "resident"), under "auto"
    on an emulated link and host, the lane model's choice replaced by it."""
    model = model or tied_transformer(dropout=0.0)
    with contextlib.ExitStack() as stack:
        if wish is not None:
            chosen = lane_choice.plan

            def wished(*args):
                planned = chosen(*args)
                assert planned is not None, "the lane model was asked"
                return [list(wish)], planned[1]
            stack.enter_context(mock.patch.object(lane_choice, "plan", wished))
            stack.enter_context(testing.emulated_link(1e10))
            stack.enter_context(testing.emulated_host(1e10))
        results = placed_training.train(model, token_batches(6), placement, budget_fraction, shards=CUT, name="tied",
                                        **options)
    return results, model


OWNER = ["resident", "host", "host"]


def test_the_rule_keeps_no_end_resident_here():
    results, _ = train("auto", wish=["host"] * 3)
    assert results[0].placement == "spilled", results.summary()


@pytest.mark.parametrize("options", [{}, {"accumulate": 2, "clip_grad_norm": 0.3}, {"precision": "bf16"}],
                         ids=["plain", "clip_accumulate", "bf16"])
def test_an_embedding_resident_alone_trains_its_spilled_head_as_plain_pytorch(options):
    results, model = train("auto", wish=OWNER, **options)
    result, stats = results[0], results.stats[0]
    assert result.placement == OWNER_ALONE, results.summary()
    assert {(e.shard, e.place) for e in results.steps} == {(0, "resident"), (1, "host"), (2, "host")}
    assert stats["high_water_bytes"] <= stats["budget_bytes"]
    host, host_model = train("host", **options)
    assert host[0].placement == "spilled"
    if "precision" in options:
        # In bf16 the head's gradient of the tie and the embedding's own sum in bf16 in the home (as where both are
        # resident), on the host in fp32: close, not bit for bit.
        assert result.losses == pytest.approx(host[0].losses, rel=1e-3)
        assert max_relative_error(model, host_model) <= 2e-2
    else:
        assert result.losses == host[0].losses
        assert all(torch.equal(a, b) for a, b in zip(params(model), params(host_model)))
    # The head's visits copy in its own weights only: less comes in than with the embedding spilled, though its
    # upload came in once.
    assert stats["host_to_device_bytes"] < host.stats[0]["host_to_device_bytes"]
    assert model[0].weight is model[-1].weight
    if "precision" in options:
        return  # bf16 is compared with the host-stepped run above; plain PyTorch in fp32 below
    reference = tied_transformer(dropout=0.0)
    losses = train_plain(reference, token_batches(6), lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.05),
                         accumulate=options.get("accumulate", 1), clip=options.get("clip_grad_norm"), seed=SEED)
    assert result.losses == pytest.approx(losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5


def test_a_device_stepped_head_of_a_resident_embedding_ends_as_on_the_host():
    """The head stepped on the device: it sums its gradient of the tie in the embedding's home, steps its own on the
    device, and sends nothing of the tie out."""
    # Room for the head's step beside the embedding's home.
    results, model = train("auto", 2.5, wish=["resident", "host", "device"], clip_grad_norm=0.5)
    assert results[0].placement == OWNER_ALONE + ", shard 2 stepped on the device", results.summary()
    assert {(e.shard, e.place) for e in results.steps} == {(0, "resident"), (1, "host"), (2, "device")}
    host, host_model = train("host", 2.5, clip_grad_norm=0.5)
    assert results[0].losses == host[0].losses
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(host_model)))


def test_a_checkpoint_of_a_resident_embedding_resumes_spilled_and_back_bit_for_bit(tmp_path):
    _, straight = train("host")
    first, model = train("auto", wish=OWNER, max_steps=3, checkpoint_dir=tmp_path / "a")
    assert first[0].placement == OWNER_ALONE and first[0].steps == 3
    resumed, _ = train("host", model=model, checkpoint_dir=tmp_path / "a")
    assert resumed[0].steps == 6
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(straight)))
    # And the other way round: three steps with every shard on the host, three with the embedding resident.
    first, model = train("host", max_steps=3, checkpoint_dir=tmp_path / "b")
    resumed, _ = train("auto", model=model, wish=OWNER, checkpoint_dir=tmp_path / "b")
    assert resumed[0].placement == OWNER_ALONE and resumed[0].steps == 6
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(straight)))


def test_a_frozen_embedding_resident_alone_lends_itself_to_its_head_as_on_the_host():
    """The tie frozen (as under a LoRA recipe): the embedding's home holds only its weight, the head reads it there and
    trains its blocks and norm as on the host, bit for bit, and as plain PyTorch."""
    def frozen():
        model = tied_transformer(dropout=0.0)
        model[0].weight.requires_grad_(False)
        return model
    results, model = train("auto", model=frozen(), wish=OWNER)
    assert results[0].placement == OWNER_ALONE, results.summary()
    host, host_model = train("host", model=frozen())
    assert results[0].losses == host[0].losses
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(host_model)))
    assert results.stats[0]["host_to_device_bytes"] < host.stats[0]["host_to_device_bytes"]
    reference = frozen()
    losses = train_plain(reference, token_batches(6),
                         lambda p: torch.optim.AdamW([q for q in p if q.requires_grad], lr=3e-3, weight_decay=0.05),
                         seed=SEED)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5
    assert torch.equal(model[0].weight, reference[0].weight)


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen"])
def test_the_lane_model_is_told_what_the_head_borrows_frozen_or_not(frozen):
    """The head's shape says how many of the elements it reads are the embedding's (its 7th element): what its
    visits leave uncopied beside a resident embedding, though a frozen tie is not among its gradients."""
    model = tied_transformer(dropout=0.0)
    if frozen:
        model[0].weight.requires_grad_(False)
    shapes, shape = [], lane_choice.task_shape

    def told(*args):
        shapes.append(shape(*args))
        return shapes[-1]
    with mock.patch.object(lane_choice, "task_shape", told):
        train("auto", model=model, wish=["host"] * 3)
    head = shapes[0][0][-1]
    _, grads, own, tied_to, borrowed = head[2:]
    assert tied_to == 0 and borrowed == model[0].weight.numel()
    assert grads - own == (0 if frozen else borrowed)
    assert all(shard[6] == 0 for shard in shapes[0][0][:-1])


def ctrl_c_at(call):
    """The LM loss, sending Ctrl-C to the process at its `call`-th call."""
    calls = [0]

    def loss(out, batch):
        calls[0] += 1
        if calls[0] == call:
            _thread.interrupt_main()
        return lm_loss(out, batch)
    return loss


def test_ctrl_c_brings_a_resident_embedding_home_at_a_step_boundary(monkeypatch):
    """Ctrl-C in the third step: the task ends that step, and the embedding's home is written back to the model,
    tied to the head as before, where the steps taken leave it on the host."""
    monkeypatch.setattr(placed_training, "lm_loss", ctrl_c_at(3))
    with pytest.warns(RuntimeWarning, match="stopped by Ctrl-C"):
        results, model = train("auto", wish=OWNER)
    result = results[0]
    assert result.placement == OWNER_ALONE and result.cut_short == "Ctrl-C" and 3 <= result.steps < 6
    assert model[0].weight is model[-1].weight and model[0].weight.grad is None
    monkeypatch.setattr(placed_training, "lm_loss", lm_loss)
    host, host_model = train("host", max_steps=result.steps)
    assert result.losses == host[0].losses
    assert all(torch.equal(a, b) for a, b in zip(params(model), params(host_model)))


def test_a_second_ctrl_c_during_the_write_back_still_brings_the_embedding_home(monkeypatch):
    from hydra_torch.run.runner import TaskRunner
    restore, second = TaskRunner.restore_buffers, []

    def interrupt_again(runner):  # on the main thread, in the write-back
        if not second:
            second.append(runner.task.name)
            signal.raise_signal(signal.SIGINT)
        restore(runner)
    monkeypatch.setattr(TaskRunner, "restore_buffers", interrupt_again)
    monkeypatch.setattr(placed_training, "lm_loss", ctrl_c_at(3))
    model = tied_transformer(dropout=0.0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # the held Ctrl-C raises
    try:
        with pytest.raises(KeyboardInterrupt):
            train("auto", model=model, wish=OWNER)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert second, "the second Ctrl-C came during the write-back"
    assert model[0].weight is model[-1].weight
    for p in model.parameters():
        assert p.device.type == "cpu" and p.grad is None and torch.isfinite(p).all()
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), "a view into shared memory"
