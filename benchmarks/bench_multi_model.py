"""Several GPT-2 configurations on the CPU, side by side: plain PyTorch one model after another, versus
one ht.train call on one device and on two virtual CPU devices (one thread each), spilled and resident.

Reports aggregate tokens/s (median over rounds, interleaved) and ratios to the plain sequential loop.

    python benchmarks/bench_multi_model.py [--models 4 --width 128 --layers 4 --seq 64 --batch 8 --steps 20]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import hydra_torch as ht


def make_models(args):
    models = []
    for i in range(args.models):
        torch.manual_seed(i)
        config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                            n_head=4, bos_token_id=0, eos_token_id=0)
        models.append(GPT2LMHeadModel(config))
    return models


def plain_seconds(args, data):
    start = time.perf_counter()
    for i, model in enumerate(make_models(args)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3 * (i + 1))
        for batch in data:
            optimizer.zero_grad()
            model(**batch).loss.backward()
            optimizer.step()
    return time.perf_counter() - start


def hydra_seconds(args, data, devices, budget):
    models = make_models(args)
    tasks = [ht.ModelTask(m, data=data, optimizer=ht.optim.AdamW(lr=1e-3 * (i + 1)), name=f"m{i}")
             for i, m in enumerate(models)]
    start = time.perf_counter()
    results = ht.train(tasks, devices=devices, memory_budget=budget, progress=False)
    seconds = time.perf_counter() - start
    assert all(r.error is None for r in results)
    return seconds, results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()

    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    probe = ht.ModelTask(make_models(args)[0], data=data)
    largest_shard = max(sum(p.numel() * 4 for p in shard) for shard in probe.shard_params)
    spilled_budget = 3 * largest_shard + 65536
    resident_budget = "4GiB"
    modes = {
        "plain, one after another": lambda: (plain_seconds(args, data), None),
        "hydra 1 device, spilled": lambda: hydra_seconds(args, data, ["cpu"], spilled_budget),
        "hydra 2 virtual devices, spilled": lambda: hydra_seconds(args, data, ["cpu", "cpu"], spilled_budget),
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
    tokens = args.models * args.steps * args.batch * args.seq
    base = statistics.median(times["plain, one after another"])
    params = sum(p.numel() for p in make_models(args)[0].parameters())
    print(f"{args.models} GPT-2 models of {params / 1e6:.2f}M params, {args.steps} steps of {args.batch}x{args.seq} "
          f"tokens each; spilled budget {spilled_budget} bytes per device; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print("| mode | median s | tokens/s | speed-up vs plain | device busy |")
    print("|---|---|---|---|---|")
    for mode, values in times.items():
        median = statistics.median(values)
        busy = ", ".join(f"{100 * u:.0f}%" for u in utilisation.get(mode, {}).values()) or "-"
        print(f"| {mode} | {median:.2f} | {tokens / median:.0f} | {base / median:.2f}x | {busy} |")


if __name__ == "__main__":
    main()
