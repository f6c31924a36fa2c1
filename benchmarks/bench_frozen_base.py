"""A LoRA sweep over one base with and without ht.FrozenBase: host bytes for K = 1, 4, 12 tasks, and bytes copied
to the device and throughput on an emulated link for K = 4 and 12, shared against unshared, in one process
(rounds alternate; medians).

The base is GPT-2's shape cut down (6 layers of width 256, vocabulary 8192: 6.9M weights, random), each task a
LoRA of rank 4, 8 or 16 on c_attn (and c_proj for every third) with its own learning rate; on one CPU device,
AdamW, one micro-batch a step. Budgets are fractions of one model's weights (`--budgets`): below 1 the base
cannot stay cached whole; at 1.6 it can, and separate copies of it cannot.

    python benchmarks/bench_frozen_base.py [--tasks 1 4 12] [--link 2e9] [--rounds 2] [--steps 4] [--budgets 0.7 1.6]
"""
import argparse
import copy
import statistics
import time

import peft
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht
from hydra_torch import testing

SEQ, BATCH = 64, 4


def base_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=8192, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def sweep(base, count, steps, shared):
    frozen = ht.FrozenBase() if shared else None
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(steps):
        ids = torch.randint(0, 8192, (BATCH, SEQ), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    tasks, models = [], []
    for i in range(count):
        rank = (4, 8, 16)[i % 3]
        targets = ["c_attn", "c_proj"] if i % 3 == 2 else ["c_attn"]
        model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                                         target_modules=targets, fan_in_fan_out=True))
        tasks.append(ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-4 * (1 + i)), name=f"lora{i}",
                                  base=frozen))
        models.append(model)
    return tasks, models


def run(base, count, steps, shared, budget, link=None):
    tasks, models = sweep(base, count, steps, shared)
    start = time.perf_counter()
    if link:
        with testing.emulated_link(link):
            results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    else:
        results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
    wall = time.perf_counter() - start
    assert all(r.ok for r in results), [r.error for r in results]
    host = sum(r.host_bytes for r in results) + sum(b["host_bytes"] for b in results.bases.values())
    trainable = sum(p.numel() for m in models for p in m.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in models[0].parameters() if not p.requires_grad)
    copied = results.stats[0]["host_to_device_bytes"]
    base_copied = sum(b["copied_bytes"] for b in results.bases.values())
    return dict(host=host, trainable=trainable, frozen=frozen, copied=copied, base_copied=base_copied, wall=wall,
                tokens=count * steps * BATCH * SEQ)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tasks", type=int, nargs="+", default=[1, 4, 12])
    parser.add_argument("--link", type=float, default=2e9)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.7, 1.6])
    args = parser.parse_args()
    base = base_model()
    weights = sum(p.numel() * 4 for p in base.parameters())
    budget = int(args.budgets[0] * weights)
    torch.set_num_threads(2)

    print("| K | host bytes, shared | target: base + K x adapters | shared / target | unshared / shared |")
    print("|---|---|---|---|---|")
    for k in args.tasks:
        shared = run(base, k, 1, True, budget)
        unshared = run(base, k, 1, False, budget)
        target = 4 * shared["frozen"] + 12 * shared["trainable"]  # fp32 base; adapters' master and AdamW moments
        print(f"| {k} | {shared['host'] / 1e6:.1f} MB | {target / 1e6:.1f} MB | {shared['host'] / target:.3f} | "
              f"{unshared['host'] / shared['host']:.2f} |")

    print(f"\nEmulated link {args.link / 1e9:g} GB/s, one model's weights {weights / 1e6:.1f} MB, {args.steps} steps "
          f"a task, medians of {args.rounds} rounds")
    print("| budget | K | copied a step, shared | unshared | base part, shared / unshared | its target 1.2 / K | "
          "tokens/s shared / unshared |")
    print("|---|---|---|---|---|---|---|")
    for fraction, k in ((f, k) for f in args.budgets for k in args.tasks if k > 1):
        budget = int(fraction * weights)
        rounds = {True: [], False: []}
        for _ in range(args.rounds):
            for shared in (True, False):
                rounds[shared].append(run(base, k, args.steps, shared, budget, args.link))
        med = {s: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for s, rs in rounds.items()}
        steps = k * args.steps
        shared, unshared = med[True], med[False]
        own = shared["copied"] - shared["base_copied"]  # the tasks' own weights, the same either way
        base_unshared = unshared["copied"] - own
        print(f"| {budget / 1e6:.1f} MB | {k} | {shared['copied'] / steps / 1e6:.2f} MB | "
              f"{unshared['copied'] / steps / 1e6:.2f} MB | "
              f"{shared['base_copied'] / base_unshared:.3f} | {1.2 / k:.3f} | "
              f"{(shared['tokens'] / shared['wall']) / (unshared['tokens'] / unshared['wall']):.2f} |")


if __name__ == "__main__":
    main()
