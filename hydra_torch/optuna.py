"""Optuna studies run as one hydra-torch call: `concurrent` trials train at once, each pruned when the study's
pruner says so at one of its evaluations, and a new trial starts as soon as one ends.

    import optuna, hydra_torch as ht
    from hydra_torch.optuna import optimize

    def build_task(trial):
        lr = trial.suggest_float("lr", 1e-4, 1e-2, log=True)
        return ht.ModelTask(make_model(trial), data=train, eval_data=valid, eval_every=10,
                            optimizer=ht.optim.AdamW(lr=lr), name=f"trial{trial.number}")

    study = optuna.create_study(pruner=optuna.pruners.MedianPruner())
    optimize(study, build_task, n_trials=20, concurrent=4)
    print(study.best_params)

Each trial's value is its task's final validation loss (its final training loss when it has no eval_data), to
be minimised; it is reported to the trial at every evaluation (every step without eval_data). Pruned trials
are told PRUNED, trials whose task failed or could not be built FAIL, with a warning; whatever stops
`optimize`, no trial it asked is left RUNNING. Optuna is optional: `pip install optuna`.
"""
from __future__ import annotations

import queue
import threading

from hydra_torch import api
from hydra_torch.recipe.callables import check_callable
from hydra_torch.recipe.reals import integral, whole
from hydra_torch.selection.arrivals import Arrivals, RunClosedError
from hydra_torch.selection.rules import Selection
from hydra_torch.state import task_rng
from hydra_torch.state.run_warnings import warn_in_run
from hydra_torch.task import ModelTask

_STOP = object()


def _optuna():
    try:
        import optuna
    except ImportError:
        raise ImportError("hydra_torch.optuna needs Optuna: pip install optuna") from None
    return optuna


def optimize(study, build_task, n_trials: int, concurrent: int = 2, *, devices="auto", memory_budget=None,
             schedule: str = "lrtf", progress: bool = False, seed: int = 0, host_threads: int | None = None):
    """Runs `n_trials` trials of `study`, `concurrent` of them training at a time, and returns the
    ht.Results of every trial's task. `build_task(trial)` returns the trial's ModelTask (its suggestions
    made through `trial`); tasks after the first `concurrent` join the running call as others end. The
    other keywords are ht.train's. Raises the sampler's error, after the running trials have ended and been
    told, if it fails; likewise, as it is, an error of build_task's that is not an Exception (KeyboardInterrupt,
    say). Every trial asked is told COMPLETE, PRUNED or FAIL, also when this raises."""
    optuna = _optuna()
    n_trials, concurrent = integral(n_trials), integral(concurrent)  # NumPy's or torch's whole numbers too
    for label, value in (("n_trials", n_trials), ("concurrent", concurrent)):
        if not whole(value, 1):
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if not isinstance(study, optuna.study.Study):
        raise TypeError(f"study must be an optuna Study, got {type(study).__name__}")
    if len(study.directions) != 1 or study.direction != optuna.study.StudyDirection.MINIMIZE:
        raise ValueError("the study must minimise one value (a loss): optuna.create_study(direction='minimize')")
    check_callable(build_task, "build_task", "build_task(trial) -> ModelTask", 1)
    driver = _Driver(optuna, study, build_task, n_trials)
    options = dict(devices=devices, memory_budget=memory_budget, schedule=schedule, progress=progress, seed=seed,
                   host_threads=host_threads)
    try:
        results = _train(driver, concurrent, options)
    except BaseException as error:  # train raised (before training, say), or Ctrl-C came while a task was built
        driver.settle((), error)
        raise
    driver.settle(results, driver.crash)
    if driver.crash is not None:
        raise driver.crash
    if driver.error is not None:
        raise RuntimeError(f"the study's sampler failed after {driver.asked} trials; the trials that ran were told "
                           f"their results: {driver.error!r}") from driver.error
    return results


def _train(driver, concurrent, options):
    """Builds the first `concurrent` trials' tasks and trains them, the driver adding the others as they end."""
    initial = [task for task in (driver.new_task() for _ in range(min(concurrent, driver.n_trials)))
               if task is not None]
    if not initial:
        raise ValueError(f"no trial's task could be built: {driver.build_errors[-1]!r}") from driver.build_errors[-1]
    arrivals = Arrivals(on_ended=driver.events.put)
    thread = threading.Thread(target=driver.drive, args=(arrivals, len(initial)), name="hydra-optuna", daemon=True)
    thread.start()
    try:
        return api.train(initial, selection=_Pruning(driver), arrivals=arrivals, **options)
    finally:
        arrivals.end()  # train() did as it ended; again for a call stopped before it began (a Ctrl-C just now)
        driver.events.put(_STOP)  # the run is over: trials still counted as running never will end
        thread.join()


