"""The GPU suite's --smoke mode: every system's code path with tiny models on the CPU, as CI can run it."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_suite_smoke(tmp_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_suite.py"), "--smoke",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert record["failures"] == []
    assert (tmp_path / "gpu_suite.md").read_text().startswith("# hydra-torch GPU suite")

    for entry in (v for k, v in record["phases"]["P1"].items() if k.startswith("batch_")):
        for system in ("hydra_spilled_capped", "hydra_resident_uncapped", "plain_uncapped"):
            assert entry[system]["tokens_per_s"] > 0, (system, entry[system])
        assert entry["hydra_spilled_capped"]["resident"] == [False]      # it really spilled
        assert entry["hydra_resident_uncapped"]["resident"] == [True]
    p2 = record["phases"]["P2"]
    assert p2["k"] >= 2 and p2["hydra"]["tokens_per_s"] > 0 and len(p2["hydra"]["final_losses"]) == p2["k"]
    if not torch.cuda.is_available():
        for system in ("deepspeed_zero3_offload", "fsdp2_cpu_offload"):
            assert p2[system]["skipped"].startswith("needs CUDA"), p2[system]
            assert "import" in p2[system]
    assert p2["fsdp2_no_offload_cpu_check"]["tokens_per_s"] > 0
    assert record["phases"]["P3"]["largest_adamw_params"] > 0
    assert record["phases"]["P3"]["largest_sgd_params"] > 0
