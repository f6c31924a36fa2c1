"""One task's training, executed unit by unit wherever the scheduler sends it.

A micro-batch is 2n-1 units for n shards: forward F(0)..F(n-2) under no_grad, keeping each shard's input
and the RNG state it started with; FB(n-1), the last shard's forward, loss and backward (never
recomputed); then backward B(n-2)..B(0), each re-running its shard's forward from the saved input with the
same RNG state (so dropout draws the same mask) and back-propagating the gradient handed down from the
shard above. Units of one task run in order, one at a time, but may run on different devices: boundary
tensors follow the task. Memory and copies are the device engine's: one native call per shard visit.

An evaluation pass, between two steps, is E(0)..E(n-1) per validation batch (see hydra_torch.run.evaluation).
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_map

from hydra_torch._loader import native as _C
from hydra_torch.models import sharding
from hydra_torch.models.batch_tree import to_device
from hydra_torch.models.first_batch import own_generators
from hydra_torch.models.hf.adapter import check_drawn_batch
from hydra_torch.recipe import schedules
from hydra_torch.run.compute import NonFiniteGradNormError, NonFiniteLossError, floating
from hydra_torch.run import units
from hydra_torch.run.evaluation import EvalPass
from hydra_torch.run.micro_batch import MicroBatch
from hydra_torch.run.steps import count_micro_batches, eval_steps, step_groups, step_sizes
from hydra_torch.state.task_rng import TaskRng
from hydra_torch.task import ModelTask

FORWARD, FORWARD_BACKWARD, BACKWARD = _C.Phase.forward, _C.Phase.forward_backward, _C.Phase.backward
EVALUATE = _C.Phase.evaluate


def shard_buffers(groups) -> list[list[tuple]]:
    """Per shard, its modules' buffers as (module, name): they follow the task to each device it runs on."""
    return [[(m, name) for module in group for m in module.modules() for name, b in m._buffers.items()
             if b is not None] for group in groups]


