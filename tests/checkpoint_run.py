"""One training run of test_checkpoint.py's, in a process of its own so it can be killed part-way.

    python checkpoint_run.py CHECKPOINT_DIR OUT [--signal KILL|TERM --at N] [--resident] [--clip]

Trains two dropout models with shuffled loaders on two virtual CPU devices, a checkpoint every 2 steps; with
--signal, sends it to itself at the N-th loss of the first model; saves weights and losses to OUT. Spilled, or
with --resident each model resident on one of the devices; --clip clips the first model's gradients.
"""
import argparse
import os
import signal
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(__file__))
import hydra_torch as ht  # noqa: E402
from models import lm_loss, model_bytes, tied_transformer, token_batches  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir")
    parser.add_argument("out")
    parser.add_argument("--signal", choices=["KILL", "TERM"])
    parser.add_argument("--at", type=int, default=0)
    parser.add_argument("--resident", action="store_true")
    parser.add_argument("--clip", action="store_true")
    args = parser.parse_args()
    calls = [0]

    def loss_fn(out, batch):
        calls[0] += 1
        if args.signal and calls[0] == args.at:
            os.kill(os.getpid(), getattr(signal, f"SIG{args.signal}"))
        return lm_loss(out, batch)

    tasks, models = [], []
    for i in range(2):
        model = tied_transformer(seed=i, dropout=0.2)
        samples = [(x[0], y[0]) for x, y in token_batches(20, batch=1, seed=i + 1)]
        tasks.append(ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=3e-3, weight_decay=0.1), epochs=2,
                                  loss_fn=loss_fn if i == 0 else lm_loss, name=f"model {i}",
                                  clip_grad_norm=0.5 if args.clip and i == 0 else None,
                                  data=DataLoader(samples, batch_size=4, shuffle=True)))
        models.append(model)
    torch.manual_seed(5)
    budget = int((50 if args.resident else 0.45) * model_bytes(models[0]))
    results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, progress=False,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=2)
    assert all(r.resident == args.resident for r in results)
    torch.save({"weights": [m.state_dict() for m in models], "losses": [r.losses for r in results],
                "units": len(results.trace)}, args.out)


if __name__ == "__main__":
    main()
