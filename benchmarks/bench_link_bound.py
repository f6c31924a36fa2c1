"""Training time against its bound on an emulated link (CPU): how much of the copying the engine hides.

K spilled GPT-2 models train on one CPU device whose copies take bytes / bandwidth seconds each way
(`hydra_torch.testing.emulated_link`), the bandwidth set so that copying a block's weights takes `ratio` times the
block's forward. Lanes = max(compute, host-to-device bytes / bandwidth, device-to-host bytes / bandwidth): compute
is the sum of the units' times in the same training at memory speed, the bytes are the engine's own counts. Bound =
max(lanes, the longest chain): a task's units one after another and, at each step boundary, what its host steps'
round trips add beyond the units that can run meanwhile (the lane model's `chain`, `_C.lane_forecast`, for the
placement the run got, from the memory-speed run's unit times). Reported, medians of interleaved rounds: the span
(first unit's start to last unit's end) over the lanes and over the bound, and the shares of the span the compute
waited for weights to land (`acquire_wait_seconds`, the exposed copies) and for room for gradients
(`grad_wait_seconds`, held up by earlier gradients still copying out). With several `--placements` (ht.train's
`placement`: "auto" keeps each model's first and last shards resident and, on the emulated lanes, lets the lane
model make more shards resident or step them on the device from the rates it measures, "device" steps every other
untied shard on the device, "host" spills every shard), each runs in every round under one budget, which then also
holds every model's resident ends and, with "device", its other shards' gradient buffers and the largest device
step's regions. With `--host-speed S` the host steps run on an emulated host memory bandwidth of S times the link's
(`hydra_torch.testing.emulated_host`), and the bound also counts the host lane: the bytes the host steps touched
over that bandwidth. With `--forecast`, each run is also forecast by the lane model (`_C.lane_forecast`, the
simulator over the real scheduler) from what the memory-speed run of the same round measured: each shard's median
unit times, the host steps' bytes per second (the emulated host's where there is one), the link's bandwidth, and the
placement the run got; reported as the forecast over the measured span, except where a task was placed again mid-run
(a shard stepped in two places in `results.steps`: its placement is then where it stepped last); for a run the lane
model placed, also in the device's room it placed in ("in room / span": the simulator's arena bounding how far copies
run ahead, device steps' states and held gradients in it, as the lane model weighs its candidates). With `--precision
bf16` the models compute in bf16 (fp32 masters on the host, as in the GPU suite's P2; the copy / forward ratio then
counts a block's bf16 weights), and with `--cache-all` the budget also has room to keep every model's weights
cached, as P2's budget on the GPU box does: the engine then grants "auto" its resident ends beside the other spilled
models (bf16 keeps the models themselves spilled, which fp32 weights cached whole would not). With `--devices N` the
models train on N virtual CPU devices, each with its own emulated link and a share of the cores: the bound then
counts the compute spread evenly over them, the busiest device's link, and the one host lane; "compute s" is a
device's share, "copies in s" and "copies out s" all devices' together. With `--head-blocks K` the last shard holds
the last K blocks besides the tied head, and with `--resident-room first` the budget holds the first shard's home
instead of both ends': the engine's rule then keeps no end resident, and the "owner" placement ("auto" with the lane
model's choice replaced by the first shard resident alone) keeps the embedding resident, its head spilled.

    python benchmarks/bench_link_bound.py [--models 1] [--ratios 0.25 1 2 4] [--ahead 1] [--far] [--commit 4]
                                          [--rounds 3] [--by-unit] [--clip MAX_NORM]
                                          [--placements host auto device owner] [--host-speed S] [--forecast]
                                          [--precision bf16] [--cache-all]
                                          [--devices N] [--head-blocks K] [--resident-room ends|first]
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from unittest import mock

import torch
import hydra_torch as ht
from bench_emulated_link import make_tasks, parse_workload
from hydra_torch import testing
from hydra_torch._loader import native as _C
from hydra_torch.run import lane_choice, measuring, workers


def train(args, data, budget, bandwidth=None, placement="host"):
    tasks = make_tasks(args, data)
    with contextlib.ExitStack() as stack:
        if bandwidth is not None:
            stack.enter_context(testing.emulated_link(bandwidth))
            if args.host_speed is not None:
                stack.enter_context(testing.emulated_host(args.host_speed * bandwidth))
        if args.far:  # prefetch along the plan into all free memory, not only the next planned shard
            stack.enter_context(mock.patch.object(workers, "PREFETCH_BEYOND_NEXT_BYTES", -1))
        stack.enter_context(mock.patch.object(workers, "COMMITTED_UNITS", args.commit))
        if placement == "owner":
            stack.enter_context(mock.patch.object(lane_choice, "plan", first_shard_resident))
        budget += measuring.kept_beside_arena(tasks)  # the arena as sized, beside the working set and saved inputs
        results = ht.train(tasks, devices=["cpu"] * args.devices, memory_budget=budget, progress=False,
                           placement="auto" if placement == "owner" else placement)
    assert all(r.error is None for r in results), (placement, [r.error for r in results])
    placements.setdefault(placement, [r.placement for r in results])
    return results


placements: dict[str, list[str]] = {}  # what each placement gave the models, in the first round


def first_shard_resident(runners, stores, *args):
    """The "owner" placement's lane plan: every model's first shard (the tied embedding) resident alone."""
    return [["resident"] + ["host"] * (store.num_shards - 1) for store in stores], None


def ends_bytes(shard_bytes, optimizer_states: int = 2) -> int:
    """What a model's first and last shards' homes take on the device: weights, gradients and AdamW's two
    moments of each (the head's weight is the embedding's, tied: counted once, in the first shard), with room
    for the regions' alignment."""
    return (2 + optimizer_states) * (shard_bytes[0] + shard_bytes[-1]) + 2 * 5 * 512


