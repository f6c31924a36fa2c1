"""Tasks that join a running call, placed by the lane model or kept on the host: the engine on an emulated link and
host (CPU).

One GPT-2 model starts the call; the other `--models - 1` join it at once through `Arrivals` (as Optuna's later
trials do), while it trains. The CPU device's copies take bytes / bandwidth seconds each way
(`hydra_torch.testing.emulated_link`) and the host's optimizer steps bytes / (host speed x bandwidth)
(`emulated_host`). Side by side in one process, interleaved rounds, medians: the span (first unit's start to last
unit's end) under each `--placements` (ht.train's placement: "host" steps every shard of a joining task on the
host, "auto" lets the lane model step the shards it takes off the host on the device; "auto-start" is "auto" with the
lane model asked only as the call starts, the joining tasks' shards all stepped on the host; "auto-stay" is "auto"
with no task placed again when another leaves the run), and the span over host's.

    python benchmarks/bench_joining.py [--models 3] [--bandwidth 2e8] [--host-speed 0.5] [--rounds 3]
                                       [--placements host auto-start auto-stay auto]
"""
from __future__ import annotations

import argparse
import contextlib
import threading
from unittest import mock

import torch

import hydra_torch as ht
from bench_emulated_link import (add_lane_args, make_tasks, parse_workload, placement_rounds,
                                 print_placement_spans)
from hydra_torch import testing
from hydra_torch.arrivals import Arrivals
from hydra_torch.run import lane_choice, replacement


def train(args, data, budget, placement):
    """One run: the first task starts, the others join at once; (span, each task's placement, device steps)."""
    first, *joining = make_tasks(args, data)
    arrivals, failures = Arrivals(), []

    def driver():
        try:
            for task in joining:
                arrivals.add(task)
        except BaseException as error:  # noqa: BLE001  (reported below)
            failures.append(error)
        finally:
            arrivals.close()
    thread = threading.Thread(target=driver)
    thread.start()
    with contextlib.ExitStack() as stack:
        stack.enter_context(testing.emulated_link(args.bandwidth))
        stack.enter_context(testing.emulated_host(args.host_speed * args.bandwidth))
        if placement == "auto-start":
            stack.enter_context(mock.patch.object(lane_choice, "added_device_shards", lambda *_: []))
        if placement == "auto-stay":
            stack.enter_context(mock.patch.object(replacement, "movable", lambda *_: False))
        results = ht.train([first], devices="cpu", memory_budget=budget, progress=False,
                           placement=placement.split("-")[0], arrivals=arrivals)
    thread.join()
    assert not failures and all(r.error is None for r in results), (failures, [r.error for r in results])
    span = max(e.end for e in results.trace) - min(e.start for e in results.trace)
    placed = [f"{r.name}: {r.placement}" for r in results]
    return span, placed, results.stats[0]["device_steps"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=3, help="the first task and those that join it")
    add_lane_args(parser)
    parser.add_argument("--budget", type=float, default=3.0, help="the memory budget in one model's fp32 weights")
    parser.add_argument("--placements", nargs="+", default=["host", "auto-start", "auto"],
                        choices=["host", "auto-start", "auto-stay", "auto", "device"])
    args, data, shard_bytes = parse_workload(parser)
    budget = int(args.budget * sum(shard_bytes))
    spans, placed, device_steps = placement_rounds(args, args.placements,
                                                   lambda placement: train(args, data, budget, placement))
    print(f"{args.models} GPT-2 models of {sum(shard_bytes) / 4e6:.2f}M params in {len(shard_bytes)} shards, the "
          f"first training alone, the others joining it at once; {args.steps} steps of {args.batch}x{args.seq} tokens, "
          f"budget {budget} bytes ({args.budget:g} models' fp32 weights), link {args.bandwidth:g} B/s, host "
          f"{args.host_speed:g}x the link; torch {torch.__version__}, {torch.get_num_threads()} threads; medians of "
          f"{args.rounds} interleaved rounds")
    print_placement_spans(spans, placed, device_steps, against="host")


if __name__ == "__main__":
    main()
