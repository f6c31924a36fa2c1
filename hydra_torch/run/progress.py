"""Progress bars: one per task and a total, in a terminal or a notebook (tqdm.auto picks)."""
from __future__ import annotations

import sys
import threading


class Progress:
    def __init__(self, runners, enabled: bool):
        self._lock = threading.Lock()
        self._bars = {}
        self._total = None
        if not enabled or sys.stderr is None:  # tqdm writes to stderr; None in a process started with 2>&-
            return
        from tqdm.auto import tqdm

        steps = [r.task.total_steps for r in runners]
        self._total = tqdm(total=sum(steps), initial=sum(r.steps for r in runners), desc="all tasks", unit="step",
                           position=0, dynamic_ncols=True)
        for i, (runner, total) in enumerate(zip(runners, steps)):  # a resumed task starts where it was
            self._bars[runner.index] = tqdm(total=total, initial=runner.steps, desc=runner.task.name, unit="step",
                                            position=i + 1, leave=True, dynamic_ncols=True)
            runner.on_step = self.step

    def step(self, runner):
        with self._lock:
            bar = self._bars.get(runner.index)
            if bar is None:
                return
            bar.update(1)
            bar.set_postfix(loss=f"{runner.losses[-1]:.4f}", refresh=False)
            self._total.update(1)

    def close(self, runners):
        with self._lock:
            for runner in runners:
                bar = self._bars.get(runner.index)
                if bar is not None and runner.error is not None:
                    bar.set_postfix_str(f"failed: {type(runner.error).__name__}")
            for bar in self._bars.values():
                bar.close()
            if self._total is not None:
                self._total.close()
