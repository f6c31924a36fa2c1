"""Checkpoints against hostile use: two runs on one directory, task names that are paths, manifests damaged by
hand, a resume that asks for something else, and a disk that refuses every write."""
import errno
import json
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch

import hydra_torch as ht
from hydra_torch.state import checkpoint, checkpoint_dirs
from models import lm_loss
from test_checkpoint import small_task

TESTS = os.path.dirname(__file__)

# A run of small_task's task "t" that stops in its first loss until its stdin is closed.
HELD_RUN = """
import sys
sys.path.insert(0, sys.argv[2])
import hydra_torch as ht
from models import lm_loss
from test_checkpoint import small_task

def loss_fn(output, batch):
    print("training", flush=True)
    sys.stdin.read()
    return lm_loss(output, batch)

task, _ = small_task()
task.loss_fn = loss_fn
ht.train(task, devices="cpu", progress=False, checkpoint_dir=sys.argv[1])
"""


def train(task, root, **options):
    return ht.train(task, devices="cpu", progress=False, checkpoint_dir=root, **options)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def unchanged(before, model):
    return all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def with_loss(loss_fn, **options):
    """small_task's task, with `loss_fn` for its loss."""
    task, _ = small_task(**options)
    task.loss_fn = loss_fn
    return task


# Two runs on one checkpoint_dir

