"""Successive halving against training every configuration to the end: 16 GPT-2 configurations (4 widths x 4
learning rates) on the demo's data (standard-library text, its own BPE tokenizer), each evaluated on the
demo's validation batches.

- full: one ht.train call, every configuration trained for --steps steps, evaluated after the last; the best
  is the lowest validation loss.
- halving: the same call with selection=ht.SuccessiveHalving(min_steps, reduction_factor), which evaluates at
  every rung and stops the worse configurations there; the best is the lowest final validation loss among
  the configurations that ran to the end.

Reports each run's wall time (the time until the best configuration is known), their ratio, both winners,
and the halving winner's validation loss against the full run's best. Rounds alternate the two runs.

    python benchmarks/bench_successive_halving.py [--steps 240 --min-steps 20 --reduction-factor 4 --rounds 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import hydra_torch as ht
from hydra_torch.demo import job as demo


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 96, 128, 160])
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-4, 1e-3, 3e-3, 1e-2])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--min-steps", type=int, default=20)
    parser.add_argument("--reduction-factor", type=int, default=4)
    parser.add_argument("--devices", default=None, help="comma-separated (default: the demo's)")
    parser.add_argument("--rounds", type=int, default=1)
    return parser.parse_args()


def make_tasks(args, demo_args, train_data, valid_data, vocab_size):
    tasks = []
    for i, (width, lr) in enumerate((w, lr) for w in args.widths for lr in args.lrs):
        model = demo.make_model(width, demo_args, vocab_size, seed=i)
        tasks.append(ht.ModelTask(model, data=train_data, eval_data=valid_data, optimizer=ht.optim.AdamW(lr=lr),
                                  name=f"w{width}-lr{lr:g}"))
    return tasks


def run(args, demo_args, data, selection):
    tasks = make_tasks(args, demo_args, *data)
    largest_shard = max(sum(p.numel() * 4 for p in shard) for task in tasks for shard in task.shard_params)
    devices = args.devices.split(",") if args.devices else demo.default_devices()
    start = time.perf_counter()
    results = ht.train(tasks, devices=devices, memory_budget=3 * largest_shard + 65536, progress=False,
                       selection=selection)
    seconds = time.perf_counter() - start
    assert all(r.error is None for r in results), [r.error for r in results if r.error]
    return seconds, results


def main():
    args = parse_args()
    demo_args = demo.parse_args(["--layers", str(args.layers), "--steps", str(args.steps)])
    print("preparing the demo's text and tokenizer ...", flush=True)
    data = demo.prepare_data(demo_args)
    rule = ht.SuccessiveHalving(args.min_steps, args.reduction_factor)
    full_times, halving_times = [], []
    for round_ in range(args.rounds):
        full_seconds, full = run(args, demo_args, data, None)
        halving_seconds, halving = run(args, demo_args, data, rule)
        full_times.append(full_seconds)
        halving_times.append(halving_seconds)
        full_best, halving_best = full.best, halving.best
        stopped = sorted(r.steps for r in halving if r.stopped)
        print(f"round {round_ + 1}: full {full_seconds:.1f} s, best {full_best.name} "
              f"(validation loss {full_best.final_eval_loss:.4f}); halving {halving_seconds:.1f} s, best "
              f"{halving_best.name} (validation loss {halving_best.final_eval_loss:.4f}; in the full run "
              f"{full[halving_best.name].final_eval_loss:.4f}); {len(stopped)} stopped at steps {stopped}; "
              f"steps trained {sum(r.steps for r in halving)} of {sum(r.steps for r in full)}", flush=True)
        for r in sorted(full, key=lambda r: r.final_eval_loss):
            h = halving[r.name]
            print(f"  {r.name:<14} full {r.final_eval_loss:.4f}   halving {h.final_eval_loss:.4f} after {h.steps} "
                  f"steps{'  (stopped)' if h.stopped else ''}")
    full_median, halving_median = statistics.median(full_times), statistics.median(halving_times)
    print(f"median over {args.rounds} round(s): full {full_median:.1f} s, halving {halving_median:.1f} s, "
          f"{full_median / halving_median:.2f}x faster to the best configuration")


if __name__ == "__main__":
    main()
