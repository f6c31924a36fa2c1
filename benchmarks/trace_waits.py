"""Where a hydra run's device waited, read from the GPU suite's record of it (runs.jsonl, each hydra run's compact
trace: benchmarks/gpu_suite_systems.py).

On a GPU a unit's trace entry is mostly host-side time (its kernels are queued, not waited for), so a unit that
lasts long is one that waited: for its weights to come in, its gradient room, or its shard's step. Each such unit
(longer than `--over-ms`; the last shard's forward and backward is left out, as it reads the loss) is put in one of
two kinds by where the run's other tasks stood as it began (on one device, where their units would have run instead):

- *others mid-step*: another task had begun a micro-batch and not finished it, so it had units the device could have
  run meanwhile: a wait that an ordering of the units could have filled;
- *others between*: every other task was between micro-batches (its shard 0's backward done, its next shard 0's
  forward not begun), had not begun or had finished: a wait no ordering could fill, a lane binds there.

The trace numbers a task's units across the run, 2n - 1 per micro-batch for n shards (forwards of shards 0 to n-2,
the last shard's forward and backward, backwards of shards n-2 to 0).

    python benchmarks/trace_waits.py RUNS.jsonl [--over-ms 50] [--name hydra]
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

# A compact trace entry: [device, task, unit, shard, phase initial, start s, seconds, bytes copied meanwhile].
DEVICE, TASK, UNIT, SHARD, PHASE, START, SECONDS = range(7)


def _task_states(trace: list[list], shard_counts: list[int]):
    """Per task, its micro-batches as (first unit's start, last unit's end), in order."""
    spans = defaultdict(dict)
    for e in trace:
        per = 2 * shard_counts[e[TASK]] - 1
        begin, end = spans[e[TASK]].get(e[UNIT] // per, (e[START], e[START] + e[SECONDS]))
        spans[e[TASK]][e[UNIT] // per] = (min(begin, e[START]), max(end, e[START] + e[SECONDS]))
    return {task: [by_index[k] for k in sorted(by_index)] for task, by_index in spans.items()}


def _mid_step(micro_batches: list[tuple[float, float]], t: float) -> bool:
    return any(begin < t < end for begin, end in micro_batches)


def waits(result: dict, over_s: float) -> dict:
    """The long units of one hydra run (`result`: its record, with "trace" and "shard_params") by kind, and by
    shard and phase: counts and seconds."""
    trace, shard_counts = result["trace"], [len(p) for p in result["shard_params"]]
    states = _task_states(trace, shard_counts)
    kinds = {"others mid-step": [0, 0.0], "others between": [0, 0.0]}
    by_unit = defaultdict(list)
    for e in trace:
        n = shard_counts[e[TASK]]
        if e[SECONDS] <= over_s or (e[SHARD] == n - 1 and e[PHASE] == "f"):
            continue
        others = [mb for task, mb in states.items() if task != e[TASK]]
        kind = "others mid-step" if any(_mid_step(mb, e[START]) for mb in others) else "others between"
        kinds[kind][0] += 1
        kinds[kind][1] += e[SECONDS]
        by_unit[(e[SHARD], e[PHASE])].append(e[SECONDS])
    span = max(e[START] + e[SECONDS] for e in trace) - min(e[START] for e in trace) if trace else 0.0
    return {"span_s": span, "units": len(trace), "kinds": kinds,
            "by_unit": {key: (len(s), sum(s), statistics.median(s)) for key, s in by_unit.items()}}


def report(name: str, result: dict, over_s: float) -> list[str]:
    found = waits(result, over_s)
    lines = [f"{name}: placement {result.get('placement', '-')!r}, {found['units']} units over "
             f"{found['span_s']:.2f} s; units over {over_s * 1e3:.0f} ms (the loss unit left out):", "",
             "| kind | units | seconds | share of the span |", "|---|---|---|---|"]
    for kind, (count, seconds) in found["kinds"].items():
        share = seconds / found["span_s"] if found["span_s"] else 0.0
        lines.append(f"| {kind} | {count} | {seconds:.2f} | {share:.2f} |")
    lines += ["", "| shard | phase | units | seconds | median s |", "|---|---|---|---|---|"]
    ranked = sorted(found["by_unit"].items(), key=lambda item: -item[1][1])
    for (shard, phase), (count, seconds, median) in ranked[:8]:
        lines.append(f"| {shard} | {'backward' if phase == 'b' else 'forward'} | {count} | {seconds:.2f} "
                     f"| {median:.3f} |")
    return lines + [""]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", help="the GPU suite's runs.jsonl")
    parser.add_argument("--over-ms", type=float, default=50.0, help="a unit longer than this waited")
    parser.add_argument("--name", help="only the runs of this name (default: every run with a trace)")
    args = parser.parse_args(argv)
    with open(args.runs) as f:
        runs = [json.loads(line) for line in f if line.strip()]
    for run in runs:
        result = run.get("result")
        if not isinstance(result, dict) or not result.get("trace") or (args.name and run.get("name") != args.name):
            continue
        print("\n".join(report(run.get("name", "?"), result, args.over_ms / 1e3)))


if __name__ == "__main__":
    main()