def first_home_bytes(shard_bytes, optimizer_states: int = 2) -> int:
    """What a model's first shard's home takes on the device (a tied embedding resident without its head)."""
    return (2 + optimizer_states) * shard_bytes[0] + 5 * 512


def span(results) -> float:
    return max(e.end for e in results.trace) - min(e.start for e in results.trace)


def block_forward_seconds(results, shards: int) -> float:
    """The median forward of a transformer block's shard (not the embedding's, not the head's)."""
    return statistics.median(e.end - e.start for e in results.trace
                             if e.phase == "forward" and 0 < e.shard < shards - 1)


def unit_kind(entry, shards: int) -> str:
    """A unit's phase and shard; a forward of the first shard after a step is told apart (it waits for that
    shard's gradients to go out, its step and its weights to come back in)."""
    after_step = entry.phase == "forward" and entry.shard == 0 and entry.unit >= 2 * shards - 1
    return f"{entry.phase} {entry.shard}" + (" after a step" if after_step else "")


def extra_by_kind(base, results, shards: int) -> dict[str, float]:
    """Seconds each kind of unit took on the link beyond its median time at memory speed, summed."""
    at_memory_speed, on_link = {}, {}
    for trace, into in ((base.trace, at_memory_speed), (results.trace, on_link)):
        for e in trace:
            into.setdefault(unit_kind(e, shards), []).append(e.end - e.start)
    return {kind: sum(times) - statistics.median(at_memory_speed[kind]) * len(times)
            for kind, times in on_link.items()}


def placed_again(results) -> bool:
    """Whether a task stepped a shard in more than one place (placed again mid-run, as tasks still training are when
    another leaves): the task's placement is then where it stepped last, and a forecast from it is of another run."""
    places = {}
    for e in results.steps:
        places.setdefault((e.task, e.shard), set()).add(e.place)
    return any(len(seen) > 1 for seen in places.values())


