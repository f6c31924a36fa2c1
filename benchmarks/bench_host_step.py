"""The host's share of a spilled model's training: seconds in host jobs (gradient accumulation and optimizer
steps) and in copying gradients out (the engine's own timers in results.stats), and host bytes per parameter.

    python benchmarks/bench_host_step.py        # GPT-2-shaped, 29M params, 6 steps on one CPU device, 3 runs
"""
import statistics

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht


def run_once():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_embd=512, n_layer=8, n_head=8, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 8192, (4, 64))
    task = ht.ModelTask(model, data=[{"input_ids": ids, "labels": ids}] * 6, optimizer=ht.optim.AdamW(lr=1e-4))
    results = ht.train([task], devices="cpu", memory_budget="60MB", progress=False)  # spilled: ~1/4 of the weights
    stats = results.stats[0]
    params = sum(p.numel() for p in model.parameters())
    return stats["host_step_seconds"], stats["grad_copy_seconds"], results.wall_time, results[0].host_bytes / params


def main():
    runs = [run_once() for _ in range(3)]
    step, copy, wall, per_param = (statistics.median(r[i] for r in runs) for i in range(4))
    print(f"host jobs (accumulation + steps) {step:.3f} s, gradient copies {copy:.3f} s, wall {wall:.2f} s "
          f"(medians of 3 runs of 6 steps)")
    print(f"host state {per_param:.2f} bytes/param (fp32 AdamW; the tied embedding's owner keeps an accumulator)")


if __name__ == "__main__":
    main()
