"""A task whose unit runs out of device memory is re-planned and retried from its last step boundary, while the
other tasks train on.

A resident task is spilled: its whole training state goes to the host and the device keeps only the shard in
use. A spilled task is cut into shards half the size: a unit then holds fewer weights, gradients and
activations. The task's state (fp32 master weights, optimizer moments and step counts) moves over unchanged,
and the step that failed runs again from its first micro-batch with the same batches and random draws, so the
task ends as an uninterrupted run in its final plan would (bit for bit; within float rounding of the resident
run it started as). Where the step had already been applied to some shards, or had
changed a buffer (running statistics), or the task is one layer per shard already, it stops with the error, as
any failing task does, its weights those of its last complete step.
"""
from __future__ import annotations

import torch

from hydra_torch.models import memory, sharding
from hydra_torch.report.results import shard_list
from hydra_torch.run import lifecycle, moving
from hydra_torch.state import interrupts


def is_out_of_memory(error: BaseException) -> bool:
    """A device allocation failed: CUDA's, or the engine's budget (both raise torch.OutOfMemoryError)."""
    return isinstance(error, torch.OutOfMemoryError)


def retry(slot, unit, runner, error: BaseException) -> bool:
    """Called on `slot`'s worker when `unit` of the task raised `error`, before the scheduler hears of it. True:
    the task was re-planned and the scheduler hands out its step again. False: it fails; where an out-of-memory
    error could not be retried, a note on the error says why."""
    if not is_out_of_memory(error):
        return False
    try:
        why_not = _replan(slot, unit, runner)
    except Exception as failure:  # the re-plan itself failed: the task fails with its out-of-memory error
        why_not = f"the re-plan failed: {type(failure).__name__}: {failure}"
    if why_not is not None:
        if hasattr(error, "add_note"):
            error.add_note(f"task {runner.task.name!r}: not retried after running out of device memory: {why_not}")
        return False
    return True


def _replan(slot, unit, runner) -> str | None:
    """Re-plans the task and hands its step to the scheduler again; returns why it could not, or None."""
    why_not = runner.why_no_retry()
    if why_not is not None:
        return why_not
    groups = runner.task.modules if runner.resident else sharding.halved(runner.task.modules)
    if groups is None:
        return "every shard is a single layer already"
    if groups is not runner.task.modules and runner.base is not None:
        return f"it shares {runner.task.base!r}, which is cut as its other tasks are"
    if groups is not runner.task.modules:
        try:  # the new plan's state is made beside the old one's, which is freed once it has been copied
            memory.check_host_memory([runner.task])
        except MemoryError as refused:
            return f"a copy of its state in smaller shards would not fit in host memory: {refused}"
    if slot.checkpoints is not None:
        slot.checkpoints.wait(runner)  # the writer may be reading the state about to move
    was = "resident" if runner.resident else f"spilled in {runner.n} shards" + (
        f", {shard_list(runner.resident_shards)} resident" if runner.resident_shards else "") + (
        f", {shard_list(runner.device_shards)} stepped on the device" if runner.device_shards else "")
    # Where the task kept shards on the device between steps or stepped them there, that state may be what ran
    # short: its new plan steps every shard on the host. A resident task spilled, or one stepped all on the host and
    # cut finer, steps on the device what a task joining the run would.
    off_host = runner.resident or not (runner.resident_shards or runner.device_shards)
    with interrupts.deferred():  # a second Ctrl-C must not leave the task between two plans
        why_not = _move(slot, runner, groups, off_host)
    if why_not is not None:
        return why_not
    where = f" on device {runner.home} only" if runner.home is not None and len(slot.peers) > 1 else ""
    runner.replans.append(f"step {runner.steps + 1}: out of device memory in {_unit_name(unit)} on device "
                          f"{slot.index} ({slot.device}, {was}); retried spilled in {runner.n} shards{where}")
    slot.scheduler.restart(slot.index, unit, runner.scheduler_spec())
    return None


def _unit_name(unit) -> str:
    return f"{str(unit.phase).rsplit('.', 1)[-1]} of shard {unit.shard}"


def _move(slot, runner, groups, off_host: bool) -> str | None:
    """Takes the task out of every engine, re-cuts it into `groups` with its state carried over and adds it back,
    spilled, to every device, stepping on the device what a task joining the run would where `off_host`, else
    every shard on the host. Returns why that failed, or None."""
    why_not = moving.take_off(slot, runner)
    if why_not is not None:
        return why_not
    old = runner.store
    same_shards = groups is runner.task.modules
    runner.rewind_step()
    runner.recut(groups)
    if same_shards:  # a resident task spilled: its store (masters, states, bf16 shadow) is up to date since finish
        store = old
    else:
        store = lifecycle.make_store(runner, old.pinned)
        _carry_state(old, store)
        del old
    return moving.put_back(slot, runner, store, moving.added_back_shards(slot, runner, store) if off_host else [])


def _carry_state(old, new):
    """The optimizer's state, parameter by parameter: master weights, moments and step counts."""
    before = {id(param): (master, states, steps) for param, master, states, steps in old.param_states()}
    for param, master, states, _ in new.param_states():
        old_master, old_states, steps = before[id(param)]
        master.copy_(old_master)
        for state, old_state in zip(states, old_states):
            state.copy_(old_state)
        new.set_param_steps(param, steps)
    new.set_steps_taken(old.steps_taken(0))
    new.refresh_shadow()
