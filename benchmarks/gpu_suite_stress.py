"""The GPU suite's stream-stress run: three small spilled GPT-2 models share one device whose budget holds about
three shards, so almost every shard visit is a copy in, every backward a copy out, and host steps of three
models run beside the copies (AdamW; AdamW with accumulation and clipping; SGD with momentum). The same run on
the CPU is the reference. A copy that races its stream (a weight read before it landed, a gradient region
reused before its copy out, a step reading a buffer still being filled) shows as an error of the order of a
whole update; the kernels' own rounding differences stay far below the thresholds.

Error of a weight matrix: |w_device - w_cpu| / |w_cpu - w_start|, the difference over the size of the training's
own change; the largest over every matrix of the three models. Vectors are left out: GPT-2's key bias has an
exactly-zero gradient, and Adam scales the rounding noise there up to full-size updates. Thresholds: fp32
0.02, bf16 0.25. Summing in another order alone (the CPU reference on two threads instead of one) gives 5e-5
and 0.01. On the CPU (the suite's smoke mode) the device run is two virtual CPU devices on an emulated link,
which must match one CPU device bit for bit.
"""
from __future__ import annotations

import contextlib
import copy
import time

import torch

from gpu_suite_systems import failure

THRESHOLDS = {"fp32": 0.02, "bf16": 0.25}
SHAPE = dict(n_embd=128, n_layer=4, n_head=4)
VOCAB, SEQ, BATCH = 1024, 64, 4


def _models():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, **SHAPE, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    out = []
    for seed in range(3):
        torch.manual_seed(seed)
        out.append(GPT2LMHeadModel(config))
    return out


def _batches(steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(2 * steps)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def _train(models, data, devices, precision, budget, link=None):
    import hydra_torch as ht
    from hydra_torch.run.measuring import kept_beside_arena
    from hydra_torch.testing import emulated_link

    tasks = [ht.ModelTask(models[0], data=data[: len(data) // 2], optimizer=ht.optim.AdamW(lr=1e-3),
                          precision=precision, name="adamw"),
             ht.ModelTask(models[1], data=data, optimizer=ht.optim.AdamW(lr=1e-3, weight_decay=0.1),
                          accumulate=2, clip_grad_norm=0.5, precision=precision, name="adamw-accumulate-clip"),
             ht.ModelTask(models[2], data=data[: len(data) // 2], optimizer=ht.optim.SGD(lr=3e-2, momentum=0.9),
                          precision=precision, name="sgd-momentum")]
    start = time.perf_counter()
    with emulated_link(link) if link else contextlib.nullcontext():
        budget += kept_beside_arena(tasks, device=devices[0])  # the arena as sized, beside the activations
        results = ht.train(tasks, devices=devices, memory_budget=budget, progress=False, host_threads=3)
    errors = [f"{r.name}: {r.error}" for r in results if r.error is not None]
    if errors:
        raise RuntimeError("; ".join(errors))
    if any(r.resident for r in results):
        raise RuntimeError("a model stayed resident: the budget did not force spilling")
    return results, time.perf_counter() - start


def _largest_error(trained, reference, start) -> tuple[float, str]:
    worst, where = 0.0, ""
    for i, (a, b, s) in enumerate(zip(trained, reference, start)):
        for (name, pa), pb, ps in zip(a.named_parameters(), b.parameters(), s.parameters()):
            if pa.dim() < 2:
                continue  # vectors: the key bias's gradient is exactly zero, and Adam scales its rounding noise up
            change = (pb.detach().float() - ps.detach().float()).norm().item()
            error = (pa.detach().float() - pb.detach().float()).norm().item() / max(change, 1e-30)
            if error > worst:
                worst, where = error, f"model {i} {name}"
    return worst, where


def stream_stress(device: torch.device, steps: int = 6) -> dict:
    """Both precisions, each trained on `device` and on the CPU from the same weights and batches."""
    threads = torch.get_num_threads()
    try:
        data, out = _batches(steps), {"shape": {**SHAPE, "vocab": VOCAB, "seq": SEQ, "batch": BATCH}, "steps": steps}
        start = _models()
        # About three of the largest shard (the tied embedding) for three models: eviction on every visit.
        largest = VOCAB * SHAPE["n_embd"] * 4
        budget = 3 * largest + 65536
        cuda = device.type == "cuda"
        if not cuda:
            torch.set_num_threads(1)  # each virtual CPU device computes on one thread: the same sums everywhere
        for precision in ("fp32", "bf16"):
            on_device = [copy.deepcopy(m) for m in start]
            on_cpu = [copy.deepcopy(m) for m in start]
            results, seconds = _train(on_device, data, [device] if cuda else ["cpu", "cpu"], precision, budget,
                                      link=None if cuda else 2e9)
            _, cpu_seconds = _train(on_cpu, data, ["cpu"], precision, budget)
            error, where = _largest_error(on_device, on_cpu, start)
            threshold = THRESHOLDS[precision] if cuda else 0.0
            out[precision] = {"largest_error": error, "where": where, "threshold": threshold,
                              "shard_loads": [r.shard_loads for r in results],
                              "device_seconds": seconds, "cpu_seconds": cpu_seconds,
                              "final_losses": [r.final_loss for r in results]}
            if min(min(r.shard_loads) for r in results) < 2:
                out["error"] = f"{precision}: a shard was copied in only once: the budget did not force eviction"
            elif not error <= threshold:
                out["error"] = (f"{precision}: the device run differs from the CPU run by {error:.3g} of an update "
                                f"at {where} (threshold {threshold})")
        return out
    except Exception as error:
        return failure(error)
    finally:
        torch.set_num_threads(threads)
