"""What global-norm clipping costs spilled GPT-2 small models (124M parameters, tied head) trained together on one
CPU device, AdamW, clip_grad_norm=1.0, batches of 1x64 tokens.

A clipped step's norm needs every gradient of the step landed and summed. `clip_and_step` queues the sum and
every shard's step behind the model's gradient jobs and returns; the task's next unit reads the norm first
(TaskRunner.settle_step), and meanwhile the device runs other models' units. "waited" runs the same training
with the norm read as soon as it is queued, as when `clip_and_step` waited for the gradients itself.
Rounds interleave the two; per run: wall time, and the seconds the device's thread spent in `clip_and_step` and
reading norms.

    python benchmarks/bench_clip_norm.py [--models 2] [--steps 3] [--rounds 3] [--precision bf16]
"""
import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht
from hydra_torch import _C
from hydra_torch.run.runner import TaskRunner


def run(models: int, steps: int, precision: str, wait_at_once: bool) -> tuple[float, float]:
    tasks = []
    for m in range(models):
        torch.manual_seed(m)
        model = GPT2LMHeadModel(GPT2Config(n_positions=64, bos_token_id=0, eos_token_id=0))
        ids = torch.randint(0, model.config.vocab_size, (steps, 1, 64))
        data = [{"input_ids": i, "labels": i} for i in ids]
        tasks.append(ht.ModelTask(model, data=data, precision=precision, clip_grad_norm=1.0, name=f"gpt2-{m}"))
    spent = []
    real_clip, real_settle = _C.DeviceEngine.clip_and_step, TaskRunner.settle_step

    def clip(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            norm = real_clip(self, *args, **kwargs)
            if wait_at_once:
                norm.value()
            return norm
        finally:
            spent.append(time.perf_counter() - start)

    def settle(self):
        start = time.perf_counter()
        try:
            return real_settle(self)
        finally:
            spent.append(time.perf_counter() - start)

    _C.DeviceEngine.clip_and_step, TaskRunner.settle_step = clip, settle
    try:
        start = time.perf_counter()
        results = ht.train(tasks, devices="cpu", memory_budget=f"{300 * models}MB", progress=False)
        wall = time.perf_counter() - start
    finally:
        _C.DeviceEngine.clip_and_step, TaskRunner.settle_step = real_clip, real_settle
    for r in results:
        assert r.error is None and not r.resident and r.steps == steps, (r.error, r.resident, r.steps)
    return wall, sum(spent)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = parser.parse_args()
    measured = {True: [], False: []}
    for r in range(args.rounds):
        for wait_at_once in ((True, False) if r % 2 == 0 else (False, True)):
            wall, waited = run(args.models, args.steps, args.precision, wait_at_once)
            measured[wait_at_once].append((wall, waited))
            print(f"round {r}, {'waited' if wait_at_once else 'queued'}: {wall:.2f} s, "
                  f"thread in clipping {waited:.2f} s", flush=True)
    print(f"\n{args.models} x GPT-2 small, {args.precision}, {args.steps} steps each, "
          f"torch threads {torch.get_num_threads()}; medians of {args.rounds} rounds\n")
    print("| norm | wall s | device thread in clip_and_step + reading norms, s |")
    print("|---|---|---|")
    for wait_at_once, label in ((True, "waited for at once"), (False, "queued, read at the task's next unit")):
        walls, waits = zip(*measured[wait_at_once])
        print(f"| {label} | {statistics.median(walls):.2f} | {statistics.median(waits):.2f} |")
    ratio = statistics.median(w for w, _ in measured[False]) / statistics.median(w for w, _ in measured[True])
    print(f"\nwall time, queued / waited: {ratio:.3f}")


if __name__ == "__main__":
    main()
