"""hydra-torch's GPU suite: hydra against plain PyTorch, DeepSpeed ZeRO-3 offload and FSDP2 CPU offload on
GPT-2-shaped models, under one GPU memory cap for every system. benchmarks/RESULTS.md ("GPU suite") explains
each measure and the targets.

    python benchmarks/gpu_suite.py --out OUT [--p3] [--budget-s 420] [--cap-gib 16]   # on the GPU box
    python benchmarks/gpu_suite.py --smoke --out OUT    # every code path with tiny models on the CPU, < 60 s

Stream stress first: three small spilled GPT-2 models, fp32 and bf16, eviction on every visit, against the same
    run on the CPU (benchmarks/gpu_suite_stress.py).
P1: one GPT-2-XL-shaped model: hydra spilled under the cap, hydra resident and plain PyTorch without it, at a
    batch well below and one at the T >= F/B break-even (HYDRA.md section 3: ~16k tokens on H200 + PCIe Gen5);
    then a profile of one spilled step at the smaller batch (benchmarks/gpu_suite_profile.py).
P2: K GPT-2-large-shaped models with different learning rates, K from host RAM: hydra in one ht.train call
    against DeepSpeed ZeRO-3 offload and FSDP2 CPU offload training them one after another.
P3: (--p3) the largest GPT-shaped model hydra trains for 3 steps under the cap, AdamW then SGD.
Every run is a process of its own (benchmarks/gpu_suite_child.py) with its own timeout, on a clean device; the
phases' template models are built once and saved for their runs to map. OUT/gpu_suite.json and OUT/gpu_suite.md
are rewritten, and OUT/runs.jsonl appended, after every run. Exit status 0 only if nothing that ran failed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from gpu_suite_env import (GiB, Workload, hydra_headroom_bytes, hydra_host_bytes_per_param, meminfo,  # noqa: E402
                           models_that_fit)
from gpu_suite_report import markdown  # noqa: E402

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_suite_child.py")

GPU = {"p1": dict(n_embd=1600, n_layer=48, n_head=25), "p1_batches": (4, 16),       # GPT-2 XL, 1.56B
       "p2": dict(n_embd=1280, n_layer=36, n_head=20, batch=8), "p2_max_models": 4,  # GPT-2 large, 0.77B
       "p3": dict(n_embd=4096, n_head=32, batch=1), "p3_layers": 8, "seq": 1024, "vocab": 50257,
       "p1_steps": (1, 3), "p2_steps": (1, 3)}
# One batch in P1: a second runs the same code, and at ~10 s of imports a child on a slow CPU the time box
# would skip it.
SMOKE = {"p1": dict(n_embd=64, n_layer=4, n_head=2), "p1_batches": (2,),
         "p2": dict(n_embd=64, n_layer=3, n_head=2, batch=4), "p2_max_models": 2,
         "p3": dict(n_embd=64, n_head=2, batch=1), "p3_layers": 2, "seq": 32, "vocab": 256,
         "p1_steps": (1, 2), "p2_steps": (1, 2)}
MIN_BUDGET = 4 * GiB  # below this the spilled XL model's arena would hold little more than one shard


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="folder for gpu_suite.json and gpu_suite.md")
    p.add_argument("--smoke", action="store_true", help="tiny models on the CPU: every code path, < 60 s")
    p.add_argument("--p3", action="store_true", help="also search the largest model hydra trains under the cap")
    p.add_argument("--budget-s", type=float, default=None, help="wall-time box for the whole run (default 420, smoke 50)")
    p.add_argument("--cap-gib", type=float, default=16.0, help="GPU memory cap for every system (capped runs)")
    p.add_argument("--p2-max-models", type=int, default=None, help="upper bound on K (time box); RAM sets the rest")
    return p.parse_args(argv)


class Clock:
    """The suite's time box: each phase gets a share of what is left; a run that would start after its
    phase's deadline is skipped with the reason printed and recorded."""

    def __init__(self, budget_s: float):
        self.start, self.end = time.perf_counter(), time.perf_counter() + budget_s

    def left(self) -> float:
        return self.end - time.perf_counter()

    def deadline(self, share: float) -> float:
        return time.perf_counter() + max(0.0, share * self.left())


