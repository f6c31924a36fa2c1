"""A task still training placed again once another has left the run (in every call a task's engines let it go as
it ends: hydra_torch.selection.arrivals.OpenRun.ended): the room its homes and resident state held, and the lanes its
steps loaded, are free. At the task's next step boundary, on the worker about to run its next unit, its shards are
chosen as a task joining the run would have them (hydra_torch.run.moving.added_shards: the lane model for "auto",
every untied shard for "device"), and where that differs from where they step now, and the lane model forecasts a
gain over the task's steps left larger than the move's cost (hydra_torch.run.lane_choice.move_pays), the task is
taken off every engine and added back so (hydra_torch.run.moving): its state, home in the store between its steps,
is not touched, so it trains on exactly as it would have. The cached weights go with the old registration: their
next copies in cost one step's worth of the link.

Only a task that keeps nothing on the devices between its steps moves: spilled, without resident shards (the sized
arena takes no home) or a frozen base, every backward followed by its step, no tied weight stepped on the device (its
owner keeps a gradient buffer for the run), held by every device."""
from __future__ import annotations

from hydra_torch.run import lane_choice, moving
from hydra_torch.state import interrupts
from hydra_torch.state.run_warnings import warn_in_run


def replace_if_due(slot, runner) -> str | None:
    """Places the task again if a task has left since it was last placed and it sits at a step boundary (see the
    module). Returns why it could not be added back, or None: then it trains on, moved or not."""
    run = slot.open_run
    if run is None or runner.placed_after >= run.departures or not runner.at_step_boundary():
        return None
    runner.placed_after = run.departures
    if slot.placement == "host" or not movable(slot, runner):  # "host" steps every shard there, before and after
        return None
    # One read of the room, for the choice and for weighing it (an engine that cannot say its room: no move).
    uncommitted = moving.uncommitted_bytes(moving.on_peers(slot))
    if uncommitted is None:
        return None
    wanted = moving.added_back_shards(slot, runner, runner.store, uncommitted)
    if sorted(wanted) == sorted(runner.device_shards) or not _pays(slot, runner, wanted, uncommitted):
        return None
    was = list(runner.device_shards)
    if slot.checkpoints is not None:
        slot.checkpoints.wait(runner)  # the writer may be reading the store the engines are about to let go
    with interrupts.deferred():  # a second Ctrl-C must not leave the task between two placements
        why_not = moving.take_off(slot, runner)
        if why_not is None:
            why_not = moving.put_back(slot, runner, runner.store, wanted, fallback=was)
    if why_not is not None:
        return f"task {runner.task.name!r} could not be placed again after a task left the run: {why_not}"
    return None


def pin(slot, runner, unit):
    """Tells the scheduler that the task, added back on one device only (moving.put_back: runner.home, where the
    other devices' arenas were taken), trains there alone from the step boundary where it stands: `unit`, its next,
    handed to this worker, is handed out again, to that device."""
    slot.scheduler.restart(slot.index, unit, runner.scheduler_spec())


def movable(slot, runner) -> bool:
    """Whether the task keeps nothing on the devices between its steps and runs on every device (see the module)."""
    return (not runner.resident and not runner.resident_shards and runner.base is None
            and runner.store.steps_after_each_backward and len(runner.model_ids) == len(slot.peers)
            and set(runner.device_shards) <= set(lane_choice.untied_trainable(runner.store)))


def _pays(slot, runner, wanted, uncommitted: list[int]) -> bool:
    """lane_choice.move_pays for the task on this call's devices, in the room their `uncommitted` bytes leave; a lane
    model that fails leaves the task as it is."""
    running = [r for r in slot.runners if r is not runner and r.result is None and r.model_ids]
    try:
        return lane_choice.move_pays(runner, running, uncommitted, slot.placement, slot.lane_plan, wanted)
    except Exception as error:  # noqa: BLE001  (the lane model only informs the placement)
        warn_in_run(f"placement={slot.placement!r} could not weigh moving {runner.task.name!r}'s steps "
                    f"({type(error).__name__}: {error}); it trains on where it is")
        return False