class _Driver:
    """Asks the study for trials, builds their tasks, and tells it each result. Its own thread (drive) runs
    while the devices train; the run's on_ended hands it ended tasks through `events`."""

    def __init__(self, optuna, study, build_task, n_trials):
        self.optuna, self.study, self.build_task, self.n_trials = optuna, study, build_task, n_trials
        self.events = queue.SimpleQueue()
        self.trials = {}                 # task name -> trial
        self.untold = {}                 # trial number -> trial asked and not told yet how it ended
        self.asked = 0
        self.build_errors: list[BaseException] = []
        self.error: BaseException | None = None  # the sampler's
        self.crash: BaseException | None = None  # what ended drive() while tasks trained: optimize re-raises it

    def new_task(self) -> ModelTask | None:
        """The next trial's task; None once n_trials have been asked. A trial whose task cannot be built is told
        FAIL, with a warning, and the next one is asked."""
        while self.asked < self.n_trials:
            trial = self.study.ask()
            self.asked += 1
            self.untold[trial.number] = trial
            try:
                with task_rng.exclusive():  # building a model draws from the generator the workers share
                    task = self.build_task(trial)
                if not isinstance(task, ModelTask):
                    raise TypeError(f"build_task must return a ModelTask, got {type(task).__name__}")
                task.check_trains_something()  # else ht.train would refuse it with the first trials, ending them all
                if task.name in self.trials:
                    raise ValueError(f"task name {task.name!r} is taken by another trial: name tasks after "
                                     "trial.number")
            except Exception as error:
                self._fail(trial, error, "its task could not be built")
                self.build_errors.append(error)
                continue
            self.trials[task.name] = trial
            return task
        return None

    def _fail(self, trial, error, what):
        warn_in_run(f"trial {trial.number} failed: {what}: {error!r}", stacklevel=3)
        self._tell(trial, state=self.optuna.trial.TrialState.FAIL)

    def _tell(self, trial, value=None, state=None):
        self.study.tell(trial, value, state=state)
        del self.untold[trial.number]

    def tell(self, result):
        trial = self.trials[result.name]
        states = self.optuna.trial.TrialState
        if result.error is not None:
            self._fail(trial, result.error, "its task failed")
        elif result.stopped is not None:
            self._tell(trial, state=states.PRUNED)
        elif result.cut_short is not None or not result.losses:
            self._fail(trial, RuntimeError(f"training was cut short by {result.cut_short}"), "it did not finish")
        else:
            self._tell(trial, result.final_eval_loss if result.eval_losses else result.final_loss)

    def settle(self, results, error):
        """Once the run is over, however it ended: each trial not told yet is told its task's result where its
        task ran (a driver that crashed never heard of it), else FAIL with `error`."""
        for result in results:
            if self.trials[result.name].number in self.untold:
                self.tell(result)
        for trial in list(self.untold.values()):
            self._fail(trial, error, "optimize stopped before it ended")

    def drive(self, arrivals, running: int):
        adding = True
        try:
            while running > 0:
                result = self.events.get()
                if result is _STOP:
                    return
                running -= 1
                self.tell(result)
                while adding:
                    try:
                        task = self.new_task()
                    except Exception as error:  # the sampler: no more trials; the running ones still end
                        self.error, adding = error, False
                        break
                    if task is None:
                        adding = False
                        break
                    try:
                        arrivals.add(task)
                        running += 1
                        break
                    except RunClosedError as error:  # stopped (Ctrl-C): this trial never ran
                        self._fail(self.trials[task.name], error, "the run was stopping")
                        adding = False
                    except (ValueError, TypeError) as error:  # it cannot join (too large, say): the next one may
                        self._fail(self.trials[task.name], error, "its task cannot join the run")
        except BaseException as error:  # build_task's KeyboardInterrupt, say: it would end this thread alone
            if hasattr(error, "add_note"):
                error.add_note(f"raised on hydra_torch.optuna's driver thread after {self.asked} trials were asked; "
                               "optimize re-raised it once the run had ended and every trial was told")
            self.crash = error
        finally:
            arrivals.close()


class _Pruning(Selection):
    """Reports every task's evaluations (its steps' training losses when it has no eval_data) to its trial,
    and stops it when the study's pruner says so."""

    def __init__(self, driver: _Driver):
        self.driver = driver

    def start(self, runners):
        for runner in runners:
            self.arrive(runner)
        return self

    def arrive(self, runner):
        runner.selection = self

    def after_step(self, runner):
        if runner.task.eval_data is None:
            self._report(runner, runner.losses[-1], "training loss")

    def after_evaluation(self, runner):
        self._report(runner, runner.eval_losses[-1][1], "validation loss")

    def _report(self, runner, value, what):
        trial = self.driver.trials[runner.task.name]
        trial.report(value, runner.steps)
        try:
            prune = trial.should_prune()
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(f"raised by the study's pruner ({type(self.driver.study.pruner).__name__}) for trial "
                               f"{trial.number} at step {runner.steps}")
            raise
        if prune:
            runner.stopped = (f"pruned by {type(self.driver.study.pruner).__name__} at step {runner.steps}: {what} "
                              f"{value:.4f}")
