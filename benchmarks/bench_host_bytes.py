"""Host bytes per parameter of hydra's training state (TaskResult.host_bytes: fp32 master, optimizer states,
bf16 shadow, and whatever gradient a step keeps on the host), for GPT-2 small's shape (124M parameters, the
LM head tied to the token embedding, 31% of them) and for the same model untied, spilled on one CPU device,
AdamW, one step; fp32 and bf16, without and with clipping, one micro-batch and two.

    python benchmarks/bench_host_bytes.py
"""
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht

RECIPES = {"no clipping": {}, "clip_grad_norm=1.0": {"clip_grad_norm": 1.0}, "accumulate=2": {"accumulate": 2}}


def per_param(precision: str, recipe: dict, tied: bool) -> float:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, model.config.vocab_size, (1, 64))
    task = ht.ModelTask(model, data=[{"input_ids": ids, "labels": ids}] * recipe.get("accumulate", 1),
                        precision=precision, **recipe)
    result = ht.train([task], devices="cpu", memory_budget="400MB", progress=False)[0]  # spilled
    assert result.error is None and not result.resident, (result.error, result.resident)
    return result.host_bytes / sum(p.numel() for p in set(model.parameters()))


def main():
    print("| model | precision | " + " | ".join(RECIPES) + " |")
    print("|---|---|" + "---|" * len(RECIPES))
    for tied in (True, False):
        for precision in ("fp32", "bf16"):
            row = [f"{per_param(precision, recipe, tied):.2f}" for recipe in RECIPES.values()]
            print(f"| GPT-2 small, {'tied' if tied else 'untied'} | {precision} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