def lane_forecast(base, results, args, shard_bytes, bandwidth: float, in_room: bool = False) -> dict:
    """The lane model's forecast of `results`' run (see the module's docstring): its "span" (the last unit's end)
    and its four-lane "bound", whose "chain" is the longest task's own critical path at these rates. `in_room`: in
    the device's room as the lane model placed it (Results.lane_plan's room and start: lane_forecast's
    simulation_in_room, its arena's room bounding how far copies run ahead and device steps' states)."""
    shards = len(shard_bytes)
    times = {}
    for e in base.trace:
        times.setdefault((e.shard, e.phase), []).append(e.end - e.start)
    unit = {key: statistics.median(values) for key, values in times.items()}
    tied = args.vocab * args.width  # the head reads the embedding's weight, tied, and sends its gradient out
    shapes = []
    for s in range(shards):
        last = s == shards - 1
        forward, backward = (0.0, unit[s, "forward_backward"]) if last else (unit[s, "forward"], unit[s, "backward"])
        read = shard_bytes[s] // 4  # fp32 elements, the tied weight included in the head's shard
        shapes.append((forward, backward, read, read, read - tied if last else read, 0 if last else -1,
                       tied if last else 0))
    stats = base.stats[0]
    # At the rate the memory-speed run's host steps reached; a run whose every model is resident stepped nothing on
    # the host, and the link's rate stands in (the lane model asks a rate > 0).
    stepped = stats["host_step_seconds"] > 0
    memory_rate = stats["host_step_bytes"] / stats["host_step_seconds"] if stepped else bandwidth
    # The emulated host's pace where there is one: the steps' own work runs within it (measured at memory speed
    # beside the compute on these cores, the steps' rate is lower than when they mostly wait on the pace).
    host_rate = args.host_speed * bandwidth if args.host_speed else memory_rate
    placement = [["resident" if r.placement == "resident" or s in r.resident_shards else
                  "device" if s in r.device_shards else "host" for s in range(shards)] for r in results.tasks]
    fp32_adamw = (4.0, 8.0, 28.0, 8.0, 28.0)  # weight, state, host step, host accumulate, device step
    step_bytes = None if args.precision == "bf16" else fp32_adamw  # None: the lane model's bf16 AdamW
    # A resident or device-stepped shard steps on the CPU device, which the emulated host does not pace: at the
    # rate the memory-speed run's host steps reached.
    rates = (bandwidth, bandwidth, host_rate, memory_rate)
    room = (results.lane_plan["room"], results.lane_plan["start"]) if in_room else (None, None)
    return _C.lane_forecast([(shapes, args.steps, 1, args.clip is not None)] * len(results.tasks), rates, step_bytes,
                            args.devices, placement, *room)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--ahead", type=int, default=1,
                        help="room in the budget for this many more shards' weights (1: double buffering)")
    parser.add_argument("--far", action="store_true",
                        help="prefetch along the plan as far as free memory allows (default: the next shard)")
    parser.add_argument("--commit", type=int, default=workers.COMMITTED_UNITS,
                        help="units of its plan each device commits to (0: none, the policy decides each unit)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 1.0, 2.0, 4.0],
                        help="a block's weight copy over its forward")
    parser.add_argument("--clip", type=float, default=None, metavar="MAX_NORM",
                        help="every model clips its gradients' global norm (clip_grad_norm)")
    parser.add_argument("--by-unit", action="store_true",
                        help="also where the span beyond memory speed goes: each kind of unit's extra seconds")
    parser.add_argument("--placements", nargs="+", default=["host"], choices=["host", "auto", "device", "owner"],
                        help="ht.train's placement, each run in every round (auto: resident first and last shards, "
                             "and the lane model's choice for the others; device: the others stepped on the device; "
                             "owner: auto with the lane model's choice replaced by the first shard resident alone)")
    parser.add_argument("--host-speed", type=float, default=None,
                        help="emulate a host memory bandwidth of this many times the link's (default: the machine's)")
    parser.add_argument("--forecast", action="store_true",
                        help="also the lane model's forecast of each run, over the measured span")
    parser.add_argument("--precision", choices=["bf16"], default=None,
                        help="the models compute in bf16 (fp32 masters on the host), as in the GPU suite")
    parser.add_argument("--devices", type=int, default=1,
                        help="virtual CPU devices, each with its own emulated link and a share of the cores")
    parser.add_argument("--cache-all", action="store_true",
                        help="room in the budget to keep every model's weights cached (as P2's budget on the GPU)")
    parser.add_argument("--head-blocks", type=int, default=0,
                        help="the last shard holds this many of the last blocks besides the head")
    parser.add_argument("--resident-room", choices=["ends", "first"], default="ends",
                        help="with auto or device, room in the budget for both ends' homes or the first shard's only")
    args, data, shard_bytes = parse_workload(parser)
    copied = 0.5 if args.precision == "bf16" else 1.0  # of the fp32 bytes, what a weight copy moves
    block_bytes = shard_bytes[1] * copied
    # One shard's weights and gradients, and room for `ahead` more shards' weights to be copied in meanwhile;
    # with "auto" among the placements, every model's resident ends too (the same budget for every placement).
    budget = (2 + args.ahead) * max(shard_bytes) + 65536
    if args.devices > 1:
        # No home on several devices, and no gradient buffer held (one micro-batch a step, no clipping): a device
        # step takes its master and moments (12 bytes a parameter) beside the working set, on each device.
        if "auto" in args.placements or "device" in args.placements:
            budget += 3 * max(shard_bytes) + 65536
    else:
        if "auto" in args.placements or "device" in args.placements:
            budget += args.models * (ends_bytes(shard_bytes) if args.resident_room == "ends"
                                     else first_home_bytes(shard_bytes))
        if "device" in args.placements:  # the middle shards' fp32 gradients, and a step's master and moments (12
            budget += args.models * sum(shard_bytes[1:-1]) + 3 * max(shard_bytes) + 65536  # bytes a parameter)
    if args.cache_all:
        budget += int(args.models * sum(shard_bytes) * copied)
    runs = [(ratio, placement) for ratio in args.ratios for placement in args.placements]
    placements.clear()
    rows = {run: [] for run in runs}
    extra = {run: [] for run in runs}
    bandwidth = {}
    for _ in range(args.rounds):
        base = train(args, data, budget)
        compute = sum(e.end - e.start for e in base.trace) / args.devices  # spread evenly at best
        forward = block_forward_seconds(base, len(shard_bytes))
        for ratio, placement in runs:
            # Fixed after the first round, so that every round copies at the same pace.
            bandwidth.setdefault(ratio, block_bytes / (ratio * forward))
            results = train(args, data, budget, bandwidth[ratio], placement)
            # Each device's link is its own; the host's memory is one lane for them all.
            host_bytes = sum(s["host_step_bytes"] for s in results.stats)
            host_lane = host_bytes / (args.host_speed * bandwidth[ratio]) if args.host_speed else 0.0
            lanes = max(compute, max(s["host_to_device_bytes"] for s in results.stats) / bandwidth[ratio],
                        max(s["device_to_host_bytes"] for s in results.stats) / bandwidth[ratio], host_lane)
            forecast = lane_forecast(base, results, args, shard_bytes, bandwidth[ratio])
            # A forecast of a run whose task was placed again mid-run is of another run: none is reported.
            again = placed_again(results)
            in_room = (lane_forecast(base, results, args, shard_bytes, bandwidth[ratio], in_room=True)["span"]
                       if args.forecast and results.lane_plan is not None and not again else float("nan"))
            # The longest task's own chain at these rates: its units one after another, and at each step boundary
            # what its host steps' round trips (one after another on the host lane) add beyond the units that can
            # run meanwhile.
            bound = max(lanes, forecast["bound"]["chain"])
            took = span(results)
            extra[ratio, placement].append(extra_by_kind(base, results, len(shard_bytes)))
            waits = [sum(s[key] for s in results.stats) / args.devices
                     for key in ("acquire_wait_seconds", "grad_wait_seconds")]
            rows[ratio, placement].append((took / bound, waits[0] / took, waits[1] / took, compute,
                                           sum(s["host_to_device_bytes"] for s in results.stats) / bandwidth[ratio],
                                           took, float("nan") if again else forecast["span"] / took,
                                           took / lanes,
                                           sum(s["device_to_host_bytes"] for s in results.stats) / bandwidth[ratio],
                                           in_room / took))
    prefetch = "as far as it allows" if args.far else "next"
    cached = ", room for every weight cached" if args.cache_all else ""
    host = f"at {args.host_speed:g}x the link" if args.host_speed else "unpaced"
    print(f"{args.devices} device(s), {args.models} spilled GPT-2 model(s) of {sum(shard_bytes) / 4e6:.2f}M params "
          f"in {len(shard_bytes)} shards, {args.steps} steps of {args.batch}x{args.seq} tokens, budget {budget} "
          f"bytes (one shard's weights and gradients and {args.ahead} more's weights), prefetch {prefetch}, "
          f"{args.commit} units committed, clipping {args.clip}, {args.precision or 'fp32'}{cached}, host memory "
          f"{host}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"medians of {args.rounds} interleaved rounds")
    for placement, got in placements.items():
        print(f"placement {placement!r}: " + "; ".join(got))
    print("| copy / forward | placement | bandwidth (bytes/s) | compute s | copies in s | copies out s | span s | "
          "span / lanes | span / bound | span / host's | waiting for weights | waiting for gradient room |" +
          (" forecast / span | in room / span |" if args.forecast else ""))
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.forecast else ""))
    for (ratio, placement), measured in rows.items():
        med = [statistics.median(r[i] for r in measured) for i in range(10)]
        if any(math.isnan(r[6]) for r in measured):
            med[6] = float("nan")  # a round placed a task again mid-run
        host = rows.get((ratio, "host"))
        # Per round, then the median: the rounds interleave, so each ratio compares runs made side by side.
        versus = (statistics.median(r[5] / h[5] for r, h in zip(measured, host)) if host else float("nan"))
        print(f"| {ratio:g} | {placement} | {bandwidth[ratio]:.3g} | {med[3]:.2f} | {med[4]:.2f} | {med[8]:.2f} | "
              f"{med[5]:.2f} | {med[7]:.2f} | {med[0]:.2f} | {versus:.2f} | {100 * med[1]:.0f}% | "
              f"{100 * med[2]:.0f}% |" +
              ((" re-placed mid-run | - |" if math.isnan(med[6]) else f" {med[6]:.2f} | {med[9]:.2f} |")
               if args.forecast else ""))
    if args.by_unit:
        print("\nSeconds each kind of unit took beyond memory speed, summed over the run (medians of the rounds), "
              "largest first:")
        for (ratio, placement), measured in extra.items():
            kinds = {kind: statistics.median(run.get(kind, 0.0) for run in measured) for kind in measured[0]}
            ranked = sorted(kinds.items(), key=lambda item: -item[1])
            print(f"- copy / forward {ratio:g}, {placement}: " +
                  ", ".join(f"{kind} {seconds:.3f}" for kind, seconds in ranked))


if __name__ == "__main__":
    main()
