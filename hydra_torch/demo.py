"""Model selection with hydra-torch: several GPT-2 configurations trained at once, the best one named.

    python -m hydra_torch.demo                      # small defaults: a few minutes on 2 CPU cores
    python -m hydra_torch.demo --width 1600 --layers 48 --heads 25 --seq 1024 --batch 8 \\
        --steps 200 --budget 16GiB --precision bf16   # GPT-2 XL-shaped models on a GPU

Text is the Python standard library's sources, tokenized by a byte-level BPE tokenizer trained here, so the
demo needs no download. --pretrained starts every configuration from Hugging Face's "gpt2" weights instead
(needs the hub or its cache).
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

import hydra_torch as ht
from hydra_torch.corpus import lm_batches, local_text, train_tokenizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train several GPT-2 configurations at once and report the best.")
    p.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3], help="learning rates to compare")
    p.add_argument("--widths", type=int, nargs="+", default=[96, 128], help="embedding widths to compare")
    p.add_argument("--width", type=int, help="one width (overrides --widths)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per batch")
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per configuration")
    p.add_argument("--vocab", type=int, default=2048, help="tokenizer vocabulary size")
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--budget", default=None,
                   help="device memory budget, e.g. 8GiB or 80%% (default: three times the largest shard's "
                        "weights, so the models spill and visit the device shard by shard)")
    p.add_argument("--devices", default=None,
                   help="comma-separated devices (default: the GPU, else as many virtual CPU devices as cores, up to 2)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--schedule", default="lrtf", choices=["lrtf", "fifo", "round_robin", "random"])
    p.add_argument("--pretrained", action="store_true", help="start from Hugging Face 'gpt2' weights (needs the hub)")
    p.add_argument("--chart", default="hydra_schedule.png", help="where to save the schedule chart")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def default_devices():
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    import os

    return ["cpu"] * max(1, min(2, os.cpu_count() or 1))


def make_model(width, args, vocab_size, seed):
    from transformers import GPT2Config, GPT2LMHeadModel

    if args.pretrained:
        try:
            return causal_lm_loss_named(GPT2LMHeadModel.from_pretrained("gpt2"))
        except OSError as error:
            raise SystemExit(f"--pretrained needs the Hugging Face hub or its cache, which is not reachable: {error}")
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab_size, n_positions=args.seq, n_embd=width, n_layer=args.layers,
                        n_head=args.heads, bos_token_id=0, eos_token_id=0)
    return causal_lm_loss_named(GPT2LMHeadModel(config))


def causal_lm_loss_named(model):
    """transformers finds a model's loss from its class name; GPT2LMHeadModel's says nothing, so it warns
    (`loss_type=None` ... unrecognized) and falls back to the causal-LM loss. Name that loss instead."""
    model.loss_type = "ForCausalLM"
    return model


@torch.no_grad()
def validation_loss(model, batches):
    model.eval()
    losses = [model(**b).loss.item() for b in batches]
    model.train()
    return sum(losses) / len(losses)


def prepare_data(args):
    """(training batches, validation batches, vocabulary size): text split 95/5, a tokenizer trained on the
    training part (or GPT-2's with --pretrained), and random windows of each."""
    text = local_text(args.corpus_bytes)
    split = int(0.95 * len(text))
    if args.pretrained:
        from transformers import GPT2TokenizerFast

        try:
            tokenizer = GPT2TokenizerFast.from_pretrained("gpt2")
        except OSError as error:
            raise SystemExit(f"--pretrained needs the Hugging Face hub or its cache, which is not reachable: {error}")
        encode, vocab_size = (lambda t: tokenizer(t)["input_ids"]), tokenizer.vocab_size
    else:
        tokenizer = train_tokenizer(text[:split], args.vocab)
        encode, vocab_size = (lambda t: tokenizer.encode(t).ids), tokenizer.get_vocab_size()
    train_ids = torch.tensor(encode(text[:split]), dtype=torch.long)
    valid_ids = torch.tensor(encode(text[split:]), dtype=torch.long)
    g = torch.Generator().manual_seed(args.seed)
    train_data = lm_batches(train_ids, args.batch, args.seq, args.steps, g)
    valid_data = lm_batches(valid_ids, args.batch, args.seq, 8, g)
    return train_data, valid_data, vocab_size


def main(argv=None):
    args = parse_args(argv)
    widths = [args.width] if args.width else args.widths
    started = time.perf_counter()
    print("preparing text and tokenizer ...", flush=True)
    train_data, valid_data, vocab_size = prepare_data(args)

    configs = [(w, lr) for w in widths for lr in args.lrs]
    models, tasks = [], []
    for i, (width, lr) in enumerate(configs):
        model = make_model(width, args, vocab_size, seed=args.seed + i)
        models.append(model)
        tasks.append(ht.ModelTask(model, data=train_data, optimizer=ht.optim.AdamW(lr=lr), name=f"w{width}-lr{lr:g}",
                                  precision=args.precision))
    params = [sum(p.numel() for p in m.parameters()) for m in models]
    # Default: room for the largest shard's weights and gradients plus one prefetch, well below any whole
    # model, so every model spills and the engine streams shards.
    largest_shard = max(sum(p.numel() * 4 for p in shard) for task in tasks for shard in task.shard_params)
    budget = args.budget or 3 * largest_shard + 65536
    devices = args.devices.split(",") if args.devices else default_devices()
    print(f"{len(tasks)} configurations, {min(params) / 1e6:.1f}-{max(params) / 1e6:.1f}M parameters, "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens, devices {devices}, budget {budget} per device",
          flush=True)

    results = ht.train(tasks, devices=devices, memory_budget=budget, schedule=args.schedule,
                       progress=not args.no_progress, seed=args.seed)

    tokens = args.batch * args.seq
    # A configuration's tokens/s is its tokens over the time its own units ran: what it trained at while
    # it had a device. The configurations share the devices, so the aggregate is printed below, apart.
    print(f"\n{'config':<16} {'params':>8} {'train loss':>10} {'valid loss':>10} {'tokens/s':>9}")
    for model, result, n in zip(models, results, params):
        if result.error is not None:
            print(f"{result.name:<16} {n / 1e6:>7.2f}M  failed: {result.error}")
            continue
        valid = validation_loss(model, valid_data)
        result.valid_loss = valid
        speed = result.steps * tokens / result.busy_time if result.busy_time > 0 else float("nan")
        print(f"{result.name:<16} {n / 1e6:>7.2f}M {result.final_loss:>10.4f} {valid:>10.4f} {speed:>9.0f}")
    finished = [r for r in results if r.error is None]
    if not finished:
        print("every configuration failed")
        return 1
    best = min(finished, key=lambda r: r.valid_loss)
    total = sum(r.steps for r in finished) * tokens
    print(f"\nbest configuration: {best.name} (validation loss {best.valid_loss:.4f}, "
          f"perplexity {math.exp(best.valid_loss):.1f})")
    utilisation = ", ".join(f"{d} {100 * u:.0f}%" for d, u in results.utilisation().items())
    print(f"all configurations: {total / results.wall_time:.0f} tokens/s over {results.wall_time:.1f} s; "
          f"devices busy: {utilisation}")
    if args.chart:
        results.plot_schedule(args.chart)
        print(f"schedule chart: {args.chart}")
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
