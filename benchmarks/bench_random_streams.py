"""What per-task random streams cost: bench_multi_model's hydra modes, each run with the task's CPU generator
sections as they are and with them replaced by a no-op (every task then draws from the shared generator, as
before streams existed), alternating in one process so both see the same machine.

    python benchmarks/bench_random_streams.py [--rounds 4]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics

from transformers.utils import logging as hf_logging

from hydra_torch.state import task_rng

from bench_multi_model import add_config_args, add_workload_args, hydra_seconds, spilled_budget, token_batches


@contextlib.contextmanager
def _shared_generator(self, key, start=None, save=True):
    yield


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_args(parser)
    add_workload_args(parser, steps=20)
    parser.set_defaults(rounds=4)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()

    data = token_batches(args)
    spilled = spilled_budget(args, data)
    modes = {
        "1 device, spilled": (["cpu"], spilled),
        "2 virtual devices, spilled": (["cpu", "cpu"], spilled),
        "1 device, resident": (["cpu"], "4GiB"),
        "2 virtual devices, resident": (["cpu", "cpu"], "4GiB"),
    }
    variants = {"streams": task_rng.TaskRng.cpu_section, "no-op": _shared_generator}
    times = {(mode, v): [] for mode in modes for v in variants}
    for round_ in range(args.rounds):
        for mode, (devices, budget) in modes.items():
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for variant in order:
                task_rng.TaskRng.cpu_section = variants[variant]
                times[(mode, variant)].append(hydra_seconds(args, data, devices, budget)[0])
    task_rng.TaskRng.cpu_section = variants["streams"]
    print("| mode | with per-task streams (median s) | no-op | ratio |")
    print("|---|---|---|---|")
    for mode in modes:
        with_, without = (statistics.median(times[(mode, v)]) for v in variants)
        print(f"| {mode} | {with_:.2f} | {without:.2f} | {with_ / without:.2f} |")


if __name__ == "__main__":
    main()
