"""Ctrl-C and SIGTERM held back while training state is brought home.

Writing the weights back into the user's modules must complete whatever arrives: a second Ctrl-C in the
middle would leave some models' parameters pointing into a device arena that is about to be freed. Inside
`deferred()` those signals are only noted; once the block is done they are delivered again, to the handlers
that were there before (a KeyboardInterrupt for Ctrl-C), also when the block raised. The same signal a second
time while held goes through at once (a worker that hangs must not make the process unkillable). Signal
handlers belong to the main thread; on any other thread the block runs as it is.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

HELD = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def deferred():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived = []

    def hold(received, frame):
        arrived.append(received)
        if arrived.count(received) > 1:  # asked again while held: the user means it, let it through now
            raise KeyboardInterrupt if received == signal.SIGINT else SystemExit(128 + received)

    previous = {}
    try:
        for signum in HELD:
            previous[signum] = signal.signal(signum, hold)
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)
