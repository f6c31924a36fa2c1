"""One run of the GPU suite in a process of its own, so that a crash, a hang or a leak in one system cannot take
the others, or the suite's record, with it, and every system starts on a clean device and a fresh host heap.

    python benchmarks/gpu_suite_child.py SPEC.json RESULT.json

SPEC (written by gpu_suite.py) names the run ("system"), the device, the workload, the template models
(seeds, dtype, and the folder of their saved copies), the learning rates, the GPU memory cap, hydra's budget,
the optimizer and the deadline in seconds since the epoch. RESULT receives the run's dict of measurements, or
its "error" or "skipped"; with no RESULT file the parent reports the exit status and the output's tail.
"""
from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from gpu_suite_env import GiB, Workload, build_model, machine, make_batches, pcie_bandwidth  # noqa: E402
from gpu_suite_profile import profile_hydra  # noqa: E402
from gpu_suite_stress import stream_stress  # noqa: E402
from gpu_suite_systems import failure, run_deepspeed, run_fsdp2, run_hydra, run_plain  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def template_path(folder: str, seed: int) -> str:
    return os.path.join(folder, f"template-seed{seed}.pt")


def save_templates(spec: dict, w: Workload) -> dict:
    """Builds each seed's model once and saves the whole module (ties and buffers included); the other runs of
    the phase map it instead of paying the random initialisation again (~15 s for GPT-2 XL's 1.56B params)."""
    folder = spec["template_dir"]
    os.makedirs(folder, exist_ok=True)
    for seed in spec["seeds"]:
        model = build_model(w, seed=seed, dtype=DTYPES[spec.get("dtype", "float32")])
        path = template_path(folder, seed)
        torch.save(model, path + ".partial")
        os.replace(path + ".partial", path)
        del model
    return {"templates": len(spec["seeds"]), "folder": folder}


def templates(spec: dict, w: Workload) -> list:
    folder = spec.get("template_dir")
    out = []
    for seed in spec["seeds"]:
        if folder and os.path.exists(template_path(folder, seed)):
            # Mapped, not read: each system deep-copies its templates, which is where the bytes are read.
            out.append(torch.load(template_path(folder, seed), weights_only=False, mmap=True))
        else:
            out.append(build_model(w, seed=seed, dtype=DTYPES[spec.get("dtype", "float32")]))
    return out


def cap(device: torch.device, gib: float | None):
    """Caps this process's caching allocator (every system allocates through it, hydra's arena too)."""
    if device.type == "cuda" and gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * GiB / total), device)


def run(spec: dict) -> dict:
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
    if system == "templates":
        return save_templates(spec, w)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    models, data, lrs = templates(spec, w), make_batches(w), spec.get("lrs", [1e-4])
    cap(device, spec.get("cap_gib"))
    if system == "hydra":
        return run_hydra(models, lrs, w, data, device, spec["budget"], optimizer=spec.get("optimizer", "adamw"))
    if system == "profile":
        return profile_hydra(models[0], w, data, device, spec["budget"])
    if system == "plain":
        return run_plain(models, lrs, w, data, device, deadline)
    if system == "deepspeed":
        return run_deepspeed(models, lrs, w, data, device, deadline)
    if system in ("fsdp2", "fsdp2_no_offload"):
        return run_fsdp2(models, lrs, w, data, device, deadline, offload=system == "fsdp2")
    return {"error": f"unknown system {system!r}"}


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except BaseException as error:  # noqa: BLE001 - the parent records whatever ended the run
        result = failure(error)
    with open(result_path + ".partial", "w") as f:
        json.dump(result, f, default=str)
    os.replace(result_path + ".partial", result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
