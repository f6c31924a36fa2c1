"""A FrozenBase in a run: its weights held once on the host (one ShardStore of frozen weights, cut as its tasks
are) and registered with every engine as a base (DeviceEngine.add_base), which each task's model then uses
(DeviceEngine.use_base): a unit of the task holds the base's shard beside its own, copied in once for all of
them while it stays cached.

Outside their units the tasks' own parameters of the base point at one host tensor per weight (in its own
dtype: views of the fp32 master for an fp32 model), so the copies the tasks were built with are freed."""
from __future__ import annotations

from hydra_torch._loader import native as _C
from hydra_torch.models import frozen_base, planner


class HeldBase:
    def __init__(self, base, members, pin: bool):
        frozen_base.check_cuts([runner.task for runner in members])
        first = members[0].task
        self.base = base
        self.members = list(members)
        # The first task's tensors, detached (a tied weight once): what the store copies its values from.
        detached = {}
        shards = [[detached.setdefault(id(p), p.detach()) for p in shard if id(p) in first.base_weights]
                  for shard in first.shard_params]
        self.store = _C.ShardStore(shards, first.optimizer.spec(), first.precision == "bf16", pin)
        name_of = {id(t): first.base_weights[key] for key, t in detached.items()}
        self.layout = [[name_of[id(t)] for t in self.store.layout_params(s)] for s in range(len(shards))]
        self.values = {}
        for param, master, _states, _steps in self.store.param_states():
            self.values[name_of[id(param)]] = master if param.dtype == master.dtype else master.to(param.dtype)
        for t in detached.values():  # they share the first task's storage, which must go with its parameters'
            t.data = self.values[name_of[id(t)]]
        self.ids: dict[int, int] = {}  # device slot -> its id in that device's engine
        for runner in self.members:
            runner.base = self

    @property
    def group(self) -> int:
        """Which base it is to the scheduler (TaskSpec::base): its id on the first device, unique there."""
        return self.ids[0]

    def register(self, engines):
        """Adds the base to every engine, before any task: it has the same id in each (place_models' `bases`)."""
        self.ids = {slot: engine.add_base(self.store) for slot, engine in enumerate(engines)}
        if len(set(self.ids.values())) != 1:
            raise RuntimeError(f"{self.base!r} was given ids {self.ids} by the engines: bases go in first")

    def admit(self, runner):
        """A task arriving in the running call joins the base: cut as its tasks are, its weights checked equal to
        the base's (ValueError naming the difference otherwise)."""
        first = self.members[0].task
        if runner.task.auto_shards:
            planner.cut_like(runner.task, first)
        # Against the base's host copy: its tasks' own parameters may point at a device's copy, or at arena
        # memory that copy has left, while the run goes on.
        frozen_base.check_task(self.base, runner.task, first, self.values)
        frozen_base.check_cuts([first, runner.task])
        self.members.append(runner)
        runner.base = self

    def attach(self, runner, engines):
        """Makes the task's models on `engines` use the base, and points its base parameters at the host copy."""
        for slot, model in runner.model_ids.items():
            self.attach_model(runner, engines[slot], slot, model)
        self.point_home(runner)

    def attach_model(self, runner, engine, slot: int, model: int):
        engine.use_base(model, self.ids[slot], self._params_of(runner))

    def point_home(self, runner):
        """The task's base parameters back on the host copy (after a unit left them on a device's)."""
        for name, param in frozen_base.weights_by_name(runner.task).items():
            param.data = self.values[name]

    def summary(self, engines) -> dict:
        """What Results.bases says of it: its tasks, its host bytes and the bytes copied of it to the devices."""
        loads = [sum(column) for column in zip(*(engines[slot].shard_loads(i) for slot, i in self.ids.items()))]
        element = 2 if self.members[0].task.precision == "bf16" else 4
        copied = sum(n * self.store.device_numel(s) * element for s, n in enumerate(loads))
        return {"tasks": [runner.task.name for runner in self.members], "host_bytes": self.store.host_bytes,
                "copied_bytes": copied}

    def _params_of(self, runner) -> list[list]:
        """The task's own parameters of each base shard, in the order of its layout."""
        by_name = frozen_base.weights_by_name(runner.task)
        return [[by_name[name] for name in shard] for shard in self.layout]


def hold(runners, engines, pin: bool) -> list[HeldBase]:
    """Each base of the runners' tasks held and registered with the engines; every member runner's `base` set."""
    groups: dict[int, list] = {}
    for runner in runners:
        if runner.task.base is not None:
            groups.setdefault(id(runner.task.base), []).append(runner)
    held = []
    for members in groups.values():
        base = HeldBase(members[0].task.base, members, pin)
        base.register(engines)
        held.append(base)
    return held


def held_for(runners, task) -> HeldBase | None:
    """The run's HeldBase that an arriving task of a base joins, or None where it is the run's first of its base
    (then checked alone). Raises ValueError for another base of the same name in the run."""
    held = {id(r.base): r.base for r in runners if r.base is not None}.values()
    for base in held:
        if base.base is task.base:
            return base
        if base.base.name == task.base.name:
            raise ValueError(f"task {task.name!r} cannot join the run: another FrozenBase named {task.base.name!r} "
                             "is in it (checkpoints and results tell bases by name)")
    frozen_base.check([task])
    return None


def own_params(task) -> list[list]:
    """The task's shard parameters less those its base holds: what its own ShardStore holds."""
    return [[p for p in shard if id(p) not in task.base_weights] for shard in task.shard_params]
