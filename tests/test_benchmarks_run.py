"""Every CPU benchmark that takes seconds runs to its table on small inputs: a benchmark is run rarely, by hand, and
one the code has moved away from would otherwise fail only then. The figures are not looked at (benchmarks/RESULTS.md
holds the measured ones). Left out for their time on 2 cores: bench_clip_norm, bench_host_bytes and bench_lora_bytes
(GPT-2 small's shape), bench_successive_halving, bench_budget_split and bench_frozen_base (30 s and more each); the
GPU suite has its own smoke test (test_gpu_suite_smoke.py)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name, arguments, what its output holds once it has run to the end
RUNS = [
    ("bench_checkpoint", ["--steps", "4", "--every", "2", "--rounds", "1"], "|---"),
    ("bench_committed_plans", ["--steps", "3", "--rounds", "1"], "|---"),
    ("bench_emulated_link", ["--models", "2", "--steps", "3", "--rounds", "1"], "|---"),
    ("bench_host_order", ["--models", "2", "--steps", "3", "--rounds", "1"], "|---"),
    ("bench_joining", ["--models", "2", "--steps", "3", "--rounds", "1"], "|---"),
    ("bench_leaving", ["--models", "2", "--steps", "4", "--rounds", "1"], "|---"),
    ("bench_link_bound", ["--ratios", "1", "--steps", "3", "--rounds", "1", "--placements", "host", "auto",
                          "--forecast"], "|---"),
    ("bench_lm_loss_peak", ["--batch", "2", "--seq", "64", "--vocab", "512", "--width", "64"], "fused: peak"),
    ("bench_multi_model", ["--steps", "3", "--rounds", "1"], "|---"),
    ("bench_optimizers", ["--sizes", "1e6", "--rounds", "3", "--threads", "1"], "|---"),
    ("bench_random_streams", ["--steps", "3", "--rounds", "1"], "|---"),
    ("bench_training", ["--width", "64", "--blocks", "8", "--vocab", "256", "--seq", "32", "--batch", "2",
                        "--steps", "3", "--rounds", "1"], "| spilled |"),
    ("bench_unit_overhead", ["--steps", "5", "--rounds", "1"], "|---"),
    ("bench_partitioner", [], "|---"),
    ("bench_host_step", [], "host state"),
]


@pytest.mark.parametrize("name, args, expected", RUNS, ids=[run[0] for run in RUNS])
def test_benchmark_runs_to_its_table(name, args, expected):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    run = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), *args],
                         capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert expected in run.stdout, run.stdout[-3000:]
