"""The GPU suite's --smoke mode: every system's code path with tiny models on the CPU, as CI can run it."""
import json
import os
import subprocess
import sys

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
    assert (tmp_path / "gpu_suite.md").read_text().startswith("# hydra-torch GPU suite")

    for entry in (v for k, v in record["phases"]["P1"].items() if k.startswith("batch_")):
        for system in ("hydra_spilled_capped", "hydra_resident_uncapped", "plain_uncapped"):
            assert entry[system]["tokens_per_s"] > 0, (system, entry[system])
        assert entry["hydra_spilled_capped"]["resident"] == [False]      # it really spilled
        assert entry["hydra_resident_uncapped"]["resident"] == [True]
    profile = record["phases"]["P1"]["profile_spilled_step"]
    assert set(profile["by_phase"]) == {"forward", "forward_backward", "backward"} and not profile["resident"]
    assert len(profile["unit_seconds"]) == 2 * profile["shards"] - 1            # exactly one step's units
    assert profile["host_step_seconds_per_step"] > 0
    p2 = record["phases"]["P2"]
    assert len(p2["hydra"]["shard_params"]) == p2["k"] and len(p2["hydra"]["trace"]) > 0
    assert p2["k"] >= 2 and p2["hydra"]["tokens_per_s"] > 0 and len(p2["hydra"]["final_losses"]) == p2["k"]
    if not torch.cuda.is_available():
        for system in ("deepspeed_zero3_offload", "fsdp2_cpu_offload"):
            assert p2[system]["skipped"].startswith("needs CUDA"), p2[system]
            assert "import" in p2[system]
    assert p2["fsdp2_no_offload_cpu_check"]["tokens_per_s"] > 0
    assert record["phases"]["P3"]["largest_adamw_params"] > 0
    assert record["phases"]["P3"]["largest_sgd_params"] > 0


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
