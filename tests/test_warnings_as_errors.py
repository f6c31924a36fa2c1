"""A warnings filter that raises (python -W error, pytest's filterwarnings = error) around a call: the warnings a
run gives while it trains say it goes on, and it must. Raised on a device's worker instead, a warning left that
device's tasks cut short and reported as finished; on the callback thread, it left the run waiting for ever; in a
unit, it failed the task (the callbacks' case: test_arrivals.py)."""
import signal
import sys
import warnings

import pytest

import hydra_torch as ht
from hydra_torch.state import checkpoint
from models import lm_loss, model_bytes, tied_transformer, token_batches
from test_multi_model import check_home, ctrl_c_at_call, make_tasks
from test_randomness import BUDGET, SometimesRandom


@pytest.fixture
def warnings_raise():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_a_failing_checkpoint_write_on_two_devices_goes_on(tmp_path, monkeypatch, warnings_raise, capfd):
    def full(path, write):
        raise OSError("No space left on device")
    monkeypatch.setattr(checkpoint, "_fsync_write", full)
    tasks = [ht.ModelTask(tied_transformer(seed=i, blocks=2), loss_fn=lm_loss, data=token_batches(6), name=f"t{i}")
             for i in range(2)]
    results = ht.train(tasks, devices=["cpu", "cpu"], progress=False, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert all(r.ok and r.steps == 6 and not r.cut_short for r in results), [(r.steps, r.error) for r in results]
    assert results.checkpoint_failures > 0
    assert "RuntimeWarning: checkpoints could not be written" in capfd.readouterr().err


def test_a_shard_that_starts_drawing_late_trains_on(warnings_raise, capfd):
    model = tied_transformer(dropout=0.0)
    model.insert(2, SometimesRandom())
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=token_batches(8), shards=6)
    result = ht.train([task], devices="cpu", memory_budget=BUDGET, progress=False)[0]
    assert result.ok and result.steps == 8, result.error
    assert "drew from the CPU random generator on some of its runs only" in capfd.readouterr().err


def sigterm_at_call(count):
    """Tasks of which one sends SIGTERM at its `count`-th loss, and the job system's own handler's calls."""
    tasks, models = make_tasks(token_batches(40))
    tasks[1].loss_fn = ctrl_c_at_call(count, signum=signal.SIGTERM)
    seen = []
    original = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    return tasks, models, seen, original


def test_sigterm_under_an_error_filter_still_reaches_the_previous_handler(warnings_raise):
    tasks, models, seen, original = sigterm_at_call(4)
    try:
        with pytest.raises(RuntimeWarning, match="stopped by SIGTERM"):  # the filter's own choice, at the very end
            ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(0.45 * model_bytes(models[0])), progress=False)
    finally:
        signal.signal(signal.SIGTERM, original)
    assert seen == [signal.SIGTERM]
    check_home(models)


def test_a_process_without_stderr_trains_with_its_bars_off_and_stops_on_sigterm(monkeypatch):
    monkeypatch.setattr(sys, "stderr", None)  # started with 2>&-
    tasks, models, seen, original = sigterm_at_call(4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nowhere to show them
            results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=int(0.45 * model_bytes(models[0])))
    finally:
        signal.signal(signal.SIGTERM, original)
    assert seen == [signal.SIGTERM]
    assert all(r.ok and r.cut_short == "SIGTERM" for r in results), [r.error for r in results]
    check_home(models)
