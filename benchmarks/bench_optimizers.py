"""Fused CPU AdamW (hydra) against torch.optim.AdamW(fused=True) and against a plain copy.

The torch/hydra column compares each hydra variant with AdamW(fused=True), torch's own single-pass CPU
kernel, producing the same outputs: for the bf16 shadow that means fused AdamW followed by
`shadow.copy_(param)`. The default single-tensor AdamW is listed for context; all torch rows count the
minimum bytes of the fused update, although torch makes extra passes.

Every variant runs once per round, round after round (interleaved), so drift in machine load affects all of
them alike; the table reports the median over rounds.

Bandwidth counting: bytes the step reads plus bytes it writes. AdamW reads param, grad, exp_avg, exp_avg_sq
and writes param, exp_avg, exp_avg_sq: 28 B/param; the bf16 shadow adds 2 B written. The copy baseline is
`dst.copy_(src)` of 14 B/param, counted as 14 read + 14 written = the same 28 B/param as AdamW. Neither count
includes the read-for-ownership a CPU performs before writing a line it has not read: the copy pays it on
every byte it writes, AdamW only on the shadow (its other outputs were just read), so "% of copy" flatters
AdamW. A second baseline without that handicap rewrites 14 B/param in place (`x.neg_()`: every line is
read, then written back), again counted as 28 B/param; "% of in-place" is the stricter figure.

With --threads, the table is repeated for each count of threads the kernels may use (0: every core, as
torch.get_num_threads() is at start): how many cores the host step needs to reach the memory's bandwidth, which
the host-step pool is sized by (each job's OpenMP team; `run/devices.py: host_step_threads`).

    python benchmarks/bench_optimizers.py [--sizes 10e6 100e6] [--rounds 21] [--threads 1 2 0]
"""
import argparse
import statistics
import time

import torch

import hydra_torch  # noqa: F401
from hydra_torch import ops

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 1e-2


def torch_adamw(numel, with_shadow):
    """torch's fastest CPU AdamW; with_shadow adds the separate pass torch needs to refresh a bf16 copy."""
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    try:
        opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
        opt.step()
        name = "torch AdamW(fused=True)"
    except RuntimeError:  # fused unsupported on CPU in this torch
        opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)
        name = "torch AdamW(foreach=True; fused unsupported on CPU)"
    if not with_shadow:
        return name, opt.step
    shadow = torch.empty(numel, dtype=torch.bfloat16)

    def step_and_refresh_shadow():
        opt.step()
        shadow.copy_(param.detach())
    return name + " + shadow.copy_(param)", step_and_refresh_shadow


def torch_adamw_default(numel):
    # What torch.optim.AdamW runs on CPU when neither fused nor foreach is asked for: one pass per operation.
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    return torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY).step


def native_adamw(numel, with_shadow):
    param, grad = torch.randn(numel), torch.randn(numel)
    exp_avg, exp_avg_sq = torch.zeros(numel), torch.zeros(numel)
    shadow = torch.empty(numel, dtype=torch.bfloat16) if with_shadow else None
    step = [0]

    def run():
        step[0] += 1
        ops.adam_step(param, grad, exp_avg, exp_avg_sq, shadow, lr=LR, step=step[0], beta1=BETAS[0], beta2=BETAS[1],
                      eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True)
    return run


def copy_of(nbytes):
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    return lambda: dst.copy_(src)


def in_place_of(nbytes):
    x = torch.randn(nbytes // 4)
    return lambda: x.neg_()


def bench(numel, rounds):
    torch_name, torch_step = torch_adamw(numel, with_shadow=False)
    torch_shadow_name, torch_shadow_step = torch_adamw(numel, with_shadow=True)
    # Each hydra variant is compared with the torch variant producing the same outputs.
    counterpart = {"hydra adam_step": torch_name, "hydra adam_step + bf16 shadow": torch_shadow_name}
    variants = {  # name -> (callable, bytes moved per step, counted as the fused update's minimum)
        torch_name: (torch_step, 28 * numel),
        torch_shadow_name: (torch_shadow_step, 30 * numel),
        "torch AdamW(default single-tensor)": (torch_adamw_default(numel), 28 * numel),
        "hydra adam_step": (native_adamw(numel, False), 28 * numel),
        "hydra adam_step + bf16 shadow": (native_adamw(numel, True), 30 * numel),
        "copy_ (14 B/param, counted 28)": (copy_of(14 * numel), 28 * numel),
        "in-place neg_ (14 B/param, counted 28)": (in_place_of(14 * numel), 28 * numel),
    }
    times = {name: [] for name in variants}
    for fn, _ in variants.values():  # warm-up: page faults, thread pool start
        fn(), fn()
    for _ in range(rounds):
        for name, (fn, _) in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    def bandwidth(name):
        return variants[name][1] / medians[name]
    copy_bw = bandwidth(next(n for n in variants if n.startswith("copy_")))
    in_place_bw = bandwidth(next(n for n in variants if n.startswith("in-place")))
    rows = []
    for name in variants:
        vs_torch = medians[counterpart[name]] / medians[name] if name in counterpart else None
        rows.append((numel, name, medians[name] * 1e3, bandwidth(name) / 1e9, vs_torch, bandwidth(name) / copy_bw,
                     bandwidth(name) / in_place_bw))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[10e6, 100e6])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--threads", type=int, nargs="+", default=[0],
                        help="thread counts to run the table with, 0 for every core (default: 0)")
    args = parser.parse_args()
    if any(t < 0 for t in args.threads):
        parser.error("--threads takes counts >= 0")
    cores = torch.get_num_threads()
    print(f"torch {torch.__version__}, {cores} threads at start, median of {args.rounds} interleaved rounds\n")
    print("| threads | params | variant | ms/step | GB/s (read+written) | torch/hydra | % of copy GB/s "
          "| % of in-place GB/s |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads or cores)
        for size in args.sizes:
            for numel, name, ms, gbs, vs_torch, vs_copy, vs_in_place in bench(int(size), args.rounds):
                ratio = f"{vs_torch:.2f}x" if vs_torch is not None else ""
                print(f"| {threads or cores} | {numel / 1e6:.0f}M | {name} | {ms:.2f} | {gbs:.1f} | {ratio} "
                      f"| {vs_copy * 100:.0f}% | {vs_in_place * 100:.0f}% |", flush=True)
    torch.set_num_threads(cores)

if __name__ == "__main__":
    main()
