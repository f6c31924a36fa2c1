"""The GPU suite's --smoke mode: every system's code path with tiny models on the CPU, as CI can run it."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_suite_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # A time box as wide as the test's own limit: on a loaded machine the smoke phases must run, not be skipped.
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_suite.py"), "--smoke",
                          "--budget-s", "200", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert record["failures"] == []
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    names = [run["name"] for run in runs]                              # one line per run, as it ended
    assert names[0] == "hydra" and len(runs) >= 16                      # P2 first
    assert names.index("hydra_spilled_capped") < names.index("stream_stress") < names.index("P3 sgd n_layer=4 0.00B")
    stress = record["phases"]["stress"]["stream_stress"]
    for precision in ("fp32", "bf16"):        # two virtual CPU devices on a slow link against one CPU device
        assert stress[precision]["largest_error"] == 0.0, stress
        assert min(min(loads) for loads in stress[precision]["shard_loads"]) >= 2  # eviction on every visit
    assert (tmp_path / "gpu_suite.md").read_text().startswith("# hydra-torch GPU suite")

    for entry in (v for k, v in record["phases"]["P1"].items() if k.startswith("batch_")):
        for system in ("hydra_spilled_capped", "hydra_resident_uncapped", "plain_uncapped",
                       "plain_checkpointed_uncapped"):
            assert entry[system]["tokens_per_s"] > 0, (system, entry[system])
        assert entry["hydra_spilled_capped"]["resident"] == [False]      # it really spilled
        assert entry["hydra_resident_uncapped"]["resident"] == [True]
        assert entry["plain_checkpointed_uncapped"]["activation_checkpointing"]
        assert entry["ratio_spilled_vs_plain_checkpointed"] > 0
    profile = record["phases"]["P1"]["profile_spilled_step"]
    assert set(profile["by_phase"]) == {"forward", "forward_backward", "backward"} and not profile["resident"]
    assert len(profile["unit_seconds"]) == 2 * profile["shards"] - 1            # exactly one step's units
    assert profile["host_step_seconds_per_step"] > 0
    p2 = record["phases"]["P2"]
    hydra = p2["hydra"]
    assert len(hydra["shard_params"]) == p2["k"] and len(hydra["trace"]) > 0
    assert p2["k"] >= 2 and hydra["tokens_per_s"] > 0 and len(hydra["final_losses"]) == p2["k"]
    assert hydra["steps"] == 6 * p2["k"] or "time_box" in hydra                # 6 steps a model, 2 warm-up
    assert hydra["window_tokens_per_s"] > 0
    assert hydra["span_steps"] == hydra["steps"] and hydra["span_s"] > 0              # every step, over its span
    tokens = hydra["span_steps"] * p2["workload"]["tokens_per_step"]
    assert hydra["span_tokens_per_s"] == pytest.approx(tokens / hydra["span_s"])
    assert hydra["nvml_gpu_util_span"] is None                                          # no NVML on the CPU
    assert 0 < hydra["window_steps"] <= 4 * p2["k"]                     # warm-up steps never count
    split = hydra["budget_split"]
    assert split["capacity_bytes"] + split["working_set_bytes"] + split["saved_high_water_bytes"] <= \
        hydra["budget_gib"] * 2**30                                        # the budget held everything
    if not torch.cuda.is_available():
        for system in ("deepspeed_zero2_offload", "deepspeed_zero3_offload", "fsdp2_cpu_offload"):
            assert p2[system]["skipped"].startswith("needs CUDA"), p2[system]
            assert "import" in p2[system]
    baseline = p2["fsdp2_no_offload_cpu_check"]
    assert baseline["tokens_per_s"] > 0 and baseline["models_trained"] == 1 and baseline["steps"] == 5
    assert p2["best_baseline"] == "fsdp2_no_offload_cpu_check"
    at_once = p2[f"fsdp2_no_offload_cpu_check_x{p2['k']}_at_once"]
    assert at_once["processes"] == p2["k"] and len(at_once["runs"]) == p2["k"] and at_once["tokens_per_s"] > 0
    assert record["phases"]["P3"]["largest_adamw_params"] > 0
    assert record["phases"]["P3"]["largest_sgd_params"] > 0


@pytest.fixture
def suite(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_suite

    suite = gpu_suite.Suite(gpu_suite.parse_args(["--smoke", "--out", str(tmp_path)]))
    yield gpu_suite, suite
    shutil.rmtree(suite.scratch, ignore_errors=True)


def test_a_run_past_its_limit_is_killed_at_it_and_recorded(suite):
    gpu_suite, suite = suite
    start = time.perf_counter()
    result = suite.child("machine", time.perf_counter() + 0.5)   # importing torch alone takes longer
    assert result["error"].startswith("timeout: killed after"), result
    assert time.perf_counter() - start < 5, "no grace beyond the limit"


def test_a_run_killed_at_its_limit_keeps_the_steps_it_reported(suite, tmp_path, monkeypatch):
    gpu_suite, suite = suite
    slow = tmp_path / "slow.py"
    slow.write_text("import json, sys, time\n"
                    "record = {'step_times': [2.0, 1.0, 0.5, 0.25], 'warmup': 1, 'tokens_per_step': 100}\n"
                    "json.dump(record, open(sys.argv[2] + '.progress', 'w'))\n"
                    "time.sleep(60)\n")
    monkeypatch.setattr(gpu_suite, "CHILD", str(slow))
    result = suite.child("plain", time.perf_counter() + 2.0)
    assert result["error"].startswith("timeout: killed after"), result
    assert result["partial"]["steps"] == 4 and result["partial"]["tokens_per_s"] == 200.0   # median 0.5 s


def test_phases_are_chosen_and_ordered(suite):
    gpu_suite, _ = suite
    assert gpu_suite.parse_args(["--out", "x"]).phases == ["p2", "p1", "stress"]
    assert gpu_suite.parse_args(["--out", "x", "--p3"]).phases == ["p2", "p1", "stress", "p3"]
    assert gpu_suite.parse_args(["--out", "x", "--phases", "stress,P2"]).phases == ["p2", "stress"]
    for bad in ("p4", "", "p1,,x"):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(["--out", "x", "--phases", bad])


def test_a_run_that_crashes_is_recorded_with_its_output(suite, tmp_path, monkeypatch):
    gpu_suite, suite = suite
    crash = tmp_path / "crash.py"
    crash.write_text("import os, sys\nprint('about to fail', file=sys.stderr, flush=True)\nos.abort()\n")
    monkeypatch.setattr(gpu_suite, "CHILD", str(crash))
    phase = {}
    result = suite.run(phase, "crashing", time.perf_counter() + 60, "hydra")
    assert "no result" in result["error"] and "about to fail" in result["output"], result
    assert phase["crashing"] is result and suite.failures == [f"crashing: {result['error']}"]
    saved = json.loads((tmp_path / "runs.jsonl").read_text().splitlines()[-1])
    assert saved["name"] == "crashing" and saved["result"]["error"] == result["error"]


def test_profile_counts_kernels_copies_overlap_and_idle_time():
    # The profile's GPU figures come from a torch.profiler Chrome trace; on the CPU there are no GPU events, so
    # the arithmetic is checked on a hand-made trace (times in microseconds, as the profiler writes them).
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_suite_profile import gpu_activity

    trace = {"traceEvents": [
        {"cat": "kernel", "name": "gemm", "ts": 0.0, "dur": 100.0},
        {"cat": "kernel", "name": "gemm", "ts": 50.0, "dur": 100.0},            # overlaps the first: union 150
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 120.0, "dur": 60.0},  # 30 under
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 300.0, "dur": 100.0},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 1000.0},         # host events are ignored
        {"cat": "kernel", "name": "no duration", "ts": 5.0},
    ]}
    gpu = gpu_activity(trace)
    assert gpu["kernels"] == 2 and gpu["events"] == 4
    assert abs(gpu["kernel_s"] - 150e-6) < 1e-12 and abs(gpu["kernel_sum_s"] - 200e-6) < 1e-12
    assert abs(gpu["h2d_s"] - 60e-6) < 1e-12 and abs(gpu["d2h_s"] - 100e-6) < 1e-12
    assert abs(gpu["copy_under_kernels_s"] - 30e-6) < 1e-12
    assert abs(gpu["window_s"] - 400e-6) < 1e-12
    assert abs(gpu["gpu_idle_s"] - 120e-6) < 1e-12                               # 180..300
    assert gpu_activity({"traceEvents": []}) == {"events": 0}


def test_gpu_suite_runs_hydra_once_per_placement_without_baselines(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_suite.py"), "--smoke", "--phases", "p2",
                          "--hydra-placements", "auto,host", "--skip-baselines", "--p2-steps", "1,2",
                          "--budget-s", "120",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    p2 = json.loads((tmp_path / "gpu_suite.json").read_text())["phases"]["P2"]
    assert p2["hydra"]["placement"] == "auto" and p2["hydra_host"]["placement"] == "host"
    # "host" keeps nothing on the device (auto's ends stay resident where they fit, which the planner's cut
    # under this machine's load decides, so only its record is asserted).
    assert p2["hydra_host"]["placements"] == ["spilled"] * p2["k"]
    assert len(p2["hydra"]["placements"]) == p2["k"]
    assert all(placed.startswith(("spilled", "resident")) for placed in p2["hydra"]["placements"])
    assert p2["ratio_hydra_vs_hydra_host"] > 0 and p2["span_ratio_hydra_vs_hydra_host"] > 0
    assert p2["hydra"]["steps"] == p2["hydra_host"]["steps"] == 3 * p2["k"]           # --p2-steps 1,2
    assert not any(name.startswith(("deepspeed", "fsdp2")) for name in p2)


@pytest.mark.parametrize("args, message", [(["--hydra-placements", "auto,gpu"], "placements are distinct names"),
                                           (["--p2-steps", "2"], "steps are WARMUP,TIMED"),
                                           (["--p2-steps", "2,0"], "TIMED >= 1")])
def test_gpu_suite_rejects_bad_arguments_before_running(tmp_path, args, message):
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_suite.py"), "--smoke", *args,
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2 and message in run.stderr
    assert not (tmp_path / "gpu_suite.json").exists()


def test_nvml_utilisation_is_averaged_over_the_span_asked_for():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from gpu_suite_env import Sampler

    sampler = Sampler(torch.device("cpu"))
    sampler.util = [(1.0, 10.0), (2.0, 90.0), (3.0, 70.0), (4.0, 0.0)]   # setup idle, training busy, teardown idle
    assert sampler.util_between(2.0, 3.0) == pytest.approx(0.8)
    assert sampler.util_between(5.0, 6.0) is None
    assert sampler.record()["nvml_gpu_util_mean"] == pytest.approx(0.425)
