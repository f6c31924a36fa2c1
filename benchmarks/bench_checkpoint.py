"""What checkpoints cost: bench_multi_model's workload (the demo's four GPT-2 configurations), one ht.train
call without checkpoints and one with a checkpoint of every task every `--every` steps, alternating, on one
device spilled and resident. Reports, per checkpoint (medians): the extra wall seconds, the seconds the
training thread spent on it (waiting for the task's host steps, copying its state) and the seconds the
background writer spent; and what the training thread's part is as a share of training at one checkpoint per
task every 10 minutes (the default). The last checkpoint of each task is written as the run ends, and the run
waits for it: the extra wall time includes that write.

    python benchmarks/bench_checkpoint.py [--every 5 --rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from transformers.utils import logging as hf_logging

import hydra_torch as ht
from hydra_torch.run import workers
from hydra_torch.state import checkpoint
from hydra_torch.state.checkpoint_writer import Checkpointer

from bench_multi_model import add_config_args, add_workload_args, configs, make_models, spilled_budget, token_batches

TEN_MINUTES = 600.0


def _timed(module, name, totals: list):
    """Replaces module.name by a wrapper adding its seconds to totals[0] and its calls to totals[1]; returns
    the original."""
    real = getattr(module, name)

    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            totals[0] += time.perf_counter() - start
            totals[1] += 1
    setattr(module, name, wrapper)
    return real


def run(args, data, budget, checkpoint_dir) -> tuple[float, int, float, float]:
    """Seconds of one ht.train call, the checkpoints it wrote, the training thread's seconds per checkpoint
    taken while training (the last ones, as the run ends, are not copied) and the writer's seconds."""
    tasks = [ht.ModelTask(m, data=data, optimizer=ht.optim.AdamW(lr=lr), name=f"w{w}-lr{lr:g}")
             for m, (w, lr) in zip(make_models(args), configs(args))]
    options = {} if checkpoint_dir is None else {"checkpoint_dir": checkpoint_dir, "checkpoint_every": args.every}
    on_thread, writing, periodic = [0.0, 0], [0.0, 0], [0]
    real_write = _timed(checkpoint, "write", writing)
    real_due = _timed(workers, "_checkpoint_if_due", on_thread)
    real_submit = Checkpointer.submit

    def submit(self, runner, final=False, **k):
        periodic[0] += not final
        return real_submit(self, runner, final, **k)
    Checkpointer.submit = submit
    try:
        start = time.perf_counter()
        results = ht.train(tasks, devices=["cpu"], memory_budget=budget, progress=False, **options)
        seconds = time.perf_counter() - start
    finally:
        checkpoint.write, workers._checkpoint_if_due = real_write, real_due
        Checkpointer.submit = real_submit
    assert all(r.error is None for r in results)
    return seconds, writing[1], on_thread[0] / max(1, periodic[0]), writing[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_config_args(parser)
    add_workload_args(parser, steps=20)
    parser.add_argument("--every", type=int, default=5, help="steps between a task's checkpoints")
    args = parser.parse_args()
    hf_logging.set_verbosity_error()

    data = token_batches(args)
    modes = {"1 device, spilled": spilled_budget(args, data), "1 device, resident": "4GiB"}
    print(f"{len(configs(args))} tasks, {args.steps} steps each, a checkpoint every {args.every} steps")
    print("| mode | without (median s) | with (median s) | checkpoints per run | extra wall s per checkpoint | "
          "training thread s per checkpoint | writer s per checkpoint | training thread's share at one per task "
          "per 10 min |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, budget in modes.items():
        without, with_, extra, thread, writer = [], [], [], [], []
        for round_ in range(args.rounds):
            for keep in ((False, True) if round_ % 2 == 0 else (True, False)):
                with tempfile.TemporaryDirectory() as directory:
                    seconds, written, on_thread, writing = run(args, data, budget, directory if keep else None)
                (with_ if keep else without).append(seconds)
                if keep:
                    count = written
                    thread.append(on_thread)
                    writer.append(writing / written)
        for a, b in zip(without, with_):
            extra.append((b - a) / count)
        on_thread = statistics.median(thread)
        share = len(configs(args)) * on_thread / TEN_MINUTES
        print(f"| {mode} | {statistics.median(without):.2f} | {statistics.median(with_):.2f} | {count} | "
              f"{statistics.median(extra):.3f} | {on_thread:.3f} | {statistics.median(writer):.3f} | "
              f"{100 * share:.3f}% |")


if __name__ == "__main__":
    main()
