"""One model, three ways, side by side: a plain PyTorch loop, hydra-torch resident, hydra-torch spilled.

Reports the median time per optimizer step of each (rounds interleaved, so machine noise hits all three
alike) and the ratios to plain PyTorch. Targets: resident <= 1.05x; spilled <= 1.45x (re-running each
shard's forward in backward alone costs about 4/3). hydra-torch's times are its tasks' wall times: packing
the model into flat buffers and writing it back are included.

    python benchmarks/bench_training.py [--width 256 --blocks 8 --seq 128 --batch 8 --steps 6 --rounds 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import hydra_torch as ht  # noqa: E402
from models import Block  # noqa: E402


def build(width, blocks, vocab, seed=0):
    torch.manual_seed(seed)
    embed = torch.nn.Embedding(vocab, width)
    head = torch.nn.Linear(width, vocab, bias=False)
    head.weight = embed.weight
    return torch.nn.Sequential(embed, *[Block(width, heads=8, dropout=0.0) for _ in range(blocks)],
                               torch.nn.LayerNorm(width), head)


def loss_fn(output, batch):
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


def plain_seconds(model, data):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    start = time.perf_counter()
    for batch in data:
        optimizer.zero_grad()
        loss_fn(model(batch[0]), batch).backward()
        optimizer.step()
    return (time.perf_counter() - start) / len(data)


def hydra_seconds(model, data, budget):
    task = ht.ModelTask(model, loss_fn=loss_fn, data=data, optimizer=ht.optim.AdamW(lr=1e-4))
    result = ht.train([task], devices="cpu", memory_budget=budget, progress=False)[0]
    assert result.error is None, result.error
    return result.wall_time / len(data), result.resident


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spill-fraction", type=float, default=0.4)
    args = parser.parse_args()

    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]
    data = [(t[:, :-1], t[:, 1:]) for t in tokens]
    model = build(args.width, args.blocks, args.vocab)
    params = sum(p.numel() for p in model.parameters())
    model_bytes = params * 4
    times = {"plain": [], "resident": [], "spilled": []}
    for _ in range(args.rounds):
        times["plain"].append(plain_seconds(build(args.width, args.blocks, args.vocab), data))
        seconds, resident = hydra_seconds(build(args.width, args.blocks, args.vocab), data, 64 * model_bytes)
        assert resident
        times["resident"].append(seconds)
        seconds, resident = hydra_seconds(build(args.width, args.blocks, args.vocab), data,
                                          int(args.spill_fraction * model_bytes))
        assert not resident
        times["spilled"].append(seconds)

    base = statistics.median(times["plain"])
    print(f"model: {params / 1e6:.1f}M params, width {args.width}, {args.blocks} blocks, batch {args.batch}x{args.seq}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| mode | median s/step | ratio to plain |")
    print("|---|---|---|")
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"| {mode} | {median:.4f} | {median / base:.3f} |")


if __name__ == "__main__":
    main()
