"""Model selection inside a run: rules that stop the worse tasks early so the better ones get their devices.

    ht.train(tasks, selection=ht.SuccessiveHalving(min_steps=20, reduction_factor=3))

A task the rule stops ends at that step boundary, at once: the scheduler drops its remaining units, so the
devices go to the tasks still running, and its shards, planned for no visit any more, are the first evicted
from device memory. Its result says when and why (`TaskResult.stopped`); its weights are those of that step.
"""
from __future__ import annotations

from hydra_torch._loader import native as _C
from hydra_torch.recipe.reals import integral, whole

METRICS = ("eval_loss", "train_loss")


class Selection:
    """A rule that stops tasks early. start(runners) gives the run's own object, which is told of every step and
    evaluation of every task (after_step, after_evaluation; it sets runner.stopped to stop one) and of every task
    that joins the run (arrive)."""

    def check(self, tasks):
        """Raises before anything is allocated when the rule cannot judge these tasks."""

    def start(self, runners):
        raise NotImplementedError

    def record(self) -> dict:
        """The rule as a checkpoint's manifest holds it: a task resumes under the rule it was judged by."""
        return {"rule": type(self).__name__}


class SuccessiveHalving(Selection):
    """Asynchronous successive halving (ASHA): rungs at min_steps, min_steps * reduction_factor, ...; a task
    reaching a rung goes on only if its metric ranks among the best 1/reduction_factor of all the results at
    that rung so far (the first task there always goes on). No task waits for a slower one.

    metric: "eval_loss" (the task's validation loss, measured at every rung: each task needs eval_data) or
    "train_loss" (its mean training loss over the steps since the previous rung). Lower is better; a NaN ranks
    last. The decisions themselves are native (core/successive_halving.h)."""

    def __init__(self, min_steps: int, reduction_factor: int = 3, metric: str = "eval_loss"):
        min_steps, reduction_factor = integral(min_steps), integral(reduction_factor)  # NumPy's or torch's too
        for label, value, least in (("min_steps", min_steps, 1), ("reduction_factor", reduction_factor, 2)):
            if not whole(value, least) or value >= 2**63:  # the native rule's int64
                raise ValueError(f"SuccessiveHalving: {label} must be an int in [{least}, 2**63), got {value!r}")
        if metric not in METRICS:
            raise ValueError(f"SuccessiveHalving: unknown metric {metric!r}: use one of {METRICS}")
        self.min_steps = min_steps
        self.reduction_factor = reduction_factor
        self.metric = metric

    def __repr__(self) -> str:
        return (f"SuccessiveHalving(min_steps={self.min_steps}, reduction_factor={self.reduction_factor}, "
                f"metric={self.metric!r})")

    def record(self) -> dict:
        return {**super().record(), "min_steps": self.min_steps, "reduction_factor": self.reduction_factor,
                "metric": self.metric}

    def check(self, tasks):
        """Before anything is allocated: every task can be judged."""
        if self.metric == "eval_loss":
            missing = [t.name for t in tasks if t.eval_data is None]
            if missing:
                raise ValueError(f"SuccessiveHalving(metric='eval_loss') judges tasks by validation loss, but "
                                 f"{', '.join(repr(n) for n in missing)} {'has' if len(missing) == 1 else 'have'} no "
                                 "eval_data: give every task eval_data, or use metric='train_loss'")

    def start(self, runners) -> "_SelectionRun":
        return _SelectionRun(self, runners)


class _SelectionRun:
    """One run's rule: each task's rungs, and the decisions at them. Called from the device workers."""

    def __init__(self, rule: SuccessiveHalving, runners):
        self.rule = rule
        self.native = _C.SuccessiveHalving(rule.min_steps, rule.reduction_factor)
        self.rungs = {}
        for runner in runners:
            self._join(runner)
            for rung, metric in runner.rung_reports:  # a resumed task's earlier results still compete
                self.native.report(rung, metric)
        for runner in runners:  # a resumed task past a rung it was not judged at (an earlier run had no such rung)
            for rung, step in enumerate(self.rungs[runner.index]):
                if step <= runner.steps and runner.stopped is None:
                    self._judge_at(runner, rung)

    def _join(self, runner):
        self.rungs[runner.index] = list(self.native.rungs(runner.task.total_steps))
        runner.selection = self
        if self.rule.metric == "eval_loss":
            runner.eval_at = sorted({*runner.eval_at, *self.rungs[runner.index]})

    def arrive(self, runner):
        self.rule.check([runner.task])
        self._join(runner)

    def after_step(self, runner):
        if self.rule.metric == "train_loss" and runner.steps in self.rungs[runner.index]:
            self._judge_at(runner, self.rungs[runner.index].index(runner.steps))

    def after_evaluation(self, runner):
        if self.rule.metric == "eval_loss" and runner.steps in self.rungs[runner.index]:
            self._judge_at(runner, self.rungs[runner.index].index(runner.steps))

    def _judge_at(self, runner, rung: int):
        """Reports the task's metric at the rung, once, and stops the task if the rule says so."""
        if any(r == rung for r, _ in runner.rung_reports):  # judged before a resume
            return
        rungs = self.rungs[runner.index]
        step = rungs[rung]
        if self.rule.metric == "eval_loss":
            measured = [loss for at, loss in runner.eval_losses if at == step]
            if not measured:
                return
            value, what = measured[-1], "validation loss"
        else:
            window = runner.losses[rungs[rung - 1] if rung > 0 else 0:step]
            value, what = sum(window) / len(window), "mean training loss since the last rung"
        decision = self.native.report(rung, value)
        runner.rung_reports.append((rung, value))
        if not decision.keep:
            runner.stopped = (f"successive halving at rung {rung + 1} (step {step}): {what} {value:.4f} ranked "
                              f"{decision.rank} of {decision.competitors}, and only the best {decision.kept} go on")