class TaskRunner:
    def __init__(self, task: ModelTask, index: int, start_rng: TaskRng):
        self.task = task
        self.index = index
        self.n = task.num_shards
        self.compute_dtype = task.compute_dtype
        self.model_ids: dict[int, int] = {}   # device slot -> the task's id in that device's engine
        self.store = None                     # its _C.ShardStore, once placed
        self.base = None                      # the HeldBase holding its frozen base weights (run/bases.py), if any
        self.resident = False                 # its whole training state lives on one device
        self.resident_shards: list[int] = []  # the shards whose whole state lives there (a spilled task's ends)
        self.device_shards: list[int] = []    # a spilled task's shards stepped on the device
        self.placed_after = 0                 # how many tasks had left the run when its placement was last decided
        self.result = None                    # its TaskResult, once it has left the run
        self.home: int | None = None          # the slot it is pinned to: its resident state's, or after a re-plan
                                              # the only device with room for it; None: any device
        # Resident weights never move, so forward can keep each shard's autograd graph and backward need
        # not recompute it (as plain PyTorch). Spilled weights leave the device: graphs would point at
        # reused memory, so forward keeps only inputs and backward recomputes.
        self.keep_graphs = False
        self.losses: list[float] = []
        self.steps = 0
        task.steps_done = 0
        self.epochs_done = 0
        self.error: BaseException | None = None
        self.cut_short: str | None = None     # why it stopped at a step boundary before its last step
        self.stopped: str | None = None       # why a selection rule stopped it (see hydra_torch.selection.rules)
        self.selection = None                 # the run's selection rule, told of every step and evaluation
        self.eval_losses: list[tuple[int, float]] = []  # (steps taken, mean validation loss)
        self.rung_reports: list[tuple[int, float]] = []  # (rung, metric) the selection rule judged it on
        self.eval_at = eval_steps(task)
        self._eval: EvalPass | None = None
        self.on_step = None                   # called after each optimizer step (progress bars)
        self.epoch_rng: torch.Tensor | None = None  # the CPU generator's state when the current epoch began
        self.epoch_loader: list[torch.Tensor] = []  # and the data loader's own generators' (see step_groups)
        self._groups = step_groups(task, self._epoch_began)
        self._group, self._position, self._epoch_end, self._loss_sum = None, 0, False, 0.0
        self.mb: MicroBatch | None = None
        self._stepped: list[int] = []         # shards whose part of the current step has been applied
        self._clipped = None                  # (norm reading, micro-batches) of a clipped step not yet settled
        self._step_rng, self._step_buffers = None, []  # at the current step's start (see rewind_step)
        self.replans: list[str] = []          # how it was re-cut after running out of device memory
        self._lr_at = schedules.multipliers(task.lr_schedule, task.warmup_steps, task.total_steps)
        self._lr_scale = 1.0                  # the schedule's multiplier for the current step
        # Its own random streams, starting where the run's did: as if it trained alone from the same seed.
        self._rng = TaskRng(*start_rng.snapshot())
        self.shard_buffers = shard_buffers(task.modules)
        self.changed_buffers: dict[int, list] = {}  # shard -> (module, name) its forward changed (units.forward)

    def _epoch_began(self, state, loader_states):
        self.epoch_rng, self.epoch_loader = state, loader_states

    def resume(self, steps: int, losses: list[float], epochs_done: int, rng: TaskRng, epoch_rng,
               eval_losses=(), stopped: str | None = None, rung_reports=(), loader=(), epoch_loader=()):
        """Continues after `steps` steps taken by an earlier run, from its checkpoint; a task a selection
        rule had stopped stays stopped. `loader`: the states the data loader's own generators had then (they
        draw its order outside the task's streams: at their seeds again after a crash, moved on in the same
        process)."""
        for generator, state in zip(own_generators(self.task.data), loader):
            generator.set_state(state)
        self.steps, self.losses, self.epochs_done = steps, list(losses), epochs_done
        self.task.steps_done = steps
        self.eval_losses = [(int(step), float(loss)) for step, loss in eval_losses]
        self.stopped = stopped
        self.rung_reports = [(int(rung), float(metric)) for rung, metric in rung_reports]
        self._rng = rng
        self.epoch_rng = epoch_rng
        self.epoch_loader = list(epoch_loader)
        self._groups = step_groups(self.task, self._epoch_began, steps, epoch_rng, self.epoch_loader)

    def scheduler_spec(self) -> tuple:
        """What the scheduler plans the rest of the task from, at a step boundary (as cut now, after the steps
        taken): (shards, micro-batches, device, shard costs, micro-batches after which an evaluation pass runs,
        batches per pass, the frozen base it shares or -1). Shard costs rank tasks nothing has been timed of yet by
        their size, not as if all were alike."""
        base = self.base.group if self.base is not None else -1
        shard_costs = sharding.shard_costs(self.task.modules)
        if self.stopped:  # by a selection rule, in an earlier run or as this one resumed it
            return self.n, 0, self.home, shard_costs, [], 0, base
        evaluated = {step for step, _ in self.eval_losses}
        pending = [k for k in self.eval_at if k > self.steps or (k == self.steps and k not in evaluated)]
        cumulative = [0]
        for size in step_sizes(self.task):
            cumulative.append(cumulative[-1] + size)
        after = [cumulative[k] - cumulative[self.steps] for k in pending]
        batches = len(self.task.eval_data) if after else 0
        return self.n, count_micro_batches(self.task, self.steps), self.home, shard_costs, after, batches, base

    @property
    def rng(self) -> TaskRng:
        return self._rng

    def run_unit(self, unit, slot):
        """Runs one unit on `slot`: its shard is acquired (`slot.loop.begin`) where its compute starts, once its
        inputs are on their way; the worker ends the visit. Returns what the loop's end reports: the shard's
        backward (a _C.BackwardDone), or None."""
        device, s = slot.device, unit.shard
        self._place_buffers(s, device)
        if unit.phase == EVALUATE:
            self._evaluate(unit, slot)
        elif unit.phase == FORWARD:
            if s == 0:
                self._begin_micro_batch(device)
            units.forward(self, unit, slot)
        elif unit.phase == FORWARD_BACKWARD:
            if self.n == 1:
                self._begin_micro_batch(device)
            units.forward_backward(self, unit, slot)
            return self.backward_report()
        else:
            units.backward(self, unit, slot)
            return self.backward_report()
        return None

    def unit_ended(self, unit, slot, backward):
        """After the loop's end: the shard's step is queued (`backward.step`), and the micro-batch ends with
        its last backward unit."""
        if backward is not None and backward.step:
            self._stepped.append(unit.shard)
        if (unit.phase == FORWARD_BACKWARD and self.n == 1) or (unit.phase == BACKWARD and unit.shard == 0):
            self._end_micro_batch(slot)

    def at_step_boundary(self) -> bool:
        """No step in progress: every shard has had the same number of steps applied."""
        return self.mb is None and self._eval is None and self._clipped is None and \
            (self._group is None or self._position == len(self._group))

    def note_partial_step(self, error: BaseException):
        """After a failure inside a step's backward: says which shards that step had already reached."""
        if self._stepped and len(self._stepped) < self.n and hasattr(error, "add_note"):
            error.add_note(f"task {self.task.name!r}: step {self.steps + 1} had been applied to shards "
                           f"{sorted(self._stepped)} only; the other shards' weights are one step behind")

    @contextmanager
    def random_streams(self, key, device, start=None, save=True):
        """The task's own generators for the block (see task_rng)."""
        with self._rng.cpu_section(key, start, save), self._rng.on_device(device, start, save):
            yield

    # -- micro-batches and steps -------------------------------------------------------------------------------
    def _begin_micro_batch(self, device):
        if self._group is None or self._position == len(self._group):
            with self.random_streams(None, device):  # a shuffled loader draws its order
                epoch, self._group, self._epoch_end = next(self._groups)
            self._epoch = epoch
            self._position, self._loss_sum = 0, 0.0
            # Before any of the step's work: a schedule that fails stops the task with no step half-done.
            self._lr_scale = schedules.multiplier_at(self._lr_at, self.steps, self.task.name)
            # Where a retry of the step starts from (see rewind_step): its random streams and its buffers.
            self._step_rng = self._rng.snapshot()
            self._step_buffers = [(m, name, m._buffers[name], m._buffers[name]._version)
                                  for shard in self.shard_buffers for m, name in shard]
        with self.random_streams(None, device):  # a dataset may augment
            batch = self._group[self._position]
            check_drawn_batch(self.task.adapter, batch)
            batch = to_device(batch, device)
            self._position += 1
            x = self.task.inputs(batch)
        if self.compute_dtype != torch.float32:
            x = tree_map(lambda t: t.to(self.compute_dtype) if floating(t) else t, x)
        self.mb = MicroBatch(batch, x, len(self._group), self._position == len(self._group))

    def _end_micro_batch(self, slot):
        mb = self.mb
        # Read only now, with the whole backward issued: the device never waited for the host to see the loss.
        mb.let_go()
        value = mb.loss.value()
        if not math.isfinite(value):
            self._stepped = []  # every shard's step read the same gate and was skipped
            raise NonFiniteLossError(f"task {self.task.name!r}: the loss is {value} at step {self.steps}; "
                                     "training stopped and the weights of the last completed step were kept")
        self._loss_sum += value
        self.mb = None
        if not mb.last:
            return
        self._stepped = []
        if self.task.clip_grad_norm is not None:
            # The norm is summed and every shard stepped behind the gradients' host jobs, while the device goes on
            # with other work; the step counts once its norm is read (settle_step), before the task goes on.
            self._stepped = list(range(self.n))  # from here on the step may be applied in part
            norm = slot.engine.clip_and_step(self.model_ids[slot.index], float(self.task.clip_grad_norm),
                                             self._lr_scale)
            self._clipped = (norm, mb.count)
            return
        self._step_done(mb.count)

    def settle_step(self):
        """Before anything else of the task runs: waits for the norm of its queued clipped step and counts the
        step. A non-finite norm raises NonFiniteGradNormError: no shard stepped, the weights are the last
        completed step's."""
        if self._clipped is None:
            return
        norm, count = self._clipped
        try:
            value = norm.value()
        except Exception:  # the norm could not be taken (a host job failed): no shard stepped either
            self._clipped, self._stepped = None, []
            raise
        # Cleared before counting: a Ctrl-C during on_step must not let the step be counted twice.
        self._clipped, self._stepped = None, []
        if not math.isfinite(value):
            raise NonFiniteGradNormError(f"task {self.task.name!r}: the gradient norm is {value} at step "
                                         f"{self.steps}; training stopped and the weights of the last completed "
                                         "step were kept")
        self._step_done(count)

    def settle_at_end(self):
        """At the task's end (its last unit run, or the run stopped): settle_step, then, if it took its last step,
        the check that its last epoch had no batch beyond len(data); their error kept in self.error."""
        try:
            self.settle_step()
            self._check_data_ended()
        except Exception as error:
            self.error = self.error or error

    def _check_data_ended(self):
        # step_groups checks an epoch's length as it is resumed after the epoch's last step: after the task's
        # last step no step resumes it, so its end does.
        if self._epoch_end and self.steps == self.task.total_steps:
            with self._rng.cpu_section(None):  # as every read of its data
                next(self._groups, None)

    def _step_done(self, count: int):
        self.steps += 1
        self.task.steps_done = self.steps
        self.losses.append(self._loss_sum / count)
        if self._epoch_end:
            self.epochs_done = self._epoch + 1
        if self.on_step is not None:
            self.on_step(self)
        if self.selection is not None:
            self.selection.after_step(self)

    def why_no_retry(self) -> str | None:
        """Why the step in progress cannot be run again from its start (see rewind_step), or None."""
        if self._stepped:
            return f"step {self.steps + 1} had been applied to shards {sorted(self._stepped)} already"
        in_step = self.mb is not None or (self._group is not None and self._position < len(self._group))
        for module, name, tensor, version in self._step_buffers if in_step else ():
            now = module._buffers[name]
            if now is not tensor and not (now.shape == tensor.shape and torch.equal(now.cpu(), tensor.cpu())) \
                    or now is tensor and now._version != version:
                return f"step {self.steps + 1} had changed buffer {name!r} (running statistics, say) of {module}"
        return None

    def rewind_step(self):
        """Back to the last step boundary, so that the step in progress (or the evaluation pass) runs again
        from its start as it would have the first time: the same batches and random draws, no gradient kept."""
        in_step = self.mb is not None or (self._group is not None and self._position < len(self._group))
        if self.mb is not None:
            self.mb.let_go()
        self.mb, self._eval, self._stepped = None, None, []
        if in_step:
            self._position, self._loss_sum = 0, 0.0
            self._rng.cpu, self._rng.cuda = self._step_rng

    def recut(self, groups):
        """Re-cuts the task into the shards `groups` (its state is in no engine now): the chain is planned again
        from the last step boundary."""
        task = self.task
        task.modules = groups
        task.shard_params = sharding.shard_parameters(groups)
        self.n = task.num_shards
        self.shard_buffers = shard_buffers(groups)
        self.changed_buffers = {}
        self._rng.draws = {}  # keyed by shard: which sections draw from the CPU generator
        self.model_ids, self.home, self.resident, self.keep_graphs = {}, None, False, False
        self.resident_shards, self.device_shards = [], []

    def discard_unfinished_step(self, engines):
        """After a failure: the gradients of a step that will never complete must not linger."""
        for slot_index, model_id in self.model_ids.items():
            engines[slot_index].discard_grads(model_id)

    # -- units -------------------------------------------------------------------------------------------------
    def backward_report(self):
        """What the loop's end tells the engine of the shard's backward: whether the step follows (the
        micro-batch's last, unless clipping steps every shard at once), at the schedule's rate; with clipping
        and one micro-batch a step, the gradient waits for the norm as it landed (bf16: 2 bytes); with clipping,
        whether clip_and_step follows (the step's last micro-batch)."""
        clipped = self.task.clip_grad_norm is not None
        return _C.BackwardDone(step=self.mb.last and not clipped, lr_scale=self._lr_scale,
                               keep=clipped and self.mb.count == 1, clip_follows=clipped and self.mb.last)

    def _evaluate(self, unit, slot):
        """E(s) of validation batch unit.micro_batch (see hydra_torch.run.evaluation)."""
        if unit.shard == 0 and unit.micro_batch == 0:
            self._eval = EvalPass(self)
        mean = self._eval.run(self, unit, slot)
        if mean is None:
            return
        self._eval = None
        self.eval_losses.append((self.steps, mean))
        if self.selection is not None:
            self.selection.after_evaluation(self)

    def _place_buffers(self, s, device):
        for module, name in self.shard_buffers[s]:
            buffer = module._buffers[name]
            if buffer.device != device:
                module._buffers[name] = buffer.to(device)

    def restore_buffers(self):
        for shard in self.shard_buffers:
            for module, name in shard:
                module._buffers[name] = module._buffers[name].cpu()
