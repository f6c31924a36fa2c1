"""The partitioner's plans against the ideal, on models with uneven pieces. One intra-op thread.

For each model and limit: the plan's slowest shard, the ideal (max(total / shards, slowest piece): a lower
bound no plan of that many shards beats), and the slowest shard of the previous default for the same shard
count, shards balanced by parameter count; all from the same measured piece times. Plus the time planning
took (probing every piece, then the native search).

    PYTHONPATH=. python benchmarks/bench_partitioner.py
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

import hydra_torch as ht
from hydra_torch.models import sharding
from hydra_torch.models.memory import format_bytes


def mlp(hidden, width=256, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, h), nn.ReLU(), nn.Linear(h, width)) for h in hidden])
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(128, width, generator=g), torch.randn(128, width, generator=g))]
    return ht.ModelTask(model, data=data, loss_fn=lambda out, batch: F.mse_loss(out, batch[1]))


def gpt2(width=128, layers=6, vocab=4096, seq=64):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=width, n_layer=layers, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, vocab, (4, seq), generator=torch.Generator().manual_seed(0))
    return ht.ModelTask(GPT2LMHeadModel(config), data=[{"input_ids": ids, "labels": ids.clone()}])


def param_balanced_bottleneck(task, piece_seconds, count):
    sizes = [sum(p.numel() for p in piece.parameters()) for piece in task.pieces]
    starts = sharding._balanced_cuts(sizes, count)
    ends = starts[1:] + [len(piece_seconds)]
    return max(sum(piece_seconds[a:b]) for a, b in zip(starts, ends))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    uneven = [256, 1024, 512, 256, 768, 512, 1024, 256] * 4
    pyramid = [256 + 48 * i for i in range(16)]
    cases = [("uneven MLP (4x widths)", lambda: mlp(uneven), "1GiB", 4),
             ("uneven MLP (4x widths)", lambda: mlp(uneven), "1GiB", 8),
             ("pyramid MLP (256..976)", lambda: mlp(pyramid), "1GiB", 4),
             ("uneven MLP, tight budget", lambda: mlp(uneven), 1.5, None),
             ("tiny GPT-2 (6 x 128, vocab 4096)", gpt2, "1GiB", 3),
             ("tiny GPT-2 (6 x 128, vocab 4096)", gpt2, "1GiB", None)]
    print("| model | pieces | budget | max shards | shards | slowest shard ms | ideal ms | plan / ideal "
          "| param-balanced ms (same shards) | planning s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, make, budget, max_shards in cases:
        task = make()
        if isinstance(budget, float):  # a multiple of the smallest budget that works
            minimum = ht.plan(task, budget="1GiB", repeats=1).min_budget_bytes
            budget = int(budget * minimum)
        start = time.perf_counter()
        plan = ht.plan(task, budget=budget, max_shards=max_shards, repeats=args.repeats)
        planning = time.perf_counter() - start
        balanced = param_balanced_bottleneck(task, plan.piece_seconds, plan.num_shards)
        budget_text = budget if isinstance(budget, str) else format_bytes(budget)
        print(f"| {name} | {len(plan.piece_seconds)} | {budget_text} | {max_shards or '-'} | {plan.num_shards} "
              f"| {1e3 * plan.bottleneck_seconds:.2f} | {1e3 * plan.ideal_seconds:.2f} "
              f"| {plan.bottleneck_seconds / plan.ideal_seconds:.3f} | {1e3 * balanced:.2f} | {planning:.2f} |")


if __name__ == "__main__":
    main()
