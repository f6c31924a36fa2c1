"""Peak CPU memory of the last unit's work (final norm + LM head forward, causal-LM loss, backward), the plain
path against the fused chunked one, in fp32.

"plain": the head returns all tokens' logits, the loss slices them (logits[:, :-1].float().reshape) and the
output stays alive through the backward, as before the fused head. "fused": hydra_torch's head and default
loss (causal_lm.LMHead fused, causal_lm.causal_lm_loss), the output dropped before the backward.

Measured with torch.profiler(profile_memory=True): its allocation and free events, in time order, summed to the
highest point above what was allocated when profiling started (hidden states, weights and their gradients'
first allocation are inside the window; the inputs are not).

    python benchmarks/bench_lm_loss_peak.py --batch 8 --seq 1024 --vocab 50257 --width 768
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from hydra_torch.models.hf import causal_lm


def plain(head, hidden, batch):
    logits = head((hidden,))
    loss = F.cross_entropy(logits[:, :-1, :].float().reshape(-1, logits.shape[-1]), batch["labels"][:, 1:].reshape(-1),
                           ignore_index=causal_lm.IGNORE_INDEX)
    loss.backward()  # `logits` still referenced here, as the runner's `out` was
    return loss


def fused(head, hidden, batch):
    head.fuse()

    def loss_of():  # the output goes out of scope with this call, before the backward
        return causal_lm.causal_lm_loss(head((hidden,)), batch)

    loss = loss_of()
    loss.backward()
    return loss


def peak_bytes(path, args) -> tuple[int, float, float]:
    """(peak bytes above the start, seconds, loss) of one forward + loss + backward."""
    torch.manual_seed(0)
    head = causal_lm.LMHead(nn.LayerNorm(args.width), nn.Linear(args.width, args.vocab, bias=False))
    hidden = torch.randn(args.batch, args.seq, args.width, requires_grad=True)
    batch = {"labels": torch.randint(0, args.vocab, (args.batch, args.seq))}
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = path(head, hidden, batch).detach()
    seconds = time.perf_counter() - start
    changes = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")  # an allocation's bytes, or minus a free's
    current = peak = 0
    for _, nbytes in changes:
        current += nbytes
        peak = max(peak, current)
    return peak, seconds, loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--paths", default="plain,fused")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tokens = args.batch * args.seq
    print(f"{args.batch} x {args.seq} tokens, vocabulary {args.vocab}, width {args.width}, fp32; "
          f"one copy of all tokens' fp32 logits: {tokens * args.vocab * 4 / 2**30:.2f} GiB, the head's weight: "
          f"{args.vocab * args.width * 4 / 2**20:.0f} MiB, chunk: {causal_lm.CHUNK_BYTES / 2**20:.0f} MiB")
    for name in args.paths.split(","):
        peak, seconds, loss = peak_bytes({"plain": plain, "fused": fused}[name], args)
        print(f"{name}: peak {peak / 2**30:.3f} GiB ({peak / (tokens * args.vocab * 4):.2f} logits copies), "
              f"{seconds:.1f} s, loss {loss:.6f}")


if __name__ == "__main__":
    main()
