"""hydra-torch's GPU suite: hydra against plain PyTorch, DeepSpeed ZeRO-Offload (stage 2) and ZeRO-3 offload, and
FSDP2 CPU offload on GPT-2-shaped models, under one GPU memory cap for every system. benchmarks/RESULTS.md
("GPU suite") explains each measure and the targets.

    python benchmarks/gpu_suite.py --out OUT [--phases p2,p1,stress,p3] [--budget-s 330] [--cap-gib 16]   # GPU
    python benchmarks/gpu_suite.py --smoke --out OUT    # every code path with tiny models on the CPU

Phases, in this order by default (the figures that matter most first, while the time box is fresh):
P2: K GPT-2-large-shaped models with different learning rates, K from host RAM: hydra in one ht.train call,
    then each baseline on one model for 5 steps (training K one after another gives that per-model rate), then
    K processes of the fastest baseline at once, each under cap / K (what a user would try first).
P1: one GPT-2-XL-shaped model: hydra spilled under the cap, hydra resident without it, plain PyTorch without
    it, with per-block activation checkpointing (hydra's FLOPs) and without, at a batch well below and one at
    the T >= F/B break-even (HYDRA.md section 3); then a profile of one spilled step at the smaller batch.
stress: three small spilled GPT-2 models, fp32 and bf16, eviction on every visit, against the same run on the
    CPU (benchmarks/gpu_suite_stress.py).
P3: (--p3) the largest GPT-shaped model hydra trains for 3 steps under the cap, AdamW then SGD.
Every run is a process of its own (benchmarks/gpu_suite_child.py) that builds its models from their seeds, on a
clean device, and stops itself by its deadline; it is killed at the end of its phase's share at the latest, and
a baseline cut short keeps the steps it timed. OUT/gpu_suite.json and OUT/gpu_suite.md are rewritten, and
OUT/runs.jsonl appended, after every run. Exit status 0 only if nothing that ran failed.
"""
from __future__ import annotations

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

from gpu_suite_args import parse_args  # noqa: E402
from gpu_suite_env import GiB, Workload, hydra_host_bytes_per_param, meminfo, median_after, models_that_fit  # noqa: E402
from gpu_suite_report import markdown  # noqa: E402

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_suite_child.py")

# hydra's P2 runs at least 6 steps, 2 of them warm-up; a baseline 5 steps on one model, 2 of them warm-up.
GPU = {"p1": dict(n_embd=1600, n_layer=48, n_head=25), "p1_batches": (4, 16),       # GPT-2 XL, 1.56B
       "p2": dict(n_embd=1280, n_layer=36, n_head=20, batch=8), "p2_max_models": 4,  # GPT-2 large, 0.77B
       "p3": dict(n_embd=4096, n_head=32, batch=1), "p3_layers": 8, "seq": 1024, "vocab": 50257,
       "p1_steps": (1, 3), "p2_steps": (2, 4), "baseline_steps": (2, 3), "stress_steps": 6}
# One batch in P1: a second runs the same code, and at ~10 s of imports a child on a slow CPU the time box
# would skip it. Two stress steps: on a CPU without bf16 instructions the bf16 half alone takes ~25 s for six,
# past the phase's share of the time box.
SMOKE = {"p1": dict(n_embd=64, n_layer=4, n_head=2), "p1_batches": (2,),
         "p2": dict(n_embd=64, n_layer=3, n_head=2, batch=4), "p2_max_models": 2,
         "p3": dict(n_embd=64, n_head=2, batch=1), "p3_layers": 2, "seq": 32, "vocab": 256,
         "p1_steps": (1, 2), "p2_steps": (2, 4), "baseline_steps": (2, 3), "stress_steps": 2}
# Each phase's share of the time left when it starts, relative to the phases still to run.
WEIGHTS = {"p2": 5.0, "p1": 3.0, "stress": 0.5, "p3": 3.0}
# The smoke stress run is a CPU's small models in fp32 and bf16, as slow as the machine is busy: its share of
# 0.5 (about 20 s of the test's box) killed it on a machine building beside it; what it leaves goes to P3.
SMOKE_WEIGHTS = {**WEIGHTS, "stress": 2.0}
SLACK = GiB  # of the cap, outside hydra's budget: cuBLAS workspaces, the CUDA allocator's rounding
BASELINES = ("deepspeed_zero2_offload", "deepspeed_zero3_offload", "fsdp2_cpu_offload")
SYSTEM_OF = {"deepspeed_zero2_offload": "deepspeed_zero2", "deepspeed_zero3_offload": "deepspeed_zero3",
             "fsdp2_cpu_offload": "fsdp2", "fsdp2_no_offload_cpu_check": "fsdp2_no_offload"}


