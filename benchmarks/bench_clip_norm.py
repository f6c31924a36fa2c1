"""What global-norm clipping costs a spilled GPT-2 small (124M parameters, tied head) per step on the host:
`clip_and_step` waits for the step's last gradients to land, sums every gradient's squares (kept in bf16 as
they landed, or in the fp32 accumulator) and queues the shards' steps. The device's thread waits meanwhile.
One CPU device, AdamW, batches of 1x64 tokens; median seconds per call and its share of the task's time.

    python benchmarks/bench_clip_norm.py [--steps 4] [--threads 1]
"""
import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht
from hydra_torch import _C


def clip_seconds(precision: str, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, bos_token_id=0, eos_token_id=0))
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, model.config.vocab_size, (steps, 1, 64))]
    task = ht.ModelTask(model, data=data, precision=precision, clip_grad_norm=1.0)
    spent = []
    real = _C.DeviceEngine.clip_and_step

    def timed(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - start)

    _C.DeviceEngine.clip_and_step = timed
    try:
        result = ht.train([task], devices="cpu", memory_budget="400MB", progress=False)[0]  # spilled
    finally:
        _C.DeviceEngine.clip_and_step = real
    assert result.error is None and not result.resident, (result.error, result.resident)
    return statistics.median(spent), sum(spent) / result.wall_time


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| precision | clip_and_step s (median of {args.steps}) | share of the task's time |")
    print("|---|---|---|")
    for precision in ("bf16", "fp32"):
        median, share = clip_seconds(precision, args.steps)
        print(f"| {precision} | {median:.3f} | {share:.0%} |")


if __name__ == "__main__":
    main()
