"""Host bytes per frozen and per trainable parameter, and gradient bytes copied back per step, for a peft LoRA
model against the same model fine-tuned in full: GPT-2 small's shape (124M parameters, random weights), LoRA on
c_attn, spilled on one CPU device, AdamW, two steps; fp32 and bf16, one micro-batch and two.

Bytes per trainable parameter come from two ranks (their host bytes' difference over their adapters' size);
bytes per frozen parameter are what is left over the frozen ones.

    python benchmarks/bench_lora_bytes.py
"""
import peft
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht

RANKS = (8, 32)


def run(precision: str, accumulate: int, rank: int | None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, bos_token_id=0, eos_token_id=0))
    if rank is not None:
        model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["c_attn"],
                                                           fan_in_fan_out=True))
    ids = torch.randint(0, 50257, (1, 64))
    task = ht.ModelTask(model, data=[{"input_ids": ids, "labels": ids}] * (2 * accumulate), precision=precision,
                        accumulate=accumulate)
    results = ht.train([task], devices="cpu", memory_budget="400MB", progress=False)
    result = results[0]
    assert result.error is None and not result.resident, (result.error, result.resident)
    trainable = sum(p.numel() for p in set(model.parameters()) if p.requires_grad)
    frozen = sum(p.numel() for p in set(model.parameters()) if not p.requires_grad)
    return result.host_bytes, trainable, frozen, results.stats[0]["device_to_host_bytes"] / result.steps


def main():
    print("| precision | micro-batches | full: bytes/param | LoRA: bytes/trainable | LoRA: bytes/frozen | "
          "LoRA host / full host | gradient bytes back per step, LoRA / full |")
    print("|---|---|---|---|---|---|---|")
    for precision in ("fp32", "bf16"):
        for accumulate in (1, 2):
            full_host, full_params, _, full_back = run(precision, accumulate, None)
            (host_a, train_a, frozen, _), (host_b, train_b, _, back) = (run(precision, accumulate, r) for r in RANKS)
            per_trainable = (host_b - host_a) / (train_b - train_a)
            per_frozen = (host_b - per_trainable * train_b) / frozen
            print(f"| {precision} | {accumulate} | {full_host / full_params:.2f} | {per_trainable:.2f} | "
                  f"{per_frozen:.2f} | {host_b / full_host:.3f} | {back / full_back:.4f} |")
    print(f"(LoRA rank {RANKS[1]} on c_attn: {train_b / 1e6:.2f}M trainable, {frozen / 1e6:.1f}M frozen)")


if __name__ == "__main__":
    main()