def hydra_rate(result: dict) -> float | None:
    """A hydra P2 run's headline tokens/s: over its steady window, else from its median steps."""
    return result.get("window_tokens_per_s") or result.get("tokens_per_s")


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
        self.clock = Clock(args.budget_s or (50.0 if args.smoke else 330.0))
        self.scratch = tempfile.mkdtemp(prefix="hydra-gpu-suite-")
        self.failures, self.record = [], {"mode": "smoke" if args.smoke else "gpu", "device": self.device,
                                          "cap_gib": args.cap_gib, "phases": {}, "phase_order": args.phases}

    def workload(self, shape: dict, steps, batch=None, seed=0) -> Workload:
        shape = dict(shape)
        b = shape.pop("batch", batch)
        return Workload(**shape, vocab=self.cfg["vocab"], seq=self.cfg["seq"], batch=b, warmup=steps[0],
                        timed=steps[1], seed=seed)

    def capped_budget(self, w: Workload) -> tuple[int, float, str]:
        """hydra's memory_budget under the cap: all of it but the slack no budget sees (the budget holds the
        training state, one unit's working set and the saved activations). On the CPU the smoke test uses
        three times the largest shard (a block, or the tied embedding) plus a micro-batch's activations, so the
        models spill there."""
        if self.device == "cpu":
            shard = 4 * max(12 * w.n_embd**2 + 13 * w.n_embd, w.vocab * w.n_embd)
            activations = 64 * w.tokens_per_step * max(w.n_embd, w.vocab)
            return 3 * shard + activations, self.args.cap_gib, "CPU: 3 x largest shard + activations (spilled)"
        cap = self.args.cap_gib * GiB
        return int(cap - SLACK), cap / GiB, f"budget = cap {cap / GiB:.1f} GiB - {SLACK / GiB:.0f} GiB slack"

    def child(self, system: str, deadline: float, **spec) -> dict:
        """Runs one system in its own process (benchmarks/gpu_suite_child.py), killed at `deadline` (never past
        the suite's end) if it has not ended. The run itself is told to stop a little earlier, time to tear
        down; a run that is killed keeps the steps it reported (its "partial" record)."""
        process, result_path = self.start_child(system, deadline, **spec)
        return self.finish_child(process, result_path, deadline)

    def start_child(self, system: str, deadline: float, **spec):
        limit = min(deadline, self.clock.end)
        teardown = min(20.0, 0.15 * max(0.0, limit - time.perf_counter()))
        spec.update(system=system, device=spec.get("device", self.device),
                    deadline=time.time() + (limit - teardown - time.perf_counter()))
        name = f"{system}-{len(os.listdir(self.scratch))}"
        spec_path, result_path = (os.path.join(self.scratch, f"{name}.{kind}.json") for kind in ("spec", "result"))
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        # Output to a file, not a pipe: a chatty run (DeepSpeed) must never block on a pipe nobody reads yet,
        # as it would while the suite waits for another of K runs at once.
        with open(result_path + ".log", "w") as log:
            process = subprocess.Popen([sys.executable, CHILD, spec_path, result_path], stdout=log,
                                       stderr=subprocess.STDOUT)
        return process, result_path

    def finish_child(self, process, result_path: str, deadline: float) -> dict:
        start = time.perf_counter()
        timeout = max(1.0, min(deadline, self.clock.end) - start)
        try:
            process.wait(timeout=timeout)
            if os.path.exists(result_path):
                with open(result_path) as f:
                    return json.load(f)
            result = {"error": f"the run's process ended with status {process.returncode} and no result"}
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            result = {"error": f"timeout: killed after {time.perf_counter() - start:.0f} s (its limit, {timeout:.0f} s)"}
        with open(result_path + ".log", errors="replace") as log:
            result["output"] = log.read()[-2000:]
        progress = result_path + ".progress"
        if os.path.exists(progress):
            with open(progress) as f:
                result["partial"] = partial_rate(json.load(f))
        return result

    def record_run(self, phase: dict, name: str, system: str, result: dict, counts_as_failure: bool = True) -> dict:
        phase[name] = result
        if "error" in result and counts_as_failure:
            self.failures.append(f"{name}: {result['error']}")
        status = result.get("skipped") or result.get("error") or (
            f"{result['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in result else "ok")
        print(f"  {name}: {'skipped: ' if 'skipped' in result else ''}{status}", flush=True)
        self.save(run={"name": name, "system": system, "result": result})
        return result

    def run(self, phase: dict, name: str, deadline: float, system: str, **spec) -> dict:
        if time.perf_counter() > deadline:
            result = {"skipped": f"time box: phase over its share of --budget-s ({self.clock.left():.0f} s left)"}
        else:
            start = time.perf_counter()
            result = self.child(system, deadline, **spec)
            result.setdefault("seconds", time.perf_counter() - start)
        return self.record_run(phase, name, system, result)

    def at_once(self, phase: dict, name: str, deadline: float, system: str, k: int, w: Workload, lrs, cap: float):
        """K processes of one baseline started together, each with one model under cap / K: their rates add
        while they all run. Out of memory under the smaller cap is a measured outcome, not a failure."""
        if time.perf_counter() > deadline:
            return self.record_run(phase, name, system, {"skipped": "time box"})
        started = [self.start_child(system, deadline, workload=asdict(w), seeds=[i], lrs=[lrs[i]], cap_gib=cap / k)
                   for i in range(k)]
        runs = [self.finish_child(process, path, deadline) for process, path in started]
        # A run cut short at the deadline counts with the steps it reported.
        rates = [r.get("tokens_per_s") or r.get("partial", {}).get("tokens_per_s") for r in runs]
        result = {"processes": k, "cap_gib_each": cap / k, "runs": runs,
                  "out_of_memory": sum(bool(r.get("out_of_memory")) for r in runs)}
        if all(rates):
            result["tokens_per_s"] = sum(rates)
        errors = [r.get("error", "no rate") for r, rate in zip(runs, rates) if not rate and not r.get("out_of_memory")]
        if errors:
            result["error"] = "; ".join(errors)
        return self.record_run(phase, name, system, result)

    def deadlines(self):
        """Each selected phase's deadline, decided when the phase starts: its weight's share of the time left."""
        weights = SMOKE_WEIGHTS if self.args.smoke else WEIGHTS
        remaining = list(self.args.phases)
        while remaining:
            phase = remaining.pop(0)
            total = weights[phase] + sum(weights[p] for p in remaining)
            yield phase, self.clock.deadline(weights[phase] / total)

    # ---- phases ---------------------------------------------------------------------------------------

    def p2(self, deadline: float):
        w = self.workload(self.cfg["p2"], self.args.p2_steps or self.cfg["p2_steps"])
        # Host bytes per model: hydra's training state with an fp32 module (~18.4 B/param with AdamW).
        per_param = hydra_host_bytes_per_param(w, 2)
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
        one = self.workload(self.cfg["p2"], self.cfg["baseline_steps"])
        phase["baseline_workload"] = one.as_dict()
        baselines = [] if self.args.skip_baselines else \
            list(BASELINES) + (["fsdp2_no_offload_cpu_check"] if self.args.smoke else [])
        placements = self.args.hydra_placements
        # hydra half of the phase (all of it without baselines), each baseline an equal part of the rest, the K
        # processes the last part; hydra's part split evenly between its placements, run one after another.
        start = time.perf_counter()
        share = (deadline - start) / 2 / (len(baselines) + 1)
        hydra_end = deadline - share * (len(baselines) + 1) if baselines else deadline
        for i, placement in enumerate(placements):
            end = start + (hydra_end - start) * (i + 1) / len(placements)
            self.run(phase, "hydra" if i == 0 else f"hydra_{placement}", end, "hydra", budget=budget,
                     workload=asdict(w), seeds=list(range(k)), lrs=lrs, cap_gib=cap, placement=placement)
        for i, name in enumerate(baselines):
            self.run(phase, name, deadline - share * (len(baselines) - i), SYSTEM_OF[name], workload=asdict(one),
                     seeds=[0], lrs=lrs[:1], cap_gib=cap)
        rated = {name: phase[name]["tokens_per_s"] for name in baselines if phase[name].get("tokens_per_s")}
        if rated:
            best = max(rated, key=rated.get)
            phase["best_baseline"] = best
            self.at_once(phase, f"{best}_x{k}_at_once", deadline, SYSTEM_OF[best], k, one, lrs, cap)
        hydra = hydra_rate(phase["hydra"])
        for name in [*baselines, f"{phase.get('best_baseline')}_x{k}_at_once"]:
            other = phase.get(name, {}).get("tokens_per_s")
            if hydra and other:
                phase[f"ratio_hydra_vs_{name}"] = hydra / other
        for placement in placements[1:]:
            other = hydra_rate(phase[f"hydra_{placement}"])
            if hydra and other:
                phase[f"ratio_hydra_vs_hydra_{placement}"] = hydra / other
            spans = (phase["hydra"].get("span_tokens_per_s"), phase[f"hydra_{placement}"].get("span_tokens_per_s"))
            if all(spans):
                phase[f"span_ratio_hydra_vs_hydra_{placement}"] = spans[0] / spans[1]

    def p1(self, deadline: float):
        shape, phase = self.cfg["p1"], {}
        self.record["phases"]["P1"] = phase
        base = self.workload(shape, self.cfg["p1_steps"], batch=self.cfg["p1_batches"][0])
        print(f"P1: one model of {base.params() / 1e9:.2f}B params", flush=True)
        for batch in self.cfg["p1_batches"]:
            w = self.workload(shape, self.cfg["p1_steps"], batch=batch)
            entry = {"workload": w.as_dict()}
            phase[f"batch_{batch}"] = entry
            budget, cap, note = self.capped_budget(w)
            entry.update({"hydra_budget_gib": budget / GiB, "cap_gib": cap, "budget_note": note})
            same = dict(workload=asdict(w), seeds=[0], lrs=[1e-4])
            self.run(entry, "hydra_spilled_capped", deadline, "hydra", budget=budget, cap_gib=cap, **same)
            self.run(entry, "hydra_resident_uncapped", deadline, "hydra",
                     budget="90%" if self.device != "cpu" else "4GiB", **same)
            self.run(entry, "plain_checkpointed_uncapped", deadline, "plain_checkpointed", **same)
            self.run(entry, "plain_uncapped", deadline, "plain", **same)
            speed = {k: v.get("tokens_per_s") for k, v in entry.items() if isinstance(v, dict)}
            for name, reference in (("spilled_vs_plain_checkpointed", "plain_checkpointed_uncapped"),
                                    ("spilled_vs_plain", "plain_uncapped"),
                                    ("resident_vs_plain", "plain_uncapped")):
                mine = speed.get("hydra_resident_uncapped" if name.startswith("resident") else "hydra_spilled_capped")
                if speed.get(reference):
                    entry[f"ratio_{name}"] = (mine or 0) / speed[reference]
            if entry["hydra_spilled_capped"].get("resident") == [True]:
                entry["warning"] = "the capped hydra run stayed resident: it did not measure spilling"
            if batch == self.cfg["p1_batches"][0]:
                self.run(phase, "profile_spilled_step", deadline, "profile", budget=budget, cap_gib=cap, **same)

    def stress(self, deadline: float):
        stress = {}
        self.record["phases"]["stress"] = stress
        print("Stream stress: 3 small spilled GPT-2 models, fp32 and bf16, on the device against the CPU")
        self.run(stress, "stream_stress", deadline, "stress", steps=self.cfg["stress_steps"])

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
        print(f"hydra-torch GPU suite ({self.record['mode']}) on {self.device}, phases {','.join(self.args.phases)}, "
              f"time box {self.clock.left():.0f} s", flush=True)
        try:
            machine = self.child("machine", self.clock.deadline(0.05))
            self.record["machine"], self.record["pcie"] = machine.get("machine", machine), machine.get("pcie")
            print(f"PCIe: {self.record['pcie']}", flush=True)
            for phase, deadline in self.deadlines():
                getattr(self, phase)(deadline)
            self.save()
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        print(f"wrote {self.args.out}/gpu_suite.json and gpu_suite.md in {self.record['wall_s']:.0f} s; "
              f"{len(self.failures)} failures", flush=True)
        for failure in self.failures:
            print(f"  FAILED {failure}")
        return 1 if self.failures else 0


def partial_rate(progress: dict) -> dict:
    """What a baseline cut short had measured: its step times so far, and the rate over the timed ones."""
    times, warmup = progress.get("step_times", []), progress.get("warmup", 0)
    median = median_after(times, warmup) if len(times) > warmup else None
    return {"steps": len(times), "step_times": times,
            "tokens_per_s": progress.get("tokens_per_step", 0) / median if median else None}


def main(argv=None) -> int:
    return Suite(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
