"""Training time against its bound on an emulated link (CPU): how much of the copying the engine hides.

K spilled GPT-2 models train on one CPU device whose copies take bytes / bandwidth seconds each way
(`hydra_torch.testing.emulated_link`), the bandwidth set so that copying a block's weights takes `ratio` times
the block's forward. Bound = max(compute, host-to-device bytes / bandwidth, device-to-host bytes / bandwidth):
compute is the sum of the units' times in the same training at memory speed, the bytes are the engine's own
counts. Reported, medians of interleaved rounds: the span (first unit's start to last unit's end) over the
bound, and the shares of the span the compute waited for weights to land (`acquire_wait_seconds`, the exposed
copies) and for room for gradients (`grad_wait_seconds`, held up by earlier gradients still copying out).

    python benchmarks/bench_link_bound.py [--models 1] [--ratios 0.25 1 2 4] [--ahead 1] [--far] [--commit 4]
                                          [--rounds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from unittest import mock

import torch
import hydra_torch as ht
from bench_emulated_link import make_tasks, parse_workload
from hydra_torch import testing, workers


def train(args, data, budget, bandwidth=None):
    tasks = make_tasks(args, data)
    with contextlib.ExitStack() as stack:
        if bandwidth is not None:
            stack.enter_context(testing.emulated_link(bandwidth))
        if args.far:  # prefetch along the plan into all free memory, not only the next planned shard
            stack.enter_context(mock.patch.object(workers, "PREFETCH_BEYOND_NEXT_BYTES", -1))
        stack.enter_context(mock.patch.object(workers, "COMMITTED_UNITS", args.commit))
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    assert all(r.error is None and not r.resident for r in results), [r.error for r in results]
    return results


def span(results) -> float:
    return max(e.end for e in results.trace) - min(e.start for e in results.trace)


def block_forward_seconds(results, shards: int) -> float:
    """The median forward of a transformer block's shard (not the embedding's, not the head's)."""
    return statistics.median(e.end - e.start for e in results.trace
                             if e.phase == "forward" and 0 < e.shard < shards - 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--ahead", type=int, default=1,
                        help="room in the budget for this many more shards' weights (1: double buffering)")
    parser.add_argument("--far", action="store_true",
                        help="prefetch along the plan as far as free memory allows (default: the next shard)")
    parser.add_argument("--commit", type=int, default=workers.COMMITTED_UNITS,
                        help="units of its plan each device commits to (0: none, the policy decides each unit)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 1.0, 2.0, 4.0],
                        help="a block's weight copy over its forward")
    args, data, shard_bytes = parse_workload(parser)
    block_bytes = shard_bytes[1]
    # One shard's weights and gradients, and room for `ahead` more shards' weights to be copied in meanwhile.
    budget = (2 + args.ahead) * max(shard_bytes) + 65536
    rows = {ratio: [] for ratio in args.ratios}
    bandwidth = {}
    for _ in range(args.rounds):
        base = train(args, data, budget)
        compute = sum(e.end - e.start for e in base.trace)
        forward = block_forward_seconds(base, len(shard_bytes))
        for ratio in args.ratios:
            # Fixed after the first round, so that every round copies at the same pace.
            bandwidth.setdefault(ratio, block_bytes / (ratio * forward))
            results = train(args, data, budget, bandwidth[ratio])
            stats = results.stats[0]
            bound = max(compute, stats["host_to_device_bytes"] / bandwidth[ratio],
                        stats["device_to_host_bytes"] / bandwidth[ratio])
            took = span(results)
            rows[ratio].append((took / bound, stats["acquire_wait_seconds"] / took, stats["grad_wait_seconds"] / took,
                                compute, stats["host_to_device_bytes"] / bandwidth[ratio], took))
    prefetch = "as far as it allows" if args.far else "next"
    print(f"{args.models} spilled GPT-2 model(s) of {sum(shard_bytes) / 4e6:.2f}M params in {len(shard_bytes)} "
          f"shards, {args.steps} steps of {args.batch}x{args.seq} tokens, budget {budget} bytes (one shard's "
          f"weights and gradients and {args.ahead} more's weights), prefetch {prefetch}, {args.commit} units "
          f"committed; torch {torch.__version__}, {torch.get_num_threads()} threads; medians of {args.rounds} "
          "interleaved rounds")
    print("| copy / forward | bandwidth (bytes/s) | compute s | copies in s | span s | span / bound | waiting for "
          "weights | waiting for gradient room |")
    print("|---|---|---|---|---|---|---|---|")
    for ratio, runs in rows.items():
        med = [statistics.median(r[i] for r in runs) for i in range(6)]
        print(f"| {ratio:g} | {bandwidth[ratio]:.3g} | {med[3]:.2f} | {med[4]:.2f} | {med[5]:.2f} | {med[0]:.2f} | "
              f"{100 * med[1]:.0f}% | {100 * med[2]:.0f}% |")


if __name__ == "__main__":
    main()
