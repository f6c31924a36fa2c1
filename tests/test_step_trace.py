"""Results.steps: where and when every optimizer step of every shard ran (on the host, on the device, or in its
home on the device), for every placement, as the trace holds the units."""
import math

import pytest

import hydra_torch as ht
from models import lm_loss, model_bytes, tied_transformer, token_batches
import placed_training

SHARDS = 8  # tied_transformer(): 8 layers, each a shard


def places_of(result) -> list[str]:
    """Where each shard of the task steps, as its placement says."""
    if result.resident:
        return ["resident"] * SHARDS
    return ["resident" if s in result.resident_shards else "device" if s in result.device_shards else "host"
            for s in range(SHARDS)]


def check_steps(results, first_step=1):
    """Each shard's steps appear once each, numbered from `first_step`, where the task's placement says and in order
    (a shard's steps form a chain), inside the run's span."""
    result = results[0]
    steps = [e for e in results.steps if e.task_name == result.name]
    assert sorted((e.shard, e.step) for e in steps) == \
        [(s, k) for s in range(SHARDS) for k in range(first_step, result.steps + 1)]
    places = places_of(result)
    assert all(e.place == places[e.shard] for e in steps)
    assert all(e.device == 0 and e.task == 0 and e.start <= e.end for e in steps)
    assert results.steps == sorted(results.steps, key=lambda e: e.start)
    for s in range(SHARDS):
        chain = sorted((e for e in steps if e.shard == s), key=lambda e: e.step)
        assert all(a.end <= b.start for a, b in zip(chain, chain[1:])), f"shard {s}'s steps overlap"
    first_unit = min(e.start for e in results.trace)
    assert all(e.start >= first_unit for e in steps)
    return steps


@pytest.mark.parametrize("placement, budget_fraction, expected", [
    ("host", 2.0, "spilled"),
    ("auto", 2.0, "spilled, shards 0, 7 resident"),
    ("device", 2.0, "spilled, shards 0, 7 resident, shards 1-6 stepped on the device"),
    ("auto", 20.0, "resident"),
])
@pytest.mark.parametrize("accumulate, clip", [(1, None), (2, 0.5)])
def test_every_shard_step_is_traced_where_it_ran(placement, budget_fraction, expected, accumulate, clip):
    options = {"clip_grad_norm": clip} if clip else {}
    results = placed_training.train(tied_transformer(), token_batches(8), placement, budget_fraction,
                                    accumulate=accumulate, **options)
    assert results[0].placement == expected
    check_steps(results)
    stats = results.stats[0]
    counted = {place: sum(e.place == place for e in results.steps) for place in ("host", "device")}
    assert counted == {"host": stats["host_steps"], "device": stats["device_steps"]}


def test_the_summary_says_how_many_steps_ran_where():
    host = placed_training.train(tied_transformer(), token_batches(4), "host", 2.0)
    assert "shard steps: 32 on the host (median " in host.summary()
    ends = placed_training.train(tied_transformer(), token_batches(4), "auto", 2.0)
    assert "shard steps: 24 on the host (median " in ends.summary() and " ms), 8 resident" in ends.summary()
    resident = placed_training.train(tied_transformer(), token_batches(4), "auto", 20.0)
    assert len(resident.steps) == 32 and "shard steps" not in resident.summary()


def test_a_step_skipped_after_a_nan_loss_is_not_traced():
    bad_step = 3
    calls = {"n": 0}

    def loss_fn(out, batch):
        calls["n"] += 1
        loss = lm_loss(out, batch)
        return loss * math.nan if calls["n"] == bad_step + 1 else loss

    model = tied_transformer()
    task = ht.ModelTask(model, loss_fn=loss_fn, data=token_batches(6))
    with pytest.warns(RuntimeWarning, match="step 3"):
        results = ht.train([task], devices="cpu", memory_budget=2 * model_bytes(model), progress=False,
                           placement="device")
    assert isinstance(results[0].error, ht.NonFiniteLossError) and results[0].steps == bad_step
    assert sorted((e.shard, e.step) for e in results.steps) == \
        [(s, k) for s in range(SHARDS) for k in range(1, bad_step + 1)]


def test_a_resumed_task_goes_on_counting_its_steps(tmp_path):
    data = token_batches(8)
    model = tied_transformer()
    placed_training.train(model, data, "device", 2.0, max_steps=3, checkpoint_dir=tmp_path, name="t")
    results = placed_training.train(model, data, "device", 2.0, checkpoint_dir=tmp_path, name="t")
    assert results[0].steps == 8
    check_steps(results, first_step=4)


def test_the_schedule_chart_has_a_row_for_the_host_steps(tmp_path):
    results = placed_training.train(tied_transformer(), token_batches(4), "host", 2.0)
    figure = results.plot_schedule(tmp_path / "schedule.png")
    assert [label.get_text() for label in figure.axes[0].get_yticklabels()] == ["cpu", "host steps"]
    assert (tmp_path / "schedule.png").stat().st_size > 0
