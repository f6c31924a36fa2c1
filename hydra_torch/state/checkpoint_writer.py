"""The run's checkpoints: when each task is due one, and the background thread that writes them."""
from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

from hydra_torch.state import checkpoint
from hydra_torch.state.checkpoint_dirs import Claim, claim, task_dir
from hydra_torch.state.run_warnings import warn_in_run


class Checkpointer:
    """When each task is due a checkpoint, and the background thread that writes them. It holds the tasks'
    directories (see claim) from its start until it is closed (see submit for a task stopped at its request);
    a write that fails is counted (`failures`) and warned of once, until one succeeds again."""

    def __init__(self, root, every, runners):
        self.root = Path(root)
        self.every_steps, self.every_seconds = checkpoint.parse_every(every)
        self._last: dict[int, tuple[int, float]] = {}   # task -> (steps, time) at its last checkpoint
        self._files: dict[int, str | None] = {}         # task -> the tensor file its manifest on disk names
        self._claims: dict[int, Claim] = {}
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        self._queue: queue.Queue = queue.Queue()
        self.failures = 0          # checkpoints that could not be written
        self._failing = False      # the last write failed
        self._news: list[str] = []  # warnings for a training thread to give
        try:
            for runner in runners:
                self._take(runner)
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._write_loop, name="hydra-checkpoints", daemon=True)
        self._thread.start()

    def _take(self, runner):
        """Holds the task's directory for the run, once sure its checkpoint is still the one the task resumed
        from; then removes the files there its manifest does not name, which only a write cut short (a killed
        run's) can have left, since no other run holds the directory."""
        name = runner.task.name
        directory = task_dir(self.root, name)
        directory.mkdir(exist_ok=True)
        held = self._claims[runner.index] = claim(self.root, name)
        steps, tensors = checkpoint.on_disk(directory)
        if steps != runner.steps:
            raise ValueError(f"task {name!r}: its checkpoint in {directory} changed after this call read it (another "
                             f"run wrote its step {steps} meanwhile): call again to resume from that one")
        if held.held:
            for leftover in directory.glob("state-*.safetensors*"):
                if leftover.name != tensors:
                    leftover.unlink(missing_ok=True)
        self._files[runner.index] = tensors
        self._last[runner.index] = (runner.steps, time.monotonic())

    def due(self, runner) -> bool:
        self._report()  # a write that failed is told of at the next step boundary
        steps, at = self._last[runner.index]
        if runner.steps == steps or runner.index in self._pending:  # nothing new, or the last one still writing
            return False
        if self.every_steps is not None:
            return runner.steps - steps >= self.every_steps
        return time.monotonic() - at >= self.every_seconds

    def submit(self, runner, final: bool = False, resident: bool = False):
        """Hands the task's state to the writer. `final`: as the run ends, its weights home; skipped when its
        last checkpoint (or the one it resumed from) already holds this step. The writer reads the store's
        buffers themselves when nothing rewrites them before it is done: after the run, or for a `resident`
        task, whose steps run on the device (its store changes only when DeviceEngine::snapshot or finish
        copies the device state home, which waits for this write: `due`, `wait`). Otherwise, copies.

        A task stopped at its own request trains no more in this call, and another call may go on with it at
        once (a cluster moves tasks so): its directory is let go as soon as this checkpoint is written."""
        if final and self._last[runner.index][0] == runner.steps:
            return
        tensors, manifest = checkpoint.snapshot(runner, copy=not (final or resident))
        self._last[runner.index] = (runner.steps, time.monotonic())
        with self._lock:
            self._pending.add(runner.index)
        self._queue.put((runner.index, tensors, manifest, runner.task.stopped_on_request))

    def wait(self, runner):
        """Until the task's checkpoint being written, if any, is on disk."""
        with self._lock:
            while runner.index in self._pending:
                self._written.wait()

    def _write_loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            index, tensors, manifest, last = item
            try:
                self._files[index] = checkpoint.write(self.root, tensors, manifest, self._files[index])
                self._failing = False
            except Exception as error:  # a full disk must not stop training
                self._failed(manifest, error)
            finally:
                if last:
                    self._claims.pop(index).release()
                with self._lock:
                    self._pending.discard(index)
                    self._written.notify_all()

    def _failed(self, manifest: dict, error: Exception):
        """Counts a write that failed; the first of a series is warned of (a full disk fails them all)."""
        with self._lock:
            self.failures += 1
            if not self._failing:
                self._news.append(f"checkpoints could not be written to {task_dir(self.root, manifest['task'])}: "
                                  f"{error} (task {manifest['task']!r} at step {manifest['steps']}); training goes "
                                  "on, and further failures are only counted (Results.checkpoint_failures) until "
                                  "a checkpoint is written again")
            self._failing = True

    def _report(self):
        # On a training thread, not the writer's: a warnings filter that raises must not stop the writer.
        with self._lock:
            news, self._news = self._news, []
        for message in news:
            warn_in_run(message)

    def _release(self):
        for held in self._claims.values():
            held.release()
        self._claims.clear()

    def close(self):
        """Waits for every write, gives the warnings not given yet, and lets go of the tasks' directories."""
        self._queue.put(None)
        self._thread.join()
        self._release()
        self._report()
