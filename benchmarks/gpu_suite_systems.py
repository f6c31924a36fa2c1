"""The systems the GPU suite compares, one function each. Every function trains the models it is given (built
from their seeds in this run's process, which it may consume) on the same batches with AdamW(weight_decay=0.01)
and returns a dict of measurements, or a dict with "error" (the failure, as text) or "skipped" (why it cannot
run here): a baseline that breaks must not take the suite down with it. `report`, where given, receives the
measurements so far after every step (the run's process writes them where the suite finds them if the run is
cut short). Hydra and plain PyTorch here; the baselines (DeepSpeed, FSDP2) in gpu_suite_baselines.py."""
from __future__ import annotations

import gc
import threading
import time
import traceback

import torch

from gpu_suite_env import GiB, Sampler, Workload, median_after

WEIGHT_DECAY = 0.01


def failure(error: BaseException) -> dict:
    out = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(limit=8)}
    if isinstance(error, torch.OutOfMemoryError):
        out["out_of_memory"] = True  # a measured outcome where the cap is the question (K processes at once)
    return out


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # pinned host blocks cached by the last system
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gpu(device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def _summary(w: Workload, step_times: list[list[float]], wall: float, sampler: Sampler, device, concurrent: bool):
    """Aggregate tokens/s from the median timed step. Concurrent models (hydra) each finish a step per their
    median, so their rates add; models trained one after another share the clock, so the rate is one model's."""
    medians = [median_after(t, w.warmup) for t in step_times]
    if concurrent:
        tokens_per_s = sum(w.tokens_per_step / m for m in medians if m)
    else:
        tokens_per_s = w.tokens_per_step / median_after([s for t in step_times for s in t[w.warmup:]], 0)
    steps = sum(len(t) for t in step_times)
    return {"tokens_per_s": tokens_per_s, "median_step_s": medians, "steps": steps,
            "wall_s": wall, "end_to_end_tokens_per_s": steps * w.tokens_per_step / wall,
            "peak_gpu_gib": _peak_gpu(device), **sampler.record()}


def _step_starts(results, n_shards: list[int]) -> list[tuple[list[float], float]]:
    """Per task, from the schedule trace: when each of its steps began (its first unit, shard 0's forward; units
    are numbered across the run, 2n-1 per micro-batch), in order, and when its last unit ended."""
    out = []
    for task, n in enumerate(n_shards):
        per = max(1, 2 * n - 1)
        starts, last_end = {}, 0.0
        for e in results.trace:
            if e.task == task:
                step = e.unit // per
                starts[step] = min(starts.get(step, e.start), e.start)
                last_end = max(last_end, e.end)
        out.append(([starts[k] for k in sorted(starts)], last_end))
    return out


def _window_begin(steps: list[tuple[list[float], float]], w: Workload) -> float | None:
    """When every model has begun its first timed step; None where a model did not get past its warm-up."""
    if not all(len(starts) > w.warmup for starts, _ in steps):
        return None
    return max(starts[w.warmup] for starts, _ in steps)


def _steady_window(steps: list[tuple[list[float], float]], w: Workload) -> dict:
    """Aggregate tokens/s over one window: from the moment every model has finished its warm-up steps (its
    first timed step has begun) to the moment the last model's last unit ended; the tokens are every step that
    began inside the window, so no model's warm-up counts and no model is cut short by its neighbours."""
    begin = _window_begin(steps, w)
    if begin is None:
        return {"window_tokens_per_s": None, "window_note": "a model did not get past its warm-up steps"}
    inside = sum(1 for starts, _ in steps for t in starts if t >= begin)
    seconds = max(end for _, end in steps) - begin
    return {"window_tokens_per_s": inside * w.tokens_per_step / seconds if seconds > 0 else None,
            "window_s": seconds, "window_steps": inside}


def _training_span(steps: list[tuple[list[float], float]], w: Workload, sampler: Sampler) -> dict:
    """Every step over the span from the first unit to the last (warm-up included, setup and teardown not): a
    steadier figure than the window where each model runs few steps; and NVML's utilisation over that span and
    over the window, which the whole run's mean (setup included) understates."""
    count = sum(len(starts) for starts, _ in steps)
    if not count:
        return {"span_tokens_per_s": None}
    begin, end = min(starts[0] for starts, _ in steps if starts), max(last for _, last in steps)
    out = {"span_s": end - begin, "span_steps": count,
           "span_tokens_per_s": count * w.tokens_per_step / (end - begin) if end > begin else None,
           "nvml_gpu_util_span": sampler.util_between(begin, end)}
    window_begin = _window_begin(steps, w)
    if window_begin is not None:
        out["nvml_gpu_util_window"] = sampler.util_between(window_begin, end)
    return out


def _step_durations(steps: list[tuple[list[float], float]]) -> list[list[float]]:
    """Per task, each step lasts from its start until the next step starts (or its last unit ends), which
    includes waiting for shard 0's optimizer step on the host."""
    bounds = [starts + [end] for starts, end in steps]
    return [[b - a for a, b in zip(ordered, ordered[1:])] for ordered in bounds]


def _compact_trace(results) -> list[list]:
    """Every unit as [device, task, unit, shard, phase initial, start s, seconds, bytes copied meanwhile]: what
    the simulator needs to replay the run (benchmarks/RESULTS.md compares the two)."""
    t0 = min((e.start for e in results.trace), default=0.0)
    return [[e.device, e.task, e.unit, e.shard, e.phase[0], round(e.start - t0, 6), round(e.end - e.start, 6),
             e.bytes_copied] for e in results.trace]


def run_hydra(models, lrs, w: Workload, data, device: torch.device, budget, optimizer="adamw", deadline=None,
              shards="auto", placement="auto") -> dict:
    """All models in one ht.train call, bf16 weights on the device, fp32 masters and the optimizer on the host,
    shards planned on the device for the budget (which holds everything the run puts there). At `deadline`
    every task is asked to stop at its next step boundary, so a run that is running late still returns what it
    measured instead of being killed."""
    timer = None
    try:
        import hydra_torch as ht

        _reset(device)
        make = {"adamw": lambda lr: ht.optim.AdamW(lr=lr, weight_decay=WEIGHT_DECAY),
                "sgd": lambda lr: ht.optim.SGD(lr=lr)}[optimizer]
        tasks = [ht.ModelTask(m, data=data, optimizer=make(lr), name=f"m{i}-lr{lr:g}", precision="bf16",
                              shards=shards) for i, (m, lr) in enumerate(zip(models, lrs))]
        if deadline is not None:
            def stop_all(tasks=tuple(tasks)):
                for task in tasks:
                    task.request_stop("the suite's deadline")
            timer = threading.Timer(max(0.0, deadline - time.perf_counter()), stop_all)
            timer.daemon = True
            timer.start()
        with Sampler(device) as sampler:
            start = time.perf_counter()
            results = ht.train(tasks, devices=[device], memory_budget=budget, progress=False, seed=w.seed,
                               placement=placement)
            wall = time.perf_counter() - start
        errors = [f"{r.name}: {r.error}" for r in results if r.error is not None]
        if errors:
            return {"error": "; ".join(errors)}
        steps = _step_starts(results, [t.num_shards for t in tasks])
        out = _summary(w, _step_durations(steps), wall, sampler, device, True)
        out.update(_steady_window(steps, w))
        out.update(_training_span(steps, w, sampler))
        if any(r.cut_short for r in results):
            out["time_box"] = "stopped at the suite's deadline: " + ", ".join(
                f"{r.name} {r.steps} steps" for r in results)
        stats = results.stats[0]
        moved = stats["host_to_device_bytes"] + stats["device_to_host_bytes"]
        out.update({"utilisation": list(results.utilisation().values())[0], "resident": [r.resident for r in results],
                    "placement": placement, "placements": [r.placement for r in results],
                    "budget_gib": stats["budget_bytes"] / GiB, "arena_high_water_gib": stats["high_water_bytes"] / GiB,
                    "host_to_device_bytes": stats["host_to_device_bytes"],
                    "device_to_host_bytes": stats["device_to_host_bytes"],
                    "budget_split": {k: stats.get(k) for k in ("capacity_bytes", "working_set_bytes",
                                                                "saved_allowance_bytes", "saved_high_water_bytes")},
                    "copy_gbps_over_wall": moved / results.wall_time / 1e9 if results.wall_time else None,
                    "host_step_seconds": stats["host_step_seconds"], "grad_copy_seconds": stats["grad_copy_seconds"],
                    "final_losses": [r.final_loss for r in results],
                    "shard_params": [[sum(p.numel() for p in shard) for shard in t.shard_params] for t in tasks],
                    "trace": _compact_trace(results)})
        del models, tasks, results
        return out
    except Exception as error:
        return failure(error)
    finally:
        if timer is not None:
            timer.cancel()
        _reset(device)


class _Window:
    """CUDA events around each step's forward and backward: their elapsed time over the step's wall time is the
    fraction of the step the compute stream had work queued (an upper bound on busy: a stream waiting on a copy
    counts as busy)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.pairs = []

    def begin(self):
        if self.cuda:
            self.pairs.append([torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)])
            self.pairs[-1][0].record()

    def end(self):
        if self.cuda:
            self.pairs[-1][1].record()

    def busy_s(self, warmup: int) -> list[float]:
        return [a.elapsed_time(b) / 1e3 for a, b in self.pairs[warmup:]] if self.cuda else []


def _loop(w, data, device, forward_backward, step, deadline, window, report) -> list[float]:
    times = []
    for i, batch in enumerate(data):
        if deadline is not None and i >= w.warmup + 1 and time.perf_counter() > deadline:
            break  # time box: keep what was measured; the record says how many steps ran
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        _sync(device)
        start = time.perf_counter()
        window.begin()
        forward_backward(batch)
        window.end()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
        if report is not None:
            report({"step_times": list(times), "warmup": w.warmup, "tokens_per_step": w.tokens_per_step})
    return times


def _sequential(w, models, lrs, data, device, deadline, setup, report=None) -> dict:
    """Trains the models one after another (consuming the list); setup(model, lr) -> (forward_backward, step,
    teardown, notes)."""
    _reset(device)
    all_times, busy, notes, count = [], [], {}, len(models)
    with Sampler(device) as sampler:
        start = time.perf_counter()
        for lr in lrs[:count]:
            if deadline is not None and time.perf_counter() > deadline and all_times:
                notes["time_box"] = f"stopped after {len(all_times)} of {count} models"
                break
            window = _Window(device)
            forward_backward, step, teardown, extra = setup(models.pop(0), lr)
            notes.update(extra)
            times = _loop(w, data, device, forward_backward, step, deadline, window, report)
            teardown()
            gc.collect()
            all_times.append(times)
            busy += window.busy_s(w.warmup)
        wall = time.perf_counter() - start
    out = _summary(w, all_times, wall, sampler, device, concurrent=False)
    timed = sum(sum(t[w.warmup:]) for t in all_times)
    out["cuda_event_busy_fraction"] = sum(busy) / timed if busy and timed else None
    out["models_trained"] = len(all_times)
    out.update(notes)
    return out


def run_plain(models, lrs, w: Workload, data, device: torch.device, deadline=None, checkpointed=False,
              report=None) -> dict:
    """Plain PyTorch: fp32 weights on the device, bf16 autocast, AdamW on the device (fused on CUDA). With
    `checkpointed`, activation checkpointing per block: the FLOPs hydra's recompute costs (4 forwards per 3)."""
    def setup(model, lr):
        notes = checkpoint_activations(model) if checkpointed else {}
        model.to(device).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WEIGHT_DECAY, fused=device.type == "cuda")

        def forward_backward(batch):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()

        def step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        def teardown():
            nonlocal model, opt
            model, opt = None, None
        return forward_backward, step, teardown, notes

    try:
        return _sequential(w, models, lrs, data, device, deadline, setup, report)
    except Exception as error:
        return failure(error)
    finally:
        _reset(device)


def checkpoint_activations(model) -> dict:
    """The offload baselines keep only each block's input and recompute the rest in backward, as hydra keeps
    only each shard's: without it, GPT-2-large's activations alone (batch 8) overflow the memory cap.
    Transformers' default (non-reentrant torch.utils.checkpoint) is used; newer releases renamed the method."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    return {"activation_checkpointing": "per transformer block (gradient_checkpointing_enable)"}