class Suite:
    def __init__(self, args):
        self.args = args
        self.cfg = SMOKE if args.smoke else GPU
        # No CUDA call here beyond the count: the parent leaves the device to its children, each on a clean one.
        self.device = "cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu"
        self.clock = Clock(args.budget_s or (50.0 if args.smoke else 420.0))
        self.grace = 60.0 if args.smoke else 120.0   # a child's start (imports, templates) and teardown
        self.scratch = tempfile.mkdtemp(prefix="hydra-gpu-suite-")
        self.failures, self.record = [], {"mode": "smoke" if args.smoke else "gpu", "device": self.device,
                                          "cap_gib": args.cap_gib, "phases": {}}

    def workload(self, shape: dict, steps, batch=None, seed=0) -> Workload:
        shape = dict(shape)
        b = shape.pop("batch", batch)
        return Workload(**shape, vocab=self.cfg["vocab"], seq=self.cfg["seq"], batch=b, warmup=steps[0],
                        timed=steps[1], seed=seed)

    def capped_budget(self, w: Workload) -> tuple[int, float, str]:
        """hydra's memory_budget under the cap: the cap less the activation headroom. On the CPU the smoke test
        uses three times the largest shard (a block, or the tied embedding) instead, so the models spill there."""
        if self.device == "cpu":
            shard = 4 * max(12 * w.n_embd**2 + 13 * w.n_embd, w.vocab * w.n_embd)
            return 3 * shard + 65536, self.args.cap_gib, "CPU: 3 x largest shard (spilled)"
        headroom = hydra_headroom_bytes(w)
        cap = self.args.cap_gib * GiB
        note = f"budget = cap {cap / GiB:.1f} GiB - headroom {headroom / GiB:.1f} GiB"
        if cap - headroom < MIN_BUDGET:
            cap = headroom + MIN_BUDGET
            note = (f"cap raised to {cap / GiB:.1f} GiB for this batch: activations and the loss's logits need "
                    f"{headroom / GiB:.1f} GiB beside a {MIN_BUDGET / GiB:.0f} GiB budget")
        return int(cap - headroom), cap / GiB, note

    def child(self, system: str, deadline: float, **spec) -> dict:
        """Runs one system in its own process (benchmarks/gpu_suite_child.py) with its own timeout: the phase's
        deadline plus the grace for starting and stopping, never past the suite's end plus that grace."""
        spec.update(system=system, device=spec.get("device", self.device),
                    deadline=time.time() + (deadline - time.perf_counter()))
        name = f"{system}-{len(os.listdir(self.scratch))}"
        spec_path, result_path = (os.path.join(self.scratch, f"{name}.{kind}.json") for kind in ("spec", "result"))
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        timeout = max(1.0, min(deadline - time.perf_counter(), self.clock.left()) + self.grace)
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, CHILD, spec_path, result_path], capture_output=True, text=True,
                                  timeout=timeout)
            tail = (done.stdout + done.stderr)[-2000:]
            if os.path.exists(result_path):
                with open(result_path) as f:
                    return json.load(f)
            return {"error": f"the run's process ended with status {done.returncode} and no result", "output": tail}
        except subprocess.TimeoutExpired as expired:
            tail = ((expired.stdout or b"") + (expired.stderr or b""))[-2000:]
            return {"error": f"timeout: killed after {time.perf_counter() - start:.0f} s (its limit, {timeout:.0f} s)",
                    "output": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}

    def run(self, phase: dict, name: str, deadline: float, system: str, **spec) -> dict:
        if time.perf_counter() > deadline:
            result = {"skipped": f"time box: phase over its share of --budget-s ({self.clock.left():.0f} s left)"}
        else:
            start = time.perf_counter()
            result = self.child(system, deadline, **spec)
            result.setdefault("seconds", time.perf_counter() - start)
        phase[name] = result
        if "error" in result:
            self.failures.append(f"{name}: {result['error']}")
        status = result.get("skipped") or result.get("error") or (
            f"{result['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in result else "ok")
        print(f"  {name}: {'skipped: ' if 'skipped' in result else ''}{status}", flush=True)
        self.save(run={"name": name, "system": system, "result": result})
        return result

    def templates(self, phase: dict, w: Workload, seeds, deadline: float) -> str:
        """Saves the phase's template models once (a child of its own); its runs map them. A failure here
        costs time only: each run then builds its own from the same seeds."""
        folder = tempfile.mkdtemp(dir=self.scratch, prefix="templates-")
        self.run(phase, "templates", deadline, "templates", workload=w.__dict__, seeds=list(seeds),
                 template_dir=folder)
        return folder

    # ---- phases ---------------------------------------------------------------------------------------

    def p1(self, deadline: float):
        shape, phase = self.cfg["p1"], {}
        self.record["phases"]["P1"] = phase
        base = self.workload(shape, self.cfg["p1_steps"], batch=self.cfg["p1_batches"][0])
        print(f"P1: one model of {base.params() / 1e9:.2f}B params", flush=True)
        folder = self.templates(phase, base, [0], deadline)
        for batch in self.cfg["p1_batches"]:
            w = self.workload(shape, self.cfg["p1_steps"], batch=batch)
            entry = {"workload": w.as_dict()}
            phase[f"batch_{batch}"] = entry
            budget, cap, note = self.capped_budget(w)
            entry.update({"hydra_budget_gib": budget / GiB, "cap_gib": cap, "budget_note": note})
            same = dict(workload=asdict(w), seeds=[0], template_dir=folder, lrs=[1e-4])
            self.run(entry, "hydra_spilled_capped", deadline, "hydra", budget=budget, cap_gib=cap, **same)
            self.run(entry, "hydra_resident_uncapped", deadline, "hydra",
                     budget="90%" if self.device != "cpu" else "4GiB", **same)
            self.run(entry, "plain_uncapped", deadline, "plain", **same)
            speed = {k: v.get("tokens_per_s") for k, v in entry.items() if isinstance(v, dict)}
            if speed.get("plain_uncapped"):
                entry["ratio_spilled_vs_plain"] = (speed.get("hydra_spilled_capped") or 0) / speed["plain_uncapped"]
                entry["ratio_resident_vs_plain"] = (speed.get("hydra_resident_uncapped") or 0) / speed["plain_uncapped"]
            if speed.get("hydra_resident_uncapped"):
                entry["ratio_spilled_vs_resident"] = ((speed.get("hydra_spilled_capped") or 0)
                                                      / speed["hydra_resident_uncapped"])
            if entry["hydra_spilled_capped"].get("resident") == [True]:
                entry["warning"] = "the capped hydra run stayed resident: it did not measure spilling"
            if batch == self.cfg["p1_batches"][0]:
                self.run(phase, "profile_spilled_step", deadline, "profile", budget=budget, cap_gib=cap, **same)
        shutil.rmtree(folder, ignore_errors=True)

    def p2(self, deadline: float):
        w = self.workload(self.cfg["p2"], self.cfg["p2_steps"])
        # Host bytes per model: hydra's training state with an fp32 module (~18.4 B/param with AdamW) plus the
        # template copy kept so every system starts from the same weights (4 B/param).
        per_param = hydra_host_bytes_per_param(w, 2) + 4
        k_ram, why = models_that_fit(w.params(), per_param)
        limit = self.args.p2_max_models or self.cfg["p2_max_models"]
        k = min(k_ram, limit)
        print(f"P2: {why}; running K = {k} (time-box limit {limit})", flush=True)
        phase = {"workload": w.as_dict(), "k": k, "k_from_ram": k_ram, "k_reason": why, "k_limit": limit,
                 "host_bytes_per_param": per_param}
        self.record["phases"]["P2"] = phase
        if k < 1:
            phase["skipped"] = "host RAM holds no model's state with 25% headroom"
            print(f"  skipped: {phase['skipped']}")
            return
        lrs = [1e-4 * 2**i for i in range(k)]
        budget, cap, note = self.capped_budget(w)
        phase.update({"lrs": lrs, "hydra_budget_gib": budget / GiB, "cap_gib": cap, "budget_note": note})
        folder = self.templates(phase, w, range(k), deadline)
        same = dict(workload=asdict(w), seeds=list(range(k)), template_dir=folder, lrs=lrs, cap_gib=cap)
        share = (deadline - time.perf_counter()) / 3
        self.run(phase, "hydra", deadline - 2 * share, "hydra", budget=budget, **same)
        self.run(phase, "deepspeed_zero3_offload", deadline - share, "deepspeed", **same)
        self.run(phase, "fsdp2_cpu_offload", deadline, "fsdp2", **same)
        if self.args.smoke:  # FSDP2's own wrapping and step on the CPU, offload off: a code-path check only
            self.run(phase, "fsdp2_no_offload_cpu_check", deadline, "fsdp2_no_offload", **same)
        shutil.rmtree(folder, ignore_errors=True)
        hydra = phase["hydra"].get("tokens_per_s")
        for name in ("deepspeed_zero3_offload", "fsdp2_cpu_offload"):
            other = phase[name].get("tokens_per_s")
            if hydra and other:
                phase[f"ratio_hydra_vs_{name}"] = hydra / other

    def p3(self, deadline: float):
        """Grows n_layer by 1.5x until a run fails or the next model's host state would pass 85% of available
        RAM. Models are built in bf16 (the module's own copy then costs 2 B/param, not 4)."""
        phase = {"attempts": []}
        self.record["phases"]["P3"] = phase
        largest_ok = None
        for optimizer, states in (("adamw", 2), ("sgd", 0)):
            layers = largest_ok or self.cfg["p3_layers"]
            while time.perf_counter() < deadline:
                w = Workload(**self.cfg["p3"], n_layer=layers, vocab=self.cfg["vocab"], seq=self.cfg["seq"],
                             warmup=1, timed=2)  # three steps
                need = w.params() * hydra_host_bytes_per_param(w, states, module_bytes=2)
                if need > 0.85 * (meminfo()["available_bytes"] or 0):
                    phase["attempts"].append({"optimizer": optimizer, "n_layer": layers, "params": w.params(),
                                              "skipped": f"host RAM: needs {need / GiB:.0f} GiB"})
                    print(f"  P3 {optimizer} {w.params() / 1e9:.2f}B: stop, host RAM ({need / GiB:.0f} GiB)")
                    break
                budget, cap, note = self.capped_budget(w)
                attempt = {"optimizer": optimizer, "n_layer": layers, "params": w.params(), "cap_gib": cap}
                label = f"P3 {optimizer} n_layer={layers} {w.params() / 1e9:.2f}B"
                result = self.run(attempt, label, deadline, "hydra", workload=asdict(w), seeds=[0], dtype="bfloat16",
                                  lrs=[1e-5], budget=budget, cap_gib=cap, optimizer=optimizer)
                phase["attempts"].append({**attempt.pop(label), **attempt})
                ok = "error" not in result and "skipped" not in result
                if not ok:
                    break
                phase[f"largest_{optimizer}_params"] = w.params()
                largest_ok = layers if optimizer == "adamw" else largest_ok
                layers = max(layers + 1, int(layers * 1.5))
                if self.args.smoke and layers > 2 * self.cfg["p3_layers"]:
                    break  # the smoke test checks the loop, not the limit

    def save(self, run: dict | None = None):
        """Writes the record so far after every run, and appends that run to runs.jsonl: a suite stopped by an
        outer time limit keeps every figure it has produced."""
        self.record["failures"] = self.failures
        self.record["wall_s"] = time.perf_counter() - self.clock.start
        os.makedirs(self.args.out, exist_ok=True)
        if run is not None:
            with open(os.path.join(self.args.out, "runs.jsonl"), "a") as f:
                f.write(json.dumps({"at_s": round(self.record["wall_s"], 1), **run}, default=str) + "\n")
        for name, text in (("gpu_suite.json", lambda: json.dumps(self.record, indent=1, default=str)),
                           ("gpu_suite.md", lambda: markdown(self.record))):
            with open(os.path.join(self.args.out, name + ".partial"), "w") as f:
                f.write(text())
            os.replace(os.path.join(self.args.out, name + ".partial"), os.path.join(self.args.out, name))

    def main(self) -> int:
        print(f"hydra-torch GPU suite ({self.record['mode']}) on {self.device}, "
              f"time box {self.clock.left():.0f} s", flush=True)
        try:
            machine = self.child("machine", self.clock.deadline(0.1))
            self.record["machine"], self.record["pcie"] = machine.get("machine", machine), machine.get("pcie")
            print(f"PCIe: {self.record['pcie']}", flush=True)
            stress = {}
            self.record["phases"]["stress"] = stress
            print("Stream stress: 3 small spilled GPT-2 models, fp32 and bf16, on the device against the CPU")
            self.run(stress, "stream_stress", self.clock.deadline(0.15), "stress")
            with_p3 = self.args.p3 or self.args.smoke
            self.p1(self.clock.deadline(0.3 if with_p3 else 0.4))
            self.p2(self.clock.deadline(0.5 if with_p3 else 1.0))
            if with_p3:
                self.p3(self.clock.deadline(1.0))
            self.save()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        print(f"wrote {self.args.out}/gpu_suite.json and gpu_suite.md in {self.record['wall_s']:.0f} s; "
              f"{len(self.failures)} failures", flush=True)
        for failure in self.failures:
            print(f"  FAILED {failure}")
        return 1 if self.failures else 0


def main(argv=None) -> int:
    return Suite(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
