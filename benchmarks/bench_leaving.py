"""Tasks that end early free their device memory and the others are placed again: the engine on two emulated
devices (CPU), with an emulated link and host.

`--models` GPT-2 models train on two virtual CPU devices, each its own emulated link (bytes / bandwidth seconds per
copy, `hydra_torch.testing.emulated_link`) and one host whose optimizer steps take bytes / (host speed x bandwidth)
(`emulated_host`); the first half stop after `--short-steps` steps, the others run all `--steps`. Side by side in one
process, interleaved rounds, medians: the span (first unit's start to last unit's end) with `placement="auto"` (a
task that ends leaves the engines at once and the tasks still training are placed again in the room it left,
hydra_torch.run.replacement) and "auto-stay" (the same, with no task placed again), and the ratio.

    python benchmarks/bench_leaving.py [--models 4] [--short-steps 2] [--budget 1.0] [--host-speed 0.5] [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

import hydra_torch as ht
from bench_emulated_link import (add_lane_args, make_tasks, parse_workload, placement_rounds,
                                 print_placement_spans)
from hydra_torch import testing
from hydra_torch.run import measuring, replacement


def train(args, data, budget, placement):
    """One run; (span, each task's placement, steps on the device after the first short task ended)."""
    tasks = make_tasks(args, data)
    for task in tasks[:args.models // 2]:
        task.max_steps = args.short_steps
    with contextlib.ExitStack() as stack:
        stack.enter_context(testing.emulated_link(args.bandwidth))
        stack.enter_context(testing.emulated_host(args.host_speed * args.bandwidth))
        if placement == "auto-stay":
            stack.enter_context(mock.patch.object(replacement, "movable", lambda *_: False))
        budget += measuring.kept_beside_arena(tasks)  # the arena as sized, beside the working set and saved inputs
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, progress=False, placement="auto")
    assert all(r.error is None for r in results), [r.error for r in results]
    span = max(e.end for e in results.trace) - min(e.start for e in results.trace)
    return span, [f"{r.name}: {r.placement}" for r in results], sum(e.place == "device" for e in results.steps)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=4, help="half stop early, half run every step")
    parser.add_argument("--short-steps", type=int, default=2, help="steps of the tasks that stop early")
    add_lane_args(parser)
    parser.add_argument("--budget", type=float, default=1.0, help="each device's budget in one model's fp32 weights")
    parser.add_argument("--placements", nargs="+", default=["auto-stay", "auto"], choices=["auto-stay", "auto"])
    args, data, shard_bytes = parse_workload(parser)
    budget = int(args.budget * sum(shard_bytes))
    spans, placed, device_steps = placement_rounds(args, args.placements,
                                                   lambda placement: train(args, data, budget, placement))
    print(f"{args.models} GPT-2 models of {sum(shard_bytes) / 4e6:.2f}M params in {len(shard_bytes)} shards on two "
          f"virtual CPU devices, {args.models // 2} stopping after {args.short_steps} of {args.steps} steps of "
          f"{args.batch}x{args.seq} tokens; budget {budget} bytes a device ({args.budget:g} models' fp32 weights), link "
          f"{args.bandwidth:g} B/s, host {args.host_speed:g}x the link; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; medians of {args.rounds} interleaved rounds")
    print_placement_spans(spans, placed, device_steps, against="auto-stay")


if __name__ == "__main__":
    main()
