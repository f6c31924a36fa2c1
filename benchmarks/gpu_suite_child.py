"""One run of the GPU suite in a process of its own, so that a crash, a hang or a leak in one system cannot take
the others, or the suite's record, with it, and every system starts on a clean device and a fresh host heap.

    python benchmarks/gpu_suite_child.py SPEC.json RESULT.json

SPEC (written by gpu_suite.py) names the run ("system"), the device, the workload, the models (their seeds and
dtype: each run builds its own, gpu_suite_env.build_model), the learning rates, the GPU memory cap, hydra's
budget, the optimizer and the deadline in seconds since the epoch, by which the run stops itself. RESULT
receives the run's dict of measurements, or its "error" or "skipped"; RESULT.progress, the step times so far
after every step of a baseline, so that a run the suite has to kill keeps what it measured; with no RESULT
file the parent reports the exit status and the output's tail.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from gpu_suite_baselines import run_deepspeed, run_fsdp2  # noqa: E402
from gpu_suite_env import GiB, Workload, build_model, machine, make_batches, pcie_bandwidth  # noqa: E402
from gpu_suite_profile import profile_hydra  # noqa: E402
from gpu_suite_stress import stream_stress  # noqa: E402
from gpu_suite_systems import failure, run_hydra, run_plain  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The systems a run may name, besides "machine" and "stress".
SYSTEMS = ("hydra", "profile", "plain", "plain_checkpointed", "deepspeed_zero2", "deepspeed_zero3", "fsdp2",
           "fsdp2_no_offload")


def cap(device: torch.device, gib: float | None):
    """Caps this process's caching allocator (every system allocates through it, hydra's arena too)."""
    if device.type == "cuda" and gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GiB / total), device)


def write_json(path: str, record: dict):
    with open(path + ".partial", "w") as f:
        json.dump(record, f, default=str)
    os.replace(path + ".partial", path)


def run(spec: dict, progress_path: str | None = None) -> dict:
    device = torch.device(spec["device"])
    if device.type == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    # The deadline crosses processes as wall-clock time; the systems compare it with perf_counter.
    deadline = time.perf_counter() + (spec["deadline"] - time.time())
    system = spec["system"]
    if system == "machine":
        return {"machine": machine(), "pcie": pcie_bandwidth(device, GiB if device.type == "cuda" else 0)}
    if system == "stress":
        return stream_stress(device, steps=spec.get("steps", 6))
    w = Workload(**spec["workload"])
    if system not in SYSTEMS:
        return {"error": f"unknown system {system!r}"}
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    dtype = DTYPES[spec.get("dtype", "float32")]
    models = [build_model(w, seed, dtype, init_device=str(device)) for seed in spec["seeds"]]
    data, lrs = make_batches(w), spec.get("lrs", [1e-4])
    cap(device, spec.get("cap_gib"))
    report = (lambda record: write_json(progress_path, record)) if progress_path else None
    if system == "hydra":
        return run_hydra(models, lrs, w, data, device, spec["budget"], optimizer=spec.get("optimizer", "adamw"),
                         deadline=deadline, placement=spec.get("placement", "auto"))
    if system == "profile":
        return profile_hydra(models[0], w, data, device, spec["budget"])
    if system in ("plain", "plain_checkpointed"):
        return run_plain(models, lrs, w, data, device, deadline, checkpointed=system == "plain_checkpointed",
                         report=report)
    if system in ("deepspeed_zero2", "deepspeed_zero3"):
        return run_deepspeed(models, lrs, w, data, device, deadline, stage=int(system[-1]), report=report)
    return run_fsdp2(models, lrs, w, data, device, deadline, offload=system == "fsdp2", report=report)


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = run(spec, result_path + ".progress")
    except BaseException as error:  # noqa: BLE001 - the parent records whatever ended the run
        result = failure(error)
    write_json(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
