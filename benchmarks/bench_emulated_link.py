"""How well copies hide behind compute, measured on CPU through an emulated host link.

K spilled GPT-2 models train in one ht.train call on one CPU device whose copies (weights in, gradients out)
take bytes / bandwidth seconds, as over PCIe (`hydra_torch.testing.emulated_link`). Side by side, rounds
interleaved, medians:

- memory speed: no emulated link, copies are memcpy (the floor: what perfect hiding would give);
- link, next shard: the link, prefetching the next planned shard (ht.train's default);
- link, as far as the budget allows: the link, prefetching along the plan into all free memory.

A ratio to memory speed of 1.0 means every copy was hidden. "link busy" is the share of the wall time each
direction of the link was copying (the engine's lane timers), so the regime is on record; "misses" the share
of weight copies no prefetch had issued before the shard was needed, "acquire waits" the share of the wall
time the compute thread waited for a shard to be ready.

    python benchmarks/bench_emulated_link.py [--bandwidth 2e8 --cache 0.5 --models 4 --steps 8 --rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import hydra_torch as ht
from bench_multi_model import add_workload_args, token_batches
from hydra_torch import testing
from hydra_torch.run import measuring, workers


def make_tasks(args, data):
    tasks = []
    for i in range(args.models):
        torch.manual_seed(i)
        config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                            n_head=4, bos_token_id=0, eos_token_id=0)
        # One shard a piece (the embeddings, each block, the tied head), or the last `head_blocks` blocks with the head.
        head_blocks = getattr(args, "head_blocks", 0)
        shards = list(range(args.layers + 2 - head_blocks)) if head_blocks else args.layers + 2
        tasks.append(ht.ModelTask(GPT2LMHeadModel(config), data=data, optimizer=ht.optim.AdamW(lr=1e-3),
                                  shards=shards, name=f"m{i}", clip_grad_norm=getattr(args, "clip", None),
                                  precision=getattr(args, "precision", None)))
    return tasks


def parse_workload(parser, steps: int = 8):
    """Adds the shared workload arguments (and --models, --width), parses them, and returns the arguments,
    the batches and each shard's fp32 weight bytes of one such model."""
    parser.add_argument("--width", type=int, default=256)
    add_workload_args(parser, steps=steps)
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    data = token_batches(args)
    probe = make_tasks(args, data)[0]
    return args, data, [sum(p.numel() * 4 for p in shard) for shard in probe.shard_params]


def add_lane_args(parser, host_speed: float = 0.5):
    """The emulated link's bandwidth and the emulated host's speed, for a benchmark of placements."""
    parser.add_argument("--bandwidth", type=float, default=2e8, help="emulated link, bytes/s each way")
    parser.add_argument("--host-speed", type=float, default=host_speed,
                        help="the host's memory over the link's bandwidth")


def placement_rounds(args, placements, train_once):
    """`args.rounds` interleaved rounds of train_once(placement) -> (span, each task's placement, device steps):
    each placement's spans, and the placements and device steps of its first run."""
    spans = {placement: [] for placement in placements}
    placed, device_steps = {}, {}
    for _ in range(args.rounds):
        for placement in placements:
            span, got, steps = train_once(placement)
            spans[placement].append(span)
            placed.setdefault(placement, got)
            device_steps.setdefault(placement, steps)
    return spans, placed, device_steps


def print_placement_spans(spans, placed, device_steps, against: str):
    """Each placement's tasks and device steps, then a table of median spans and, round by round, against the
    placement `against` (nan where it did not run)."""
    for placement in spans:
        print(f"placement {placement!r} ({device_steps[placement]} device steps): " + "; ".join(placed[placement]))
    print(f"| placement | span s | span / {against}'s |")
    print("|---|---|---|")
    reference = spans.get(against)
    for placement, measured in spans.items():
        versus = statistics.median(s / r for s, r in zip(measured, reference)) if reference else float("nan")
        print(f"| {placement} | {statistics.median(measured):.2f} | {versus:.2f} |")


def run(args, data, budget, link, prefetch_bytes):
    tasks = make_tasks(args, data)
    beyond = workers.PREFETCH_BEYOND_NEXT_BYTES if prefetch_bytes is None else prefetch_bytes
    with mock.patch.object(workers, "PREFETCH_BEYOND_NEXT_BYTES", beyond):
        start = time.perf_counter()
        if link:
            with testing.emulated_link(args.bandwidth):
                results = ht.train(tasks, devices="cpu", memory_budget=budget + measuring.kept_beside_arena(tasks),
                                   progress=False)
        else:
            results = ht.train(tasks, devices="cpu", memory_budget=budget, progress=False)
        seconds = time.perf_counter() - start
    assert all(r.error is None and not r.resident for r in results), [r.error for r in results]
    stats = results.stats[0]
    return (seconds, stats["weight_copy_seconds"] / seconds, stats["grad_copy_seconds"] / seconds,
            stats["acquire_loads"] / stats["host_to_device_copies"], stats["acquire_wait_seconds"] / seconds)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", type=float, default=2e8, help="emulated link, bytes/s per direction")
    parser.add_argument("--models", type=int, default=4)
    parser.add_argument("--cache", type=float, default=0.5,
                        help="room in the budget beyond the working set, in models' weights")
    args, data, shard_bytes = parse_workload(parser)
    # The working set (a shard's weights and gradients) plus room to cache and prefetch into.
    budget = 2 * max(shard_bytes) + int(args.cache * sum(shard_bytes)) + 65536
    modes = {"memory speed": (False, None), "link, next shard": (True, None),
             "link, as far as the budget allows": (True, -1)}
    measured = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, (link, depth) in modes.items():
            measured[mode].append(run(args, data, budget, link, depth))
    tokens = args.models * args.steps * args.batch * args.seq
    base = statistics.median(m[0] for m in measured["memory speed"])
    print(f"{args.models} GPT-2 models of {sum(shard_bytes) / 4e6:.2f}M params in {len(shard_bytes)} shards, "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens; budget {budget} bytes (cache {args.cache:g} "
          f"models); link "
          f"{args.bandwidth:.3g} bytes/s per direction; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"medians of {args.rounds} interleaved rounds")
    print("| mode | median s | tokens/s | vs memory speed | link busy in / out | misses | acquire waits |")
    print("|---|---|---|---|---|---|---|")
    for mode, runs in measured.items():
        seconds = statistics.median(r[0] for r in runs)
        busy_in = statistics.median(r[1] for r in runs)
        busy_out = statistics.median(r[2] for r in runs)
        misses = statistics.median(r[3] for r in runs)
        waits = statistics.median(r[4] for r in runs)
        print(f"| {mode} | {seconds:.2f} | {tokens / seconds:.0f} | {base / seconds:.2f}x | "
              f"{100 * busy_in:.0f}% / {100 * busy_out:.0f}% | {100 * misses:.0f}% | {100 * waits:.0f}% |")


if __name__ == "__main__":
    main()
