"""benchmarks/trace_waits.py: the long units of a traced run, by where the other tasks stood as each began."""
import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def trace_waits():
    spec = importlib.util.spec_from_file_location("trace_waits", os.path.join(ROOT, "benchmarks", "trace_waits.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def two_tasks_of_two_shards() -> dict:
    """Three units a micro-batch each (shard 0's forward, shard 1's forward and backward, shard 0's backward).
    Task 0 waits 0.2 s in its first unit while task 1 is in the middle of its micro-batch, then 0.29 s in its loss
    unit, then 0.1 s at its second micro-batch's first unit with task 1 finished."""
    entry = lambda task, unit, shard, phase, start, seconds: [0, task, unit, shard, phase, start, seconds, 0]  # noqa
    trace = [entry(1, 0, 0, "f", 0.0, 0.01), entry(0, 0, 0, "f", 0.01, 0.2), entry(0, 1, 1, "f", 0.21, 0.29),
             entry(1, 1, 1, "f", 0.5, 0.01), entry(1, 2, 0, "b", 0.52, 0.01), entry(0, 2, 0, "b", 0.53, 0.01),
             entry(0, 3, 0, "f", 0.6, 0.1), entry(0, 4, 1, "f", 0.7, 0.01), entry(0, 5, 0, "b", 0.71, 0.01)]
    return {"trace": trace, "shard_params": [[10, 10], [10, 10]], "placement": "auto"}


def test_a_wait_is_told_apart_by_whether_another_task_was_mid_step(trace_waits):
    found = trace_waits.waits(two_tasks_of_two_shards(), over_s=0.05)
    assert found["kinds"]["others mid-step"] == [1, pytest.approx(0.2)]
    assert found["kinds"]["others between"] == [1, pytest.approx(0.1)]   # the loss unit's 0.29 s left out
    assert found["by_unit"] == {(0, "f"): (2, pytest.approx(0.3), pytest.approx(0.15))}
    assert found["span_s"] == pytest.approx(0.72)
    assert trace_waits.waits(two_tasks_of_two_shards(), over_s=0.5)["kinds"]["others mid-step"] == [0, 0.0]


def test_the_command_reads_the_suite_record_and_skips_runs_without_a_trace(trace_waits, tmp_path, capsys):
    runs = tmp_path / "runs.jsonl"
    lines = [{"name": "hydra", "result": two_tasks_of_two_shards()},
             {"name": "fsdp2_cpu_offload", "result": {"tokens_per_s": 1.0}},
             {"name": "other", "result": {"skipped": "needs CUDA"}}]
    runs.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    trace_waits.main([str(runs)])
    out = capsys.readouterr().out
    assert out.startswith("hydra: placement 'auto', 9 units over 0.72 s")
    assert "| others mid-step | 1 | 0.20 | 0.28 |" in out and "| 0 | forward | 2 | 0.30 | 0.150 |" in out
    assert "fsdp2" not in out and "other" not in out.replace("others", "")
    trace_waits.main([str(runs), "--name", "fsdp2_cpu_offload"])
    assert capsys.readouterr().out == ""
