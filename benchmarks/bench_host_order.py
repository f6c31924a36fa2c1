"""The order the host-step threads take the models' jobs in: the first that can start (a model whose next weights'
copy waits for its step first), against submission order, on the emulated link and host (CPU).

K spilled GPT-2 models train on one CPU device whose copies take bytes / bandwidth seconds each way
(`hydra_torch.testing.emulated_link`, the bandwidth set so that copying a block's weights takes `ratio` times the
block's forward, as in bench_link_bound.py) and whose host steps take bytes / (host speed x bandwidth)
(`emulated_host`). Each round runs both orders (`_C.HostSteps(in_submission_order=...)`), side by side in one
process; reported, medians of the rounds: the span (first unit's start to last unit's end), the span over the
submission order's in the same round, and the shares of the span the compute waited for weights and for gradient
room.

    python benchmarks/bench_host_order.py [--models 4] [--ratio 2] [--host-speed 1] [--threads 1] [--rounds 3]
                                          [--placement host]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from unittest import mock

import torch

import hydra_torch as ht
from bench_emulated_link import make_tasks, parse_workload
from bench_link_bound import block_forward_seconds, span
from hydra_torch import testing
from hydra_torch._loader import native as _C
from hydra_torch.run import measuring

ORDERS = {"first that can start": False, "submission": True}


def train(args, data, budget, bandwidth=None, in_submission_order=False):
    tasks = make_tasks(args, data)
    host_steps = _C.HostSteps
    with contextlib.ExitStack() as stack:
        if bandwidth is not None:
            stack.enter_context(testing.emulated_link(bandwidth))
            stack.enter_context(testing.emulated_host(args.host_speed * bandwidth))
        stack.enter_context(mock.patch.object(
            _C, "HostSteps", lambda threads, team: host_steps(threads, team, in_submission_order=in_submission_order)))
        budget += measuring.kept_beside_arena(tasks)  # the arena as sized, beside the working set and saved inputs
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False, placement=args.placement,
                           host_threads=args.threads)
    assert all(r.error is None for r in results), [r.error for r in results]
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=2.0, help="a block's weight copy over its forward")
    parser.add_argument("--host-speed", type=float, default=1.0, help="the host's memory over the link's bandwidth")
    parser.add_argument("--threads", type=int, default=1, help="host-step threads")
    parser.add_argument("--placement", default="host", choices=["host", "auto", "device"])
    args, data, shard_bytes = parse_workload(parser)
    budget = 3 * max(shard_bytes) + 65536  # one shard's weights and gradients, and the next one's weights
    rows = {order: [] for order in ORDERS}
    bandwidth = None
    for _ in range(args.rounds):
        if bandwidth is None:  # from the first round's memory-speed run, then fixed
            base = train(args, data, budget)
            bandwidth = shard_bytes[1] / (args.ratio * block_forward_seconds(base, len(shard_bytes)))
        for order, in_submission_order in ORDERS.items():
            results = train(args, data, budget, bandwidth, in_submission_order)
            stats, took = results.stats[0], span(results)
            rows[order].append((took, stats["acquire_wait_seconds"] / took, stats["grad_wait_seconds"] / took))
    print(f"{args.models} spilled GPT-2 model(s) of {sum(shard_bytes) / 4e6:.2f}M params in {len(shard_bytes)} "
          f"shards, {args.steps} steps of {args.batch}x{args.seq} tokens, budget {budget} bytes, copy / forward "
          f"{args.ratio:g} (link {bandwidth:.3g} B/s), host {args.host_speed:g}x the link, {args.threads} host-step "
          f"thread(s), placement {args.placement!r}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"medians of {args.rounds} interleaved rounds")
    print("| host jobs taken | span s | span / submission order's | waiting for weights | waiting for gradient room |")
    print("|---|---|---|---|---|")
    for order, measured in rows.items():
        versus = statistics.median(r[0] / s[0] for r, s in zip(measured, rows["submission"]))
        med = [statistics.median(r[i] for r in measured) for i in range(3)]
        print(f"| {order} | {med[0]:.2f} | {versus:.2f} | {100 * med[1]:.0f}% | {100 * med[2]:.0f}% |")


if __name__ == "__main__":
    main()
