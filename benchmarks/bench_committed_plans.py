"""Committed plans at memory speed: the demo's workload (bench_multi_model.py) with each device committing to
0 (the policy decides every unit) and to `workers.COMMITTED_UNITS` units of its plan, interleaved, on 1 and 2
virtual CPU devices, spilled and resident. Committing is for copies over a link (bench_link_bound.py); here it
should change nothing.

    python benchmarks/bench_committed_plans.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
from unittest import mock

from transformers.utils import logging as hf_logging

import bench_multi_model as workload
from hydra_torch.run import workers


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workload.add_config_args(parser)
    workload.add_workload_args(parser, steps=20)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    data = workload.token_batches(args)
    spilled = workload.spilled_budget(args, data)
    cases = {"1 device, spilled": (["cpu"], spilled), "2 virtual devices, spilled": (["cpu", "cpu"], spilled),
             "2 virtual devices, resident": (["cpu", "cpu"], "4GiB")}
    commits = (0, workers.COMMITTED_UNITS)
    seconds = {(case, k): [] for case in cases for k in commits}
    for _ in range(args.rounds):
        for case, (devices, budget) in cases.items():
            for k in commits:
                with mock.patch.object(workers, "COMMITTED_UNITS", k):
                    seconds[(case, k)].append(workload.hydra_seconds(args, data, devices, budget)[0])
    print(f"medians of {args.rounds} interleaved rounds")
    print(f"| case | 0 committed (s) | {commits[1]} committed (s) | ratio |")
    print("|---|---|---|---|")
    for case in cases:
        a, b = (statistics.median(seconds[(case, k)]) for k in commits)
        print(f"| {case} | {a:.2f} | {b:.2f} | {b / a:.3f} |")


if __name__ == "__main__":
    main()
