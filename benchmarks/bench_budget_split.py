"""Does a run fit its memory_budget? K planned GPT-2-shaped models (shards="auto") trained on one CPU device under a
budget a little above the planner's smallest, with activations that dwarf the weights (the regime of a GPU card
filled to its size). Printed per run: placement, the arena the engine sized, one unit's working set, the most
bytes the micro-batches in flight held at once, their sum against the budget, and the wall time. With `--shards
layers` the models keep one shard per layer (ht.ModelTask's default) instead, on a CPU device whose memory counts as
a device's own (an emulated link fast enough to cost nothing), as on a GPU.

    python benchmarks/bench_budget_split.py [--models 1 4] [--factor 1.6 | --budget-mib 292] [--shards auto|layers]
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch

import hydra_torch as ht
from hydra_torch import testing

MiB = 2**20


def gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=128, n_embd=384, n_layer=6, n_head=6,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def batches(count: int = 3):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 256, (24, 128), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", type=int, nargs="+", default=[1, 4])
    p.add_argument("--factor", type=float, default=1.6, help="budget = factor x the planner's smallest")
    p.add_argument("--budget-mib", type=float, default=None, help="the budget itself (to compare two builds)")
    p.add_argument("--shards", choices=["auto", "layers"], default="auto",
                   help="planned shards, or one per layer on a device whose memory is its own")
    args = p.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()
    data = batches()
    smallest = ht.plan(ht.ModelTask(gpt2(0), data=data), "cpu", budget="4GiB").min_budget_bytes
    budget = int(args.budget_mib * MiB) if args.budget_mib else int(args.factor * smallest)
    print(f"budget {budget / MiB:.1f} MiB; the planner's smallest {smallest / MiB:.1f} MiB")
    print("| models | resident | arena MiB | working set MiB | saved held at most MiB | sum / budget | wall s |")
    print("|---|---|---|---|---|---|---|")
    for k in args.models:
        shards = "auto" if args.shards == "auto" else None
        tasks = [ht.ModelTask(gpt2(i), data=data, shards=shards, name=f"m{i}") for i in range(k)]
        start = time.perf_counter()
        with testing.emulated_link(1e12) if args.shards == "layers" else contextlib.nullcontext():
            results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
        wall = time.perf_counter() - start
        s = results.stats[0]
        total = s["capacity_bytes"] + s["working_set_bytes"] + s["saved_high_water_bytes"]
        print(f"| {k} | {sum(r.resident for r in results)} of {k} | {s['capacity_bytes'] / MiB:.1f} "
              f"| {s['working_set_bytes'] / MiB:.1f} | {s['saved_high_water_bytes'] / MiB:.1f} "
              f"| {total / budget:.2f} | {wall:.1f} |", flush=True)


if __name__ == "__main__":
    main()
