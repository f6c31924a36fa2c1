"""What a unit costs beside its compute: K tiny models (S linear layers of width W, one a shard) whose units
compute next to nothing, trained together on one CPU device, resident and spilled. A unit's wall time is then
what the worker, the runner and the native calls around its compute cost. Medians of interleaved rounds.

    python benchmarks/bench_unit_overhead.py [--models 4] [--shards 8] [--width 8] [--steps 40] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hydra_torch as ht


def mse(out, batch):
    return torch.nn.functional.mse_loss(out, batch[1])


def make_tasks(args):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, args.width, generator=g), torch.randn(2, args.width, generator=g))
            for _ in range(args.steps)]
    tasks = []
    for i in range(args.models):
        torch.manual_seed(i)
        model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.shards)))
        tasks.append(ht.ModelTask(model, data=data, loss_fn=mse, optimizer=ht.optim.AdamW(lr=1e-3),
                                  shards=args.shards, name=f"m{i}"))
    return tasks


def microseconds_per_unit(args, budget, resident: bool) -> float:
    tasks = make_tasks(args)
    start = time.perf_counter()
    results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    seconds = time.perf_counter() - start
    assert all(r.error is None and r.resident == resident for r in results), [(r.error, r.resident) for r in results]
    units = args.models * args.steps * (2 * args.shards - 1)
    return seconds / units * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Resident: every model fits. Spilled: a budget a few shards wide, so every visit copies and steps on the host.
    cases = {"resident": ("1GiB", True), "spilled": (4096, False)}
    measured = {case: [] for case in cases}
    microseconds_per_unit(args, *cases["resident"])  # warm-up: imports, the op dispatch, allocator
    for _ in range(args.rounds):
        for case, (budget, resident) in cases.items():
            measured[case].append(microseconds_per_unit(args, budget, resident))
    print(f"torch {torch.__version__}; {args.models} models x {args.shards} shards, {args.steps} steps; "
          f"medians of {args.rounds} interleaved rounds")
    print("| case | us per unit | all rounds |")
    print("|---|---|---|")
    for case, values in measured.items():
        print(f"| {case} | {statistics.median(values):.0f} | {', '.join(f'{v:.0f}' for v in values)} |")


if __name__ == "__main__":
    main()
