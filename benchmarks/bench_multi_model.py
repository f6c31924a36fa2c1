"""The demo's GPT-2 configurations on the CPU, side by side: plain PyTorch one model after another, versus
one ht.train call on one device and on two virtual CPU devices (one thread each), spilled and resident.

Reports aggregate tokens/s (median over rounds, interleaved) and ratios to the plain sequential loop. The
defaults are `python -m hydra_torch.demo`'s configurations (widths 96 and 128 x learning rates 1e-3 and
3e-3, 4 layers, vocabulary 2048, batches of 8x64 tokens) and its default spilled budget.

    python benchmarks/bench_multi_model.py [--widths 96 128 --lrs 1e-3 3e-3 --steps 20 --rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import hydra_torch as ht


def add_workload_args(parser, steps: int):
    """The GPT-2 shape and data knobs the CPU multi-model benchmarks share."""
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--rounds", type=int, default=3)


def add_config_args(parser):
    """The demo's configurations: widths x learning rates."""
    parser.add_argument("--widths", type=int, nargs="+", default=[96, 128])
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3])


def spilled_budget(args, data) -> int:
    """The spilled budget: room for three of the largest shard."""
    probes = [ht.ModelTask(m, data=data) for m in make_models(args)]
    largest_shard = max(sum(p.numel() * 4 for p in shard) for probe in probes for shard in probe.shard_params)
    return 3 * largest_shard + 65536


def token_batches(args) -> list[dict]:
    """`args.steps` batches of random tokens, the same in every run (seeded)."""
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    return data


def configs(args):
    return [(width, lr) for width in args.widths for lr in args.lrs]


def make_models(args):
    models = []
    for i, (width, _) in enumerate(configs(args)):
        torch.manual_seed(i)
        config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=width, n_layer=args.layers,
                            n_head=4, bos_token_id=0, eos_token_id=0)
        models.append(GPT2LMHeadModel(config))
    return models


def plain_seconds(args, data):
    start = time.perf_counter()
    for model, (_, lr) in zip(make_models(args), configs(args)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for batch in data:
            optimizer.zero_grad()
            model(**batch).loss.backward()
            optimizer.step()
    return time.perf_counter() - start


def hydra_seconds(args, data, devices, budget):
    models = make_models(args)
    tasks = [ht.ModelTask(m, data=data, optimizer=ht.optim.AdamW(lr=lr), name=f"w{w}-lr{lr:g}")
             for m, (w, lr) in zip(models, configs(args))]
    start = time.perf_counter()
    results = ht.train(tasks, devices=devices, memory_budget=budget, progress=False)
    seconds = time.perf_counter() - start
    assert all(r.error is None for r in results)
    return seconds, results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_args(parser)
    add_workload_args(parser, steps=20)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()

    data = token_batches(args)
    spilled = spilled_budget(args, data)
    resident_budget = "4GiB"
    modes = {
        "plain, one after another": lambda: (plain_seconds(args, data), None),
        "hydra 1 device, spilled": lambda: hydra_seconds(args, data, ["cpu"], spilled),
        "hydra 2 virtual devices, spilled": lambda: hydra_seconds(args, data, ["cpu", "cpu"], spilled),
        "hydra 1 device, resident": lambda: hydra_seconds(args, data, ["cpu"], resident_budget),
        "hydra 2 virtual devices, resident": lambda: hydra_seconds(args, data, ["cpu", "cpu"], resident_budget),
    }
    times = {mode: [] for mode in modes}
    utilisation = {}
    for _ in range(args.rounds):
        for mode, run in modes.items():
            seconds, results = run()
            times[mode].append(seconds)
            if results is not None:
                utilisation[mode] = results.utilisation()
    tokens = len(configs(args)) * args.steps * args.batch * args.seq
    base = statistics.median(times["plain, one after another"])
    params = [sum(p.numel() for p in m.parameters()) for m in make_models(args)]
    print(f"{len(params)} GPT-2 configurations of {min(params) / 1e6:.2f}-{max(params) / 1e6:.2f}M params, "
          f"{args.steps} steps of {args.batch}x{args.seq} "
          f"tokens each; spilled budget {spilled} bytes per device; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| mode | median s | tokens/s | speed-up vs plain | device busy |")
    print("|---|---|---|---|---|")
    for mode, values in times.items():
        median = statistics.median(values)
        busy = ", ".join(f"{100 * u:.0f}%" for u in utilisation.get(mode, {}).values()) or "-"
        print(f"| {mode} | {median:.2f} | {tokens / median:.0f} | {base / median:.2f}x | {busy} |")


if __name__ == "__main__":
    main()
