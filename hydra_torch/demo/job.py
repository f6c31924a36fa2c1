"""Model selection with hydra-torch: several GPT-2 configurations trained at once, the best one named.

    python -m hydra_torch.demo                      # small defaults: a few minutes on 2 CPU cores
    python -m hydra_torch.demo --arch qwen3         # the same with another family (llama, mistral, gemma2, ...)
    python -m hydra_torch.demo --arch llama --lora-ranks 4 16   # LoRA ranks x learning rates on one shared base (peft)
    python -m hydra_torch.demo --halving 20         # stop the worse configurations early (successive halving)
    python -m hydra_torch.demo --search 12          # an Optuna search over width and learning rate instead
    python -m hydra_torch.demo --width 1600 --layers 48 --heads 25 --seq 1024 --batch 8 \\
        --steps 200 --budget 16GiB --precision bf16   # GPT-2 XL-shaped models on a GPU

Text is the Python standard library's sources, tokenized by a byte-level BPE tokenizer trained here, so the
demo needs no download. --pretrained starts every configuration from Hugging Face's "gpt2" weights instead
(needs the hub or its cache).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch

import hydra_torch as ht
from hydra_torch.demo import architectures
from hydra_torch.demo.corpus import lm_batches, local_text, train_tokenizer


def positive(kind):
    """An argparse type: a finite number of `kind` > 0."""
    def parse(text):
        value = kind(text)
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a positive {kind.__name__}, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def chart_path(text):
    """An argparse type: where a chart can be written ("" for none), checked before anything trains: a folder that
    is there and writable, and a format matplotlib writes (a name without a suffix is a PNG)."""
    if not text:
        return text
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"no folder {folder} to write {text} in" if not os.path.isdir(folder) else
                                         f"the folder {folder} is not writable")
    suffix = os.path.splitext(text)[1].lstrip(".").lower()
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise argparse.ArgumentTypeError("the charts need matplotlib: pip install matplotlib, or pass \"\" for "
                                         "no chart") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix and suffix not in formats:
        raise argparse.ArgumentTypeError(f"a chart is written as one of {', '.join(sorted(formats))}, not {suffix}")
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train several GPT-2 configurations at once and report the best.")
    p.add_argument("--arch", default="gpt2", choices=list(architectures.CONFIGS),
                   help="the model family, built from a small config of that family's class (default: gpt2)")
    p.add_argument("--lora-ranks", type=positive(int), nargs="+", metavar="R",
                   help="compare LoRA adapters of these ranks (x --lrs) on one base of --width instead of widths "
                        "(needs peft)")
    p.add_argument("--separate-bases", action="store_true",
                   help="with --lora-ranks: give each configuration its own copy of the base instead of sharing one "
                        "(ht.FrozenBase), to compare")
    p.add_argument("--lrs", type=positive(float), nargs="+", default=[1e-3, 3e-3], help="learning rates to compare")
    p.add_argument("--widths", type=positive(int), nargs="+", default=[96, 128], help="embedding widths to compare")
    p.add_argument("--width", type=positive(int), help="one width (overrides --widths)")
    p.add_argument("--layers", type=positive(int), default=4)
    p.add_argument("--heads", type=positive(int), default=4)
    p.add_argument("--seq", type=positive(int), default=64, help="tokens per sequence")
    p.add_argument("--batch", type=positive(int), default=8, help="sequences per batch")
    p.add_argument("--steps", type=positive(int), default=150, help="optimizer steps per configuration")
    p.add_argument("--vocab", type=positive(int), default=2048, help="tokenizer vocabulary size")
    p.add_argument("--corpus-bytes", type=positive(int), default=2_000_000)
    p.add_argument("--budget", default=None,
                   help="device memory budget, e.g. 8GiB or 80%% (default: three times the largest shard's "
                        "weights, so the models spill and visit the device shard by shard)")
    p.add_argument("--devices", default=None,
                   help="comma-separated devices (default: the GPU, else as many virtual CPU devices as cores, up to 2)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--schedule", default="lrtf", choices=["lrtf", "fifo", "round_robin", "random"])
    p.add_argument("--pretrained", action="store_true", help="start from Hugging Face 'gpt2' weights (needs the hub)")
    p.add_argument("--halving", type=positive(int), metavar="MIN_STEPS",
                   help="successive halving: stop the worse configurations at MIN_STEPS, 3x that, ... steps")
    p.add_argument("--search", type=positive(int), metavar="N",
                   help="an Optuna search of N trials over --widths and a learning-rate range, 4 at a time, pruned by "
                        "a median rule (needs optuna), instead of the --widths x --lrs grid")
    p.add_argument("--chart", type=chart_path, default="hydra_schedule.png",
                   help="where to save the schedule chart (\"\": none)")
    p.add_argument("--curves", type=chart_path, default="hydra_curves.png",
                   help="where to save the loss curves (\"\": none)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    uneven = [w for w in ([args.width] if args.width else args.widths) if w % args.heads]
    if uneven:
        p.error(f"--heads {args.heads} must divide every width, not {', '.join(map(str, uneven))}")
    return args


def default_devices():
    if torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu"] * max(1, min(2, os.cpu_count() or 1))


def make_model(width, args, vocab_size, seed):
    from transformers import GPT2LMHeadModel

    if args.pretrained:
        try:
            return causal_lm_loss_named(GPT2LMHeadModel.from_pretrained("gpt2").train())  # left in eval mode
        except OSError as error:
            raise SystemExit(f"--pretrained needs the Hugging Face hub or its cache, which is not reachable: {error}")
    model = architectures.build(args.arch, vocab_size, width, args.layers, args.heads, args.seq, seed=seed)
    return causal_lm_loss_named(model) if args.arch == "gpt2" else model


def make_lora(rank, base_seed, args, vocab_size, seed):
    """A LoRA adapter of `rank` on the attention's projections of one base model (the same base for every rank:
    built from `base_seed`), its A drawn from `seed`."""
    try:
        import peft
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    except ImportError:
        raise SystemExit("--lora-ranks needs peft: pip install peft") from None
    model = make_model(args.width or max(args.widths), args, vocab_size, seed=base_seed)
    torch.manual_seed(seed)
    # peft's own choice of modules for the family where it has one (the attention's projections), else every
    # linear layer of the decoder ("all-linear": Phi-3's fused qkv_proj, OLMo 2, SmolLM3, Qwen3-MoE).
    known = model.config.model_type in TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05,
                             target_modules=None if known else "all-linear", fan_in_fan_out=args.arch == "gpt2")
    return peft.get_peft_model(model, config)


def causal_lm_loss_named(model):
    """transformers finds a model's loss from its class name; GPT2LMHeadModel's says nothing, so it warns
    (`loss_type=None` ... unrecognized) and falls back to the causal-LM loss. Name that loss instead."""
    model.loss_type = "ForCausalLM"
    return model


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
    try:
        return run(args)
    except ValueError as error:  # what hydra-torch or transformers refused of the arguments, before training
        raise SystemExit(f"error: {error}") from None


def run(args) -> int:
    if args.pretrained and args.arch != "gpt2":
        raise SystemExit("--pretrained loads Hugging Face's 'gpt2' weights: it goes with --arch gpt2 only")
    if args.lora_ranks and args.search:
        raise SystemExit("--lora-ranks compares a grid of ranks x --lrs; --search is for widths: choose one")
    widths = [args.width] if args.width else args.widths
    started = time.perf_counter()
    print("preparing text and tokenizer ...", flush=True)
    train_data, valid_data, vocab_size = prepare_data(args)

    eval_every = max(1, args.steps // 5)

    # The LoRA configurations' frozen base, held once on the host and copied once to a device for all of them.
    base = ht.FrozenBase(args.arch) if args.lora_ranks and not args.separate_bases else None

    def task_for(width, lr, seed, name, rank=None):
        model = (make_model(width, args, vocab_size, seed=seed) if rank is None else
                 make_lora(rank, args.seed, args, vocab_size, seed=seed))
        return ht.ModelTask(model, data=train_data, eval_data=valid_data, eval_every=eval_every,
                            optimizer=ht.optim.AdamW(lr=lr), name=name, precision=args.precision,
                            base=base if rank is not None else None)

    devices = args.devices.split(",") if args.devices else default_devices()
    if args.search:
        return search(args, task_for, devices)
    if args.lora_ranks:
        configs = [(r, lr) for r in args.lora_ranks for lr in args.lrs]
        tasks = [task_for(None, lr, args.seed + 1 + i, f"r{rank}-lr{lr:g}", rank=rank)
                 for i, (rank, lr) in enumerate(configs)]
    else:
        configs = [(w, lr) for w in widths for lr in args.lrs]
        tasks = [task_for(width, lr, args.seed + i, f"w{width}-lr{lr:g}") for i, (width, lr) in enumerate(configs)]
    models = [task.model for task in tasks]
    params = [sum(p.numel() for p in m.parameters() if p.requires_grad) for m in models]
    budget = args.budget or default_budget(tasks)
    print(f"{len(tasks)} {args.arch} configurations, {min(params) / 1e6:.2f}-{max(params) / 1e6:.2f}M trainable "
          f"parameters, "
          f"{args.steps} steps of {args.batch}x{args.seq} tokens, devices {devices}, budget {budget} per device",
          flush=True)
    selection = ht.SuccessiveHalving(args.halving, reduction_factor=3) if args.halving else None
    results = ht.train(tasks, devices=devices, memory_budget=budget, schedule=args.schedule,
                       progress=not args.no_progress, seed=args.seed, selection=selection)

    tokens = args.batch * args.seq
    # A configuration's tokens/s is its tokens over the time its own units ran: what it trained at while
    # it had a device. The configurations share the devices, so the aggregate is printed below, apart.
    print(f"\n{'config':<16} {'params':>8} {'train loss':>10} {'valid loss':>10} {'tokens/s':>9}")
    for result, n in zip(results, params):
        if result.error is not None:
            print(f"{result.name:<16} {n / 1e6:>7.2f}M  failed: {result.error}")
            continue
        speed = result.steps * tokens / result.busy_time if result.busy_time > 0 else float("nan")
        stopped = f"  (stopped at step {result.steps})" if result.stopped else ""
        print(f"{result.name:<16} {n / 1e6:>7.2f}M {result.final_loss:>10.4f} {result.final_eval_loss:>10.4f} "
              f"{speed:>9.0f}{stopped}")
    best = results.best
    if best is None:
        print("every configuration failed" if all(r.error is not None for r in results)
              else "no configuration reached a finite loss")
        return 1
    total = sum(r.steps for r in results if r.error is None) * tokens
    print(f"\nbest configuration: {best.name} (validation loss {best.final_eval_loss:.4f}, "
          f"perplexity {math.exp(best.final_eval_loss):.1f})")
    utilisation = ", ".join(f"{d} {100 * u:.0f}%" for d, u in results.utilisation().items())
    print(f"all configurations: {total / results.wall_time:.0f} tokens/s over {results.wall_time:.1f} s; "
          f"devices busy: {utilisation}")
    for name, held in results.bases.items():
        print(f"shared base {name!r}: {held['host_bytes'] / 1e6:.1f} MB on the host for {len(held['tasks'])} "
              f"configurations, {held['copied_bytes'] / 1e6:.1f} MB copied to the devices")
    if args.chart:
        results.plot_schedule(args.chart)
        print(f"schedule chart: {args.chart}")
    if args.curves:
        results.plot_curves(args.curves)
        print(f"loss curves: {args.curves}")
    print(f"total time {time.perf_counter() - started:.1f} s")
    return 0


def default_budget(tasks) -> int:
    """Room for the largest shard's weights and gradients plus one prefetch, well below any whole model, so
    every model spills and the engine streams shards."""
    largest_shard = max(sum(p.numel() * 4 for p in shard) for task in tasks for shard in task.shard_params)
    return 3 * largest_shard + 65536


def search(args, task_for, devices) -> int:
    """An Optuna study over width (one of --widths) and learning rate (1e-4 to 1e-2, log scale)."""
    try:
        import optuna
    except ImportError:
        raise SystemExit("--search needs Optuna: pip install optuna") from None
    from hydra_torch.optuna import optimize

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=args.seed),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1))
    widths = [args.width] if args.width else args.widths
    probe = [task_for(w, 1e-3, args.seed, f"probe{w}") for w in widths]
    budget = args.budget or default_budget(probe)
    del probe

    def build_task(trial):
        width = trial.suggest_categorical("width", widths)
        lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        return task_for(width, lr, args.seed + trial.number, f"trial{trial.number}-w{width}-lr{lr:.2g}")

    print(f"Optuna search: {args.search} trials, 4 at a time, widths {widths}, devices {devices}", flush=True)
    results = optimize(study, build_task, n_trials=args.search, concurrent=min(4, args.search), devices=devices,
                       memory_budget=budget, schedule=args.schedule, seed=args.seed)
    print(results.summary())
    best = study.best_trial
    print(f"\nbest trial: {best.number}, width {best.params['width']}, lr {best.params['lr']:.2g} "
          f"(validation loss {best.value:.4f}); {sum(t.state.name == 'PRUNED' for t in study.trials)} of "
          f"{len(study.trials)} trials pruned")
    if args.curves:
        results.plot_curves(args.curves)
        print(f"loss curves: {args.curves}")
    return 0