def test_a_second_run_on_a_task_another_process_trains_is_refused_until_that_process_dies(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", HELD_RUN, str(tmp_path), TESTS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline() == "training\n"
        task, model = small_task()
        before = weights(model)
        with pytest.raises(ValueError, match=rf"checkpoints in .* are in use by another run \(pid {other.pid} on "):
            train(task, tmp_path)
        assert unchanged(before, model)
    finally:
        other.kill()  # SIGKILL: the OS lets go of its lock, which names it still
        other.wait()
    assert train(small_task()[0], tmp_path)[0].steps == 4


def test_a_run_is_refused_while_this_process_holds_the_task(tmp_path):
    (tmp_path / "t").mkdir()
    held = checkpoint_dirs.claim(tmp_path, "t")  # as another ht.train call of this process would
    with pytest.raises(ValueError, match="in use by another ht.train call in this process"):
        train(small_task()[0], tmp_path)
    held.release()
    assert train(small_task()[0], tmp_path)[0].steps == 4


def test_a_checkpoint_rewritten_between_its_reading_and_the_training_is_refused(tmp_path, monkeypatch):
    train(small_task(max_steps=2)[0], tmp_path)
    path = tmp_path / "t" / checkpoint.MANIFEST
    real = checkpoint.restore

    def restore_while_another_run_writes(loaded, runner):
        real(loaded, runner)
        path.write_text(json.dumps({**json.loads(path.read_text()), "steps": 3}))
    monkeypatch.setattr(checkpoint, "restore", restore_while_another_run_writes)
    with pytest.raises(ValueError, match="changed after this call read it .*step 3"):
        train(small_task()[0], tmp_path)


def test_every_exit_lets_go_of_the_tasks(tmp_path):
    calls = [0]

    def interrupted(output, batch):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return lm_loss(output, batch)
    with pytest.raises(KeyboardInterrupt):  # while training
        train(with_loss(interrupted), tmp_path, checkpoint_every=1)
    other, _ = small_task()
    other.optimizer = ht.optim.AdamW(lr=2e-3)
    with pytest.raises(ValueError, match="resume with the same optimizer"):  # while loading
        train(other, tmp_path)
    with pytest.raises(ValueError, match="memory budget too small"):  # after loading, before training
        train(small_task()[0], tmp_path, memory_budget=1000)
    result = train(small_task()[0], tmp_path)[0]
    assert result.steps == 4 and len(result.losses) == 4


def test_without_locks_a_run_warns_and_removes_only_the_files_it_wrote(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(checkpoint_dirs.fcntl, "flock", no_locks)
    foreign = tmp_path / "t" / "state-00000009-1.safetensors"  # another run's, for all this one can tell
    foreign.parent.mkdir()
    foreign.write_bytes(b"not this run's")
    with pytest.warns(RuntimeWarning, match="cannot be locked.*No locks available"):
        assert train(small_task(max_steps=2)[0], tmp_path, checkpoint_every=1)[0].steps == 2
    assert foreign.read_bytes() == b"not this run's"
    assert len(list(foreign.parent.glob("state-*"))) == 2


# Task names that are paths

def named(name, **options):
    """small_task's, named `name` after it was made: ModelTask refuses some of these names, and a name set
    afterwards reaches the checkpoints as it is."""
    task, model = small_task(**options)
    task.name = name
    return task, model


def test_task_names_that_are_dots_stay_inside_the_checkpoint_dir_and_apart(tmp_path):
    root = tmp_path / "checkpoints"
    train([named(".", max_steps=1)[0], named("..", max_steps=2)[0], small_task(name=".t")[0]], root)
    assert sorted(os.listdir(tmp_path)) == ["checkpoints"]
    assert len(os.listdir(root)) == 3 and not any(name.startswith(".") for name in os.listdir(root))
    assert [checkpoint.steps_taken(root, name) for name in (".", "..", ".t")] == [1, 2, 4]


def test_existing_names_keep_their_directories(tmp_path):
    train([small_task(name=name)[0] for name in ("t", "model 0", "a/b")], tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["a%2Fb", "model%200", "t"]


@pytest.mark.parametrize("name", ["", 5])
def test_a_task_name_that_cannot_name_a_directory_is_refused_before_anything_is_written(tmp_path, name):
    root = tmp_path / "checkpoints"
    task, model = named(name)
    before = weights(model)
    with pytest.raises(ValueError, match="task name"):
        train([small_task(name="fine")[0], task], root)
    assert not root.exists() and unchanged(before, model)


def test_a_checkpoint_of_another_task_is_refused(tmp_path):
    train(small_task(name="a")[0], tmp_path)
    os.rename(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ValueError, match="holds the checkpoint of task 'a', not of task 'b'"):
        train(small_task(name="b")[0], tmp_path)


# Manifests damaged by hand

def edit_field(field, value):
    """Sets the manifest's `field` to `value`; None: removes it."""
    def edit(manifest, directory):
        if value is None:
            del manifest[field]
        else:
            manifest[field] = value
        return json.dumps(manifest)
    return edit


def truncate_tensors(manifest, directory):
    tensors = directory / manifest["tensors"]
    tensors.write_bytes(tensors.read_bytes()[:1000])
    return json.dumps(manifest)


CORRUPTIONS = {
    "invalid JSON": (lambda manifest, directory: '{"format": 1, "steps": ', "not JSON"),
    "not an object": (lambda manifest, directory: "[1, 2]", "a JSON object"),
    "a missing key": (edit_field("losses", None), "'losses'"),
    "params of the wrong type": (edit_field("params", []), "'params'"),
    "a shape of the wrong type": (lambda manifest, directory: json.dumps(
        {**manifest, "params": {name: {**entry, "shape": "4x4"} for name, entry in manifest["params"].items()}}),
        "'params'"),
    "negative steps": (edit_field("steps", -5), "'steps'"),
    "steps as a string": (edit_field("steps", "4"), "'steps'"),
    "steps without their losses": (edit_field("steps", 100), "'losses'"),
    "a loss that is not a number": (edit_field("losses", [1.0, 2.0, "3", 4.0]), "'losses'"),
    "more epochs than steps": (edit_field("epochs_done", 3), "'epochs_done'"),
    "a tensor file elsewhere": (edit_field("tensors", "../../escaped.safetensors"), "'tensors'"),
    "a missing tensor file": (edit_field("tensors", "state-00000004-1.safetensors"), "'tensors'.*does not exist"),
    "a truncated tensor file": (truncate_tensors, "cannot read.*'tensors'"),
    "eval losses of the wrong shape": (edit_field("eval_losses", [[1]]), "'eval_losses'"),
    "a clipping norm that is not positive": (edit_field("clip_grad_norm", -1.0), "'clip_grad_norm'"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_manifest_damaged_by_hand_is_refused_naming_its_file_and_field(tmp_path, corruption):
    edit, field = CORRUPTIONS[corruption]
    train(small_task()[0], tmp_path)
    path = tmp_path / "t" / checkpoint.MANIFEST
    path.write_text(edit(json.loads(path.read_text()), path.parent))
    task, model = small_task()
    before = weights(model)
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}.*{field}"):
        train(task, tmp_path)
    assert unchanged(before, model)


# A resume that asks for something else

@pytest.mark.parametrize("first, then, done, message", [
    ({}, {"max_steps": 2}, 4, "max_steps=2"),
    ({"epochs": 2}, {}, 8, "epochs=1"),
])
def test_a_resume_past_the_steps_asked_for_is_refused(tmp_path, first, then, done, message):
    train(small_task(**first)[0], tmp_path)
    task, model = small_task(**then)
    before = weights(model)
    path = re.escape(str(tmp_path / "t" / checkpoint.MANIFEST))
    with pytest.raises(ValueError, match=rf"{path} has taken {done} steps.*{message}"):
        train(task, tmp_path)
    assert unchanged(before, model)


def schedule(step):
    return 1.0 / (1 + step)


def other_schedule(step):
    return 0.5


@pytest.mark.parametrize("first, then", [
    ({"lr_schedule": "linear"}, {"lr_schedule": "cosine"}),
    ({}, {"lr_schedule": "linear"}),
    ({"lr_schedule": "linear", "warmup_steps": 1}, {"lr_schedule": "linear", "warmup_steps": 2}),
    ({"lr_schedule": "linear"}, {"lr_schedule": schedule}),
    ({"lr_schedule": schedule}, {}),
])
def test_a_resume_with_another_lr_schedule_is_refused(tmp_path, first, then):
    train(small_task(max_steps=2, **first)[0], tmp_path)
    with pytest.raises(ValueError, match="resume with the same lr_schedule and warmup_steps"):
        train(small_task(max_steps=4, **then)[0], tmp_path)


def test_a_callable_lr_schedule_is_taken_to_be_the_same_callable(tmp_path):
    train(small_task(max_steps=2, lr_schedule=schedule)[0], tmp_path)
    assert train(small_task(max_steps=4, lr_schedule=other_schedule)[0], tmp_path)[0].steps == 4


@pytest.mark.parametrize("first, then", [
    ({}, {"clip_grad_norm": 1.0}),
    ({"clip_grad_norm": 1.0}, {"clip_grad_norm": 0.5}),
    ({"clip_grad_norm": 1.0}, {}),
])
def test_a_resume_with_other_clipping_is_refused(tmp_path, first, then):
    # Clipping is the recipe, as the learning rate is: the run resumed would be neither run.
    train(small_task(max_steps=2, **first)[0], tmp_path)
    task, model = small_task(max_steps=4, **then)
    before = weights(model)
    with pytest.raises(ValueError, match=r"was trained with clip_grad_norm=.*: resume with the same clipping"):
        train(task, tmp_path)
    assert unchanged(before, model)


def test_the_same_clipping_resumes_however_it_is_written_and_a_checkpoint_without_its_record_too(tmp_path):
    train(small_task(max_steps=2, clip_grad_norm=1)[0], tmp_path)
    assert train(small_task(max_steps=3, clip_grad_norm=torch.tensor(1.0))[0], tmp_path)[0].steps == 3
    path = tmp_path / "t" / checkpoint.MANIFEST  # as one written before clipping was recorded
    manifest = json.loads(path.read_text())
    assert manifest.pop("clip_grad_norm") == 1.0
    path.write_text(json.dumps(manifest))
    assert train(small_task(max_steps=4)[0], tmp_path)[0].steps == 4



HALVING = ht.SuccessiveHalving(min_steps=1, reduction_factor=2, metric="train_loss")


@pytest.mark.parametrize("first, then", [
    (HALVING, ht.SuccessiveHalving(min_steps=2, reduction_factor=2, metric="train_loss")),
    (None, HALVING),
    (HALVING, None),
], ids=["other rungs", "none then a rule", "a rule then none"])
def test_a_resume_under_another_selection_rule_is_refused(tmp_path, first, then):
    # A task's reports are kept by rung: under rungs at other steps they would stand for judgements never made.
    train(small_task(max_steps=2)[0], tmp_path, selection=first)
    task, model = small_task(max_steps=4)
    before = weights(model)
    with pytest.raises(ValueError, match=r"was trained under selection=.*: resume under the same rule"):
        train(task, tmp_path, selection=then)
    assert unchanged(before, model)


def test_the_same_rule_resumes_and_a_checkpoint_without_its_record_too(tmp_path):
    train(small_task(max_steps=2)[0], tmp_path, selection=HALVING)
    again = ht.SuccessiveHalving(min_steps=1, reduction_factor=2, metric="train_loss")
    assert train(small_task(max_steps=3)[0], tmp_path, selection=again)[0].steps == 3
    path = tmp_path / "t" / checkpoint.MANIFEST  # as one written before the rule was recorded
    manifest = json.loads(path.read_text())
    assert manifest.pop("selection") == {"rule": "SuccessiveHalving", "min_steps": 1, "reduction_factor": 2,
                                         "metric": "train_loss"}
    path.write_text(json.dumps(manifest))
    assert train(small_task(max_steps=4)[0], tmp_path, selection=again)[0].steps == 4

# A disk that refuses every checkpoint

def failing_writes(monkeypatch, fails):
    """Makes checkpoint writes fail where `fails(call)` (counting from 1); returns the list of calls."""
    real, calls = checkpoint.write, []

    def write(*args):
        calls.append(len(calls) + 1)
        if fails(len(calls)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args)
    monkeypatch.setattr(checkpoint, "write", write)
    return calls


def slow_loss(output, batch):
    time.sleep(0.3)  # each checkpoint is written before the next is due
    return lm_loss(output, batch)


def refused(caught):
    return [str(w.message) for w in caught if "could not be written" in str(w.message)]


def test_a_disk_that_refuses_every_checkpoint_warns_once_and_the_summary_counts_them(tmp_path, monkeypatch):
    calls = failing_writes(monkeypatch, lambda call: True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = train(with_loss(slow_loss), tmp_path, checkpoint_every=1)
    assert len(calls) == 4 and results.checkpoint_failures == 4
    [message] = refused(caught)
    assert str(tmp_path / "t") in message and "No space left on device" in message
    assert "4 checkpoints could not be written" in results.summary()


def test_writes_that_fail_again_after_one_succeeded_warn_again(tmp_path, monkeypatch):
    calls = failing_writes(monkeypatch, lambda call: call != 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = train(with_loss(slow_loss), tmp_path, checkpoint_every=1)
    assert len(calls) == 4 and results.checkpoint_failures == 3 and len(refused(caught)) == 2
    assert checkpoint.steps_taken(tmp_path, "t") == 3
    monkeypatch.undo()
    assert "checkpoint" not in train(small_task(max_steps=4)[0], tmp_path).summary()
