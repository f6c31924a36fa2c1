"""How each kind of unit computes for a task (hydra_torch.run.runner.TaskRunner): its shard's forward, the last
shard's forward, loss and backward, and a backward that re-runs its shard's forward first. Each acquires its shard
(`slot.loop.begin`) where its compute starts, once its inputs are on their way."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

from hydra_torch.models.batch_tree import to_device
from hydra_torch.models.saved_tensors import saved_tensors
from hydra_torch.run.compute import (check_handed_on, check_loss, floating, in_place_refused, input_grads,
                                     input_versions, requiring_grad, run_shard)
from hydra_torch.run.saved_bytes import tensor_bytes


def forward(runner, unit, slot):
    """F(s): the shard's forward without gradients (a resident task keeps its graph), its input kept for the
    backward's recompute."""
    mb, s = runner.mb, unit.shard
    x = to_device(mb.x, slot.device)
    if runner.keep_graphs and s > 0:
        x = requiring_grad(x)
    slot.loop.begin(unit)
    mb.rng[s] = runner.rng.snapshot()
    modules, name = runner.task.modules[s], runner.task.name
    graph, weights = [], [p for m in modules for p in m.parameters()] if runner.keep_graphs else []
    versions = input_versions(x)
    watched = _buffers_before(runner, s) if not runner.keep_graphs else []
    with runner.random_streams(("forward", s), slot.device), torch.set_grad_enabled(runner.keep_graphs), \
            saved_tensors(graph, weights):
        with in_place_refused(name, s, modules):
            y = run_shard(modules, x)
    check_handed_on(name, s, modules, runner.task.shard_params[s], versions, y)
    if watched:
        mb.buffers[s] = _changed(runner, s, watched)
    mb.saved[s] = (x, y) if runner.keep_graphs else x
    nbytes = tensor_bytes((x, graph))
    slot.saved.charge(nbytes)
    mb.held[s] = (slot.saved, nbytes)
    mb.x = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, y) if runner.keep_graphs else y


def forward_backward(runner, unit, slot):
    """FB(n-1): the last shard's forward, the loss and its backward; the loss becomes the gate of the step."""
    engine, mid, mb = slot.engine, runner.model_ids[slot.index], runner.mb
    x_in = requiring_grad(to_device(mb.x, slot.device))
    mb.x = None
    if mb.held:  # what one micro-batch holds, now that its forwards are done: the scheduler's gate learns it
        slot.scheduler.set_saved_bytes(runner.index, sum(nbytes for _, nbytes in mb.held.values()))
    slot.loop.begin(unit, runner.backward_report().step)
    # The task's streams go on from where this forward and loss leave them: a backward's recompute
    # replays a forward's draws and must not advance them.
    with runner.random_streams(("forward_backward",), slot.device), torch.enable_grad():
        with in_place_refused(runner.task.name, runner.n - 1, runner.task.modules[runner.n - 1]):
            loss = last_shard_loss(runner, x_in, to_device(mb.batch, slot.device))
        check_loss(loss, runner.task.name)
        # The gate of this micro-batch's steps (a non-finite loss skips them on every shard).
        mb.loss = engine.watch_loss(mid, loss)
    (loss / mb.count).backward()
    mb.grad = input_grads(x_in)


def last_shard_loss(runner, x_in, batch):
    """The last shard's forward and the loss. Its output is dropped on return, before the backward: the
    graph keeps only what it saved (the logits, cast to fp32 for a bf16 model, would stay alive otherwise)."""
    out = run_shard(runner.task.modules[runner.n - 1], x_in)
    if runner.compute_dtype != torch.float32:
        out = tree_map(lambda t: t.float() if floating(t) else t, out)
    return runner.task.loss_fn(out, batch)


def backward(runner, unit, slot):
    """B(s): the shard's forward again from its saved input, with the same random draws, and its backward."""
    mb, s = runner.mb, unit.shard
    saved = mb.saved.pop(s)
    mb.let_go(s)
    grad = to_device(mb.grad, slot.device)
    slot.loop.begin(unit, runner.backward_report().step)
    rng = mb.rng.pop(s)
    with torch.enable_grad():
        if runner.keep_graphs:
            x_in, y = saved
        else:
            x_in = requiring_grad(to_device(saved, slot.device))
            # The forward already updated running statistics (BatchNorm); re-running it must not. The
            # recompute gets throw-away copies (not restored in place: autograd saved what it used), of the values
            # the forward read where it changed them (a power iteration reads its vector, then updates it).
            before = mb.buffers.pop(s, {})
            originals = [(m, name, m._buffers[name]) for m, name in runner.shard_buffers[s]]
            for m, name, buffer in originals:
                read = before.get((id(m), name))
                m._buffers[name] = read.to(buffer.device) if read is not None else buffer.clone()
            try:
                with runner.random_streams(("forward", s), slot.device, start=rng, save=False):
                    y = run_shard(runner.task.modules[s], x_in)
            finally:
                for m, name, buffer in originals:
                    m._buffers[name] = buffer
        outputs, _ = tree_flatten(y)
        pairs = [(o, g) for o, g in zip(outputs, grad) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    mb.grad = input_grads(x_in) if s > 0 else None


def _buffers_before(runner, s: int) -> list:
    """(module, name, buffer, version, copy) of what the shard's forward may change: every buffer on its first
    forward, then those it changed then (runner.changed_buffers), copied as they are before it runs."""
    known = runner.changed_buffers.get(s)
    pairs = runner.shard_buffers[s] if known is None else known
    return [(m, name, m._buffers[name], m._buffers[name]._version, m._buffers[name].clone()) for m, name in pairs]


def _changed(runner, s: int, watched: list) -> dict:
    """The values before the forward of the buffers it changed, by (id(module), name); learns which those are."""
    changed = [(m, name, copy) for m, name, buffer, version, copy in watched
               if m._buffers[name] is not buffer or buffer._version != version]
    runner.changed_buffers.setdefault(s, [(m, name) for m, name, _ in changed])
    return {(id(m), name): copy for m, name, copy in changed}
