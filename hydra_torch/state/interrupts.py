"""Ctrl-C and SIGTERM while training runs, and while training state is brought home.

While the devices train (`stop_requests`), the first Ctrl-C or SIGTERM asks every task to stop at its next
step boundary: a step is applied to every shard of a model or to none, and ht.train hands back the Results so
far. The same or another signal a second time stops at once (KeyboardInterrupt, or SystemExit for SIGTERM):
steps in progress are then left half-applied, but the weights still come home.

Writing the weights back into the user's modules must complete whatever arrives: a second Ctrl-C in the
middle would leave some models' parameters pointing into a device arena that is about to be freed. Inside
`deferred()` those signals are only noted; once the block is done they are delivered again, to the handlers
that were there before (a KeyboardInterrupt for Ctrl-C), also when the block raised. The same signal a second
time while held goes through at once (a worker that hangs must not make the process unkillable).

Signal handlers belong to the main thread; on any other thread both blocks run as they are.
"""
from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)
NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def _stop_now(received):
    raise KeyboardInterrupt if received == signal.SIGINT else SystemExit(128 + received)


class StopRequest:
    """Set by the first Ctrl-C or SIGTERM during training: tasks stop at their next step boundary."""

    def __init__(self):
        self.signal: int | None = None
        self._event = threading.Event()

    def set(self, received: int):
        self.signal = received
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    @property
    def name(self) -> str | None:
        return NAMES.get(self.signal) if self.signal is not None else None


@contextmanager
def _handling(handler):
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    try:
        for signum in HELD:
            previous[signum] = signal.signal(signum, handler)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextmanager
def stop_requests(request: StopRequest):
    """The first signal sets `request`; a second one stops at once."""
    def ask(received, frame):
        if request.is_set():
            _stop_now(received)
        request.set(received)
        if sys.stderr is not None:  # None: a process started with 2>&- (the write would raise in a unit)
            sys.stderr.write(f"\n{NAMES[received]}: every task stops at its next step boundary; "
                             f"{NAMES[received]} again stops at once, leaving steps in progress half-applied\n")

    with _handling(ask):
        yield


@contextmanager
def deferred():
    arrived = []

    def hold(received, frame):
        arrived.append(received)
        if arrived.count(received) > 1:  # asked again while held: the user means it, let it through now
            _stop_now(received)

    try:
        with _handling(hold):
            yield
    finally:
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)


def deliver(signum: int):
    """Hands a signal that stopped training at step boundaries to the handler that was there before (for
    SIGTERM, by default, the end of the process), once the weights are home."""
    signal.raise_signal(signum)
