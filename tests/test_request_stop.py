"""ModelTask.request_stop: one task stops at its next step boundary while the others train on; with
checkpoints, its checkpoint of that step is on disk before it ends, and a later call continues it exactly."""
import warnings

import pytest
import torch

import hydra_torch as ht
from hydra_torch.state import checkpoint
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches

SEED = 123


class StopAt:
    """lm_loss that asks its task to stop at its `calls`-th call, and notes what it sees on disk later."""

    def __init__(self, calls):
        self.calls, self.seen, self.task = calls, 0, None

    def __call__(self, output, batch):
        self.seen += 1
        if self.seen == self.calls:
            self.task.request_stop("enough of this one")
        return lm_loss(output, batch)


class Watch:
    """lm_loss that records, at each call, the steps of another task's checkpoint on disk."""

    def __init__(self, root, name):
        self.root, self.name, self.seen = root, name, []

    def __call__(self, output, batch):
        self.seen.append(checkpoint.steps_taken(self.root, self.name))
        return lm_loss(output, batch)


def tasks(root, stop_at=None, clip=None):
    stopper = StopAt(stop_at) if stop_at else lm_loss
    a = ht.ModelTask(tied_transformer(seed=0, blocks=2), optimizer=ht.optim.AdamW(lr=3e-3), loss_fn=stopper,
                     data=token_batches(10), name="a", clip_grad_norm=clip)
    if stop_at:
        stopper.task = a
    watch = Watch(root, "a")
    b = ht.ModelTask(tied_transformer(seed=1, blocks=3), optimizer=ht.optim.AdamW(lr=3e-3), loss_fn=watch,
                     data=token_batches(20, seed=5), name="b")
    return a, b, watch


def test_a_task_asked_to_stop_ends_at_its_step_boundary_checkpointed_and_resumes_exactly(tmp_path):
    a, b, watch = tasks(tmp_path / "ckpt", stop_at=5)
    torch.manual_seed(SEED)
    budget = int(1.5 * model_bytes(b.model))  # spilled: the steps run on the host, beside the compute
    results = ht.train([a, b], devices=["cpu", "cpu"], memory_budget=budget, progress=False,
                       checkpoint_dir=tmp_path / "ckpt")
    assert results["a"].cut_short == "enough of this one" and results["a"].steps == 5
    assert a.stopped_on_request and a.ended.is_set() and a.stop_reason is None  # the request ends with the call
    assert results["b"].cut_short is None and results["b"].steps == 20
    assert 5 in watch.seen, "a's checkpoint of step 5 was on disk while b still trained"
    assert results.interrupted is None
    # The same call again continues a from step 5 (b is done) and ends as an undisturbed run of a.
    again, _, _ = tasks(tmp_path / "ckpt")
    torch.manual_seed(SEED)
    resumed = ht.train([again], devices=["cpu", "cpu"], memory_budget=budget, progress=False,
                       checkpoint_dir=tmp_path / "ckpt")[0]
    whole, _, _ = tasks(tmp_path / "other")
    torch.manual_seed(SEED)
    plain = ht.train([whole], devices=["cpu", "cpu"], memory_budget=budget, progress=False)[0]
    assert resumed.steps == 10 and resumed.losses == plain.losses
    assert max_relative_error(again.model, whole.model) == 0.0


@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("budget_fraction", [None, 1.5])
def test_without_checkpoints_it_just_stops(clip, budget_fraction):
    # Clipped, the step is counted once its norm is read, before the task's next unit: the stop comes after it.
    a, b, _ = tasks("unused", stop_at=3, clip=clip)
    torch.manual_seed(SEED)
    budget = budget_fraction and int(budget_fraction * model_bytes(b.model))
    results = ht.train([a, b], devices="cpu", memory_budget=budget, progress=False)
    assert results["a"].steps == 3 and results["a"].cut_short == "enough of this one"
    assert len(results["a"].losses) == 3
    assert results["b"].steps == 20 and results["b"].ok
    whole = ht.ModelTask(tied_transformer(seed=0, blocks=2), optimizer=ht.optim.AdamW(lr=3e-3), loss_fn=lm_loss,
                         data=token_batches(10), name="a", clip_grad_norm=clip, max_steps=3)
    torch.manual_seed(SEED)
    ht.train([whole], devices="cpu", memory_budget=budget, progress=False)
    assert max_relative_error(a.model, whole.model) == 0.0


def test_a_request_made_between_calls_is_for_the_next_call_which_drops_it_at_its_end():
    # hydra_torch.cluster asks a task about to train to stop so: the next call ends it at its first step boundary,
    # the other task training on, and the call's end drops the request.
    a, b, _ = tasks("unused")
    a.request_stop("before the call")
    results = ht.train([a, b], devices="cpu", progress=False)
    assert results["a"].steps == 0 and results["a"].cut_short == "before the call"
    assert results["b"].ok and results["b"].steps == 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # cut short before its first step: the next call loses nothing
        again = ht.train([a], devices="cpu", progress=False)
    assert again["a"].ok and again["a"].steps == 10 and again["a"].cut_short is None


def test_a_task_cut_short_and_trained_again_without_its_checkpoint_is_warned_of(tmp_path):
    # A notebook cell run again after a Ctrl-C trains the task from the start of its data, schedule and optimizer
    # state, silently before; with its checkpoint the call resumes it, and a task that ended or took no step warns
    # of nothing.
    a, b, _ = tasks("unused", stop_at=3)
    ht.train([a, b], devices="cpu", progress=False)
    with pytest.warns(RuntimeWarning, match=r"task 'a' was cut short after 3 of its 10 steps by an earlier call"):
        assert ht.train([a, b], devices="cpu", progress=False)["a"].steps == 10
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ht.train([a, b], devices="cpu", progress=False)  # both ended: nothing to warn of
        a, _, _ = tasks("unused", stop_at=3)
        assert ht.train([a], devices="cpu", progress=False, checkpoint_dir=tmp_path)["a"].cut_short
        assert ht.train([a], devices="cpu", progress=False, checkpoint_dir=tmp_path)["a"].steps == 10
