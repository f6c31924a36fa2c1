"""Checkpoints and resume: a run killed part-way and resumed ends as the uninterrupted run does."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import hydra_torch as ht
from hydra_torch.state import checkpoint
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches

RUN = os.path.join(os.path.dirname(__file__), "checkpoint_run.py")


def run(checkpoint_dir, out, *extra):
    return subprocess.run([sys.executable, RUN, str(checkpoint_dir), str(out), *map(str, extra)], capture_output=True,
                          text=True, timeout=600)


def same(a, b):
    assert a["losses"] == b["losses"]
    for weights_a, weights_b in zip(a["weights"], b["weights"]):
        assert weights_a.keys() == weights_b.keys()
        for name in weights_a:
            assert torch.equal(weights_a[name], weights_b[name]), name


@pytest.mark.parametrize("kill,placement", [("KILL", "spilled"), ("TERM", "spilled"), ("KILL", "resident"),
                                            ("TERM", "spilled, clipped")])
def test_a_run_killed_part_way_and_resumed_ends_bit_identical(tmp_path, kill, placement):
    # Clipped: the stop comes while the step of the signal's micro-batch is queued behind its norm.
    options = {"spilled": [], "resident": ["--resident"], "spilled, clipped": ["--clip"]}[placement]
    whole = run(tmp_path / "whole", tmp_path / "whole.pt", *options)
    assert whole.returncode == 0, whole.stderr
    killed = run(tmp_path / "resumed", tmp_path / "killed.pt", "--signal", kill, "--at", 7, *options)
    assert killed.returncode == -getattr(signal, f"SIG{kill}"), killed.stderr
    assert not (tmp_path / "killed.pt").exists()
    if kill == "TERM":
        assert "checkpointed in" in killed.stderr and "resumes it" in killed.stderr
    manifest = json.loads((tmp_path / "resumed" / "model%200" / "manifest.json").read_text())
    assert 0 < manifest["steps"] < 10
    resumed = run(tmp_path / "resumed", tmp_path / "resumed.pt", *options)
    assert resumed.returncode == 0, resumed.stderr
    whole, resumed = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    same(whole, resumed)
    assert resumed["units"] < whole["units"], "the resumed run did not start over"
    again = run(tmp_path / "resumed", tmp_path / "again.pt", *options)  # everything done: nothing to train
    again = torch.load(tmp_path / "again.pt")
    same(whole, again)
    assert again["units"] == 0


def small_task(width_seed=0, name="t", **options):
    model = tied_transformer(seed=width_seed, dropout=0.0, blocks=2)
    return ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=token_batches(4), name=name,
                        **options), model


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_before_anything_changes(tmp_path):
    task, _ = small_task()
    ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    other = tied_transformer(seed=1, dropout=0.0, blocks=3)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(ValueError, match="is of another model"):
        ht.train(ht.ModelTask(other, loss_fn=lm_loss, data=token_batches(4), name="t"), devices="cpu",
                 progress=False, checkpoint_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))
    task, _ = small_task()
    task.optimizer = ht.optim.AdamW(lr=2e-3)
    with pytest.raises(ValueError, match="resume with the same optimizer"):
        ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    task, _ = small_task()
    task.data = token_batches(5)
    with pytest.raises(ValueError, match="len\\(data\\) = 4"):
        ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)


def test_resume_on_another_shard_plan_and_device_list_continues_exactly(tmp_path):
    reference, reference_model = small_task(max_steps=4)
    budget = int(1.5 * model_bytes(reference_model))  # spilled: the largest shard (the tied embeddings) fits
    ht.train(reference, devices="cpu", memory_budget=budget, progress=False)
    first, _ = small_task(max_steps=2)
    assert not ht.train(first, devices="cpu", memory_budget=budget, progress=False, checkpoint_dir=tmp_path)[0].resident
    second, model = small_task(max_steps=4, shards=2)  # longer, and cut differently; now resident on two devices
    result = ht.train(second, devices=["cpu", "cpu"], memory_budget=100 * budget, progress=False,
                      checkpoint_dir=tmp_path)[0]
    assert result.steps == 4 and result.resident and len(result.losses) == 4
    assert max_relative_error(model, reference_model) <= 1e-6


def test_resume_with_a_frozen_parameter_continues_exactly(tmp_path):
    def frozen_task(max_steps):
        task, model = small_task(max_steps=max_steps)
        model[-2].weight.requires_grad_(False)  # the final norm
        return task, model
    reference, reference_model = frozen_task(4)
    ht.train(reference, devices="cpu", progress=False)
    first, _ = frozen_task(2)
    ht.train(first, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    second, model = frozen_task(4)
    assert ht.train(second, devices="cpu", progress=False, checkpoint_dir=tmp_path)[0].steps == 4
    assert max_relative_error(model, reference_model) <= 1e-6


def test_a_damaged_checkpoint_is_refused_before_anything_changes(tmp_path):
    from safetensors.torch import load_file, save_file

    task, _ = small_task(max_steps=1)
    ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    tensor_file = next((tmp_path / "t").glob("state-*.safetensors"))
    tensors = load_file(tensor_file)
    name = next(key for key in tensors if key.startswith("param/"))
    save_file({**tensors, name: tensors[name][:1]}, tensor_file)
    task, model = small_task(max_steps=2)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=f"lacks {name} as fp32 of shape"):
        ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    tensor_file.write_bytes(b"not a tensor file")
    with pytest.raises(ValueError, match="cannot read"):
        ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_a_crash_while_writing_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    task, _ = small_task(max_steps=2)
    ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    directory = tmp_path / "t"
    before = json.loads((directory / "manifest.json").read_text())

    real = checkpoint._fsync_write

    def crash(path, write):  # the tensors are written, the manifest that would name them is not
        if path.name.startswith("manifest"):
            raise OSError("disk full")
        real(path, write)
    monkeypatch.setattr(checkpoint, "_fsync_write", crash)
    task, _ = small_task(max_steps=4)
    with pytest.warns(RuntimeWarning, match="could not be written.*disk full"):
        ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert json.loads((directory / "manifest.json").read_text()) == before
    monkeypatch.undo()
    assert checkpoint.load(tmp_path, small_task()[0]).manifest["steps"] == 2, "the previous one still loads"


@pytest.mark.parametrize("every", [0, -1, True, "10 parsecs", "0s", 1.5])
def test_bad_checkpoint_every(tmp_path, every):
    task, _ = small_task()
    with pytest.raises(ValueError, match="checkpoint_every"):
        ht.train(task, devices="cpu", progress=False, checkpoint_dir=tmp_path, checkpoint_every=every)


def test_checkpoint_every_without_a_directory_is_refused():
    task, _ = small_task()
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        ht.train(task, devices="cpu", progress=False, checkpoint_every=5)


def test_checkpoint_every_reads_steps_and_durations():
    assert checkpoint.parse_every(None) == (None, 600.0)
    assert checkpoint.parse_every(3) == (3, None)
    assert checkpoint.parse_every("10min") == (None, 600.0)
    assert checkpoint.parse_every("30s") == (None, 30.0)
    assert checkpoint.parse_every("1.5h") == (None, 5400.0)
