"""Engine work for a device's worker thread, posted by other threads: an engine is used by its own worker only.

A worker drains its inbox between units. A thread that needs something done on several devices (a task joining
the run, a task re-planned after running out of memory) posts a job to each and waits; a worker that waits so
drains its own inbox meanwhile, so two workers waiting on each other both go on. A worker that ends closes its
inbox after running what is left in it: its engine has no thread of its own any more, and a later job runs on
the thread that posts it.
"""
from __future__ import annotations

import queue
import threading


class Inbox:
    def __init__(self):
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        # Once closed: one posting thread at a time drives the engine; a job run so may post the next (re-entrant).
        self._ownerless = threading.RLock()

    @property
    def closed(self) -> bool:
        return self._closed

    def post(self, job) -> bool:
        """Queues job() for the worker; False (nothing queued) once the worker has ended."""
        with self._lock:
            if self._closed:
                return False
            self._jobs.put(job)
            return True

    def run_or_post(self, job):
        """Queues job() for the worker, or, once it has ended, runs it here, one such caller at a time."""
        if not self.post(job):
            with self._ownerless:
                job()

    def drain(self):
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            job()

    def close(self):
        """The worker ends: what is queued runs now, later jobs run where they are posted."""
        with self._lock:
            self._closed = True
        self.drain()


def on_devices(slots, job, own=None, gone=None) -> list[Exception]:
    """Runs job(slot) for every slot on its worker's thread and waits for all; returns the RuntimeErrors raised.
    `own`: the calling worker's slot (its job runs here, and its inbox is drained while it waits). `gone`: an
    event set once every worker has stopped; what they left queued then runs here."""
    errors, remaining, done = [], [len(slots)], threading.Event()
    if not slots:
        return errors
    count = threading.Lock()

    def run(slot):
        try:
            job(slot)
        except RuntimeError as error:
            errors.append(error)
        finally:
            with count:
                remaining[0] -= 1
                if remaining[0] == 0:
                    done.set()
    for slot in slots:
        if slot is own:
            run(slot)
        else:
            slot.inbox.run_or_post(lambda slot=slot: run(slot))
    while not done.wait(0.01 if own is not None else 0.05):
        if own is not None:
            own.inbox.drain()
        if gone is not None and gone.is_set():
            for slot in slots:  # the workers have stopped: their engines are this thread's now
                slot.inbox.drain()
    return errors
