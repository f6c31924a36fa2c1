"""A training task taken off every engine at its step boundary and added back, spilled: a re-plan's new cut
(hydra_torch.run.replan) or a new placement of its shards (hydra_torch.run.replacement). Every engine's part runs on
its own worker's thread (run/inbox.py); the calling worker runs its own and serves its inbox while it waits."""
from __future__ import annotations

from hydra_torch.run import lane_choice, lifecycle
from hydra_torch.run.inbox import on_devices


def take_off(slot, runner) -> str | None:
    """Takes the task out of every engine: the weights written back into its modules by the device holding them,
    its resident state home, the gradients of a step that did not complete dropped. Returns why that failed, or
    None; either way no engine holds it after (runner.model_ids is empty)."""
    slots = slot.peers
    old_ids, home = runner.model_ids, lifecycle.home_slot(runner)
    holding = [slots[d] for d in old_ids]
    # Every device's own jobs first (they sum into the one store), then the one holding the state writes it back,
    # then each lets it go.
    errors = on_devices(holding, lambda s: s.engine.synchronize(old_ids[s.index]), own=slot)

    def write_back(s):
        model = old_ids[s.index]
        try:
            s.engine.discard_grads(model)  # of a step that failed: it runs again
        finally:
            s.engine.finish(model)  # the weights back in the task's modules, resident state home
    errors += on_devices([slots[home]], write_back, own=slot)
    errors += on_devices(holding, lambda s: s.engine.release_model(old_ids[s.index]), own=slot)
    runner.model_ids = {}  # released, the weights home: until it is added again, nothing is left to bring home
    return f"its state could not be taken off the devices: {errors[0]}" if errors else None


def put_back(slot, runner, store, device_shards: list[int], fallback: list[int] = ()) -> str | None:
    """Adds the task (its state `store`) spilled to every device, stepping `device_shards` on the device; where an
    engine refuses those steps, stepping `fallback` on the device (every step on the host, by default) on every
    device alike (a shard steps in one place whichever device runs its backward). Where some devices' arenas are taken, or their workers have ended, it trains
    on one device with room, this one if it can, pinned there (runner.home). Returns why no device could take it, or
    None."""
    slots = slot.peers

    def add_everywhere(shards):
        ids, stepped = {}, {}

        def add(s):
            model = s.engine.add_model(store, allow_resident=False, task=runner.index,
                                       base=runner.base.ids[s.index] if runner.base is not None else -1,
                                       device_shards=shards)
            if runner.base is not None:
                try:
                    runner.base.attach_model(runner, s.engine, s.index, model)
                except Exception:
                    s.engine.release_model(model)
                    raise
            ids[s.index], stepped[s.index] = model, list(s.engine.device_shards(model))
        return ids, stepped, on_devices(slots, add, own=slot)
    ids, stepped, errors = add_everywhere(device_shards)
    if errors and list(device_shards) != list(fallback):  # no room for the steps after all (the engine's count is
        on_devices([slots[d] for d in ids], lambda s: s.engine.release_model(ids[s.index]), own=slot)  # exact)
        ids, stepped, errors = add_everywhere(list(fallback))
    if not ids:
        return f"no device can take it in {runner.n} shards: {errors[0]}"
    # A task may run on any device only when every device holds it and a worker serves it.
    serving = [d for d in ids if d == slot.index or not slots[d].inbox.closed]
    if not serving:
        on_devices([slots[d] for d in ids], lambda s: s.engine.release_model(ids[s.index]), own=slot)
        return f"no device still training can take it in {runner.n} shards"
    runner.home, runner.resident, runner.resident_shards, runner.keep_graphs = None, False, [], False
    if errors or len(serving) < len(slots):
        keep = slot.index if slot.index in serving else min(serving)
        on_devices([slots[d] for d in ids if d != keep], lambda s: s.engine.release_model(ids[s.index]), own=slot)
        ids = {keep: ids[keep]}
        runner.home = keep
    runner.model_ids = ids
    runner.device_shards = stepped[next(iter(ids))]
    if slot.open_run is not None:  # placed beside the tasks training now (run/replacement.py)
        runner.placed_after = slot.open_run.departures
    return None


def added_shards(runner, store, slots, runners, on_every_device, stacklevel: int = 1,
                 uncommitted: list[int] | None = None) -> list[int]:
    """The shards the task, added to the engines of `slots` (joining the run, or added back), steps on the devices:
    lane_choice.added_or_host, the other tasks of `runners` still training kept as they are. None where it shares a
    frozen base (placed beside the base's other tasks) or sums a bf16 step's micro-batches in its gradient buffers
    (lifecycle.may_keep_ends). `on_every_device(job)` runs job(slot) on each device's worker thread, which alone
    changes its engine's models, and returns the errors raised (its workers gone among them: then none either).
    `uncommitted`: each device's room as the caller read it (uncommitted_bytes), else read here. A warning from
    the lane model points `stacklevel` frames above this function's caller."""
    if runner.base is not None or not lifecycle.may_keep_ends(runner.task):
        return []
    if uncommitted is None:
        uncommitted = uncommitted_bytes(on_every_device)
    if uncommitted is None:
        return []
    running = [r for r in runners if r is not runner and r.result is None and r.model_ids]
    return lane_choice.added_or_host(runner, store, running, uncommitted, slots[0].placement, slots[0].lane_plan,
                                     stacklevel=stacklevel + 1)


def uncommitted_bytes(on_every_device) -> list[int] | None:
    """Each device's DeviceEngine.uncommitted_bytes, in device order, each read on its device's worker thread
    (`on_every_device`, as added_shards'); None where one of them raised."""
    uncommitted = {}
    if on_every_device(lambda s: uncommitted.__setitem__(s.index, s.engine.uncommitted_bytes())):
        return None
    return [uncommitted[i] for i in sorted(uncommitted)]


def added_back_shards(slot, runner, store, uncommitted: list[int] | None = None) -> list[int]:
    """added_shards for a task added back by the worker of `slot` (a re-plan, or placed again)."""
    return added_shards(runner, store, slot.peers, slot.runners, on_peers(slot), stacklevel=2, uncommitted=uncommitted)


def on_peers(slot):
    """added_shards' `on_every_device` for the worker of `slot`: every device of its call, its own job run here."""
    return lambda job: on_devices(slot.peers, job, own=slot)
