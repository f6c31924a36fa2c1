"""How long each unit took on its device, without making the host wait for the device.

On a CPU device a unit computes on the calling thread, so the wall time around it is its time. On a GPU the
host only enqueues work: waiting for the device after every unit to time it would stop the host from running
ahead (issuing the next unit's copies and kernels while this one computes). There a unit's start and end are
events on the compute stream, read once the device has passed them: the scheduler's cost model learns each
duration a little late, and the trace holds device times on the host's clock.
"""
from __future__ import annotations

import time
from collections import deque

import torch


class EventClock:
    """Times read from events once the device is past them; `report(start, end)` is called then, in order. If
    reading them fails (an asynchronous device error surfacing there), `fail(error)` is called instead: the
    unit's task is the one to blame, whichever unit is running when it shows."""

    def __init__(self, make_event=None):
        self._make_event = make_event or (lambda: torch.cuda.Event(enable_timing=True))
        # Device times are offsets from this event, which the host waits for once, here, to pin them to its clock.
        self._origin = self._make_event()
        self._origin.record()
        self._origin.synchronize()
        self._origin_host = time.perf_counter()
        self._pending = deque()

    def start(self):
        event = self._make_event()
        event.record()
        return event

    def stop(self, mark, report, fail):
        end = self._make_event()
        end.record()
        self._pending.append((mark, end, report, fail))
        self.poll()

    def poll(self, wait: bool = False):
        """Reports every unit whose end the device has reached (with `wait`: every unit, waiting for them)."""
        while self._pending:
            start, end, report, fail = self._pending[0]
            try:
                if not (wait or end.query()):
                    return
                end.synchronize()
                times = self._host_time(start), self._host_time(end)
            except Exception as error:
                self._pending.popleft()
                fail(error)
                continue
            self._pending.popleft()
            report(*times)

    def _host_time(self, event) -> float:
        return self._origin_host + self._origin.elapsed_time(event) / 1e3


def for_device(device: torch.device) -> EventClock | None:
    """An EventClock for a GPU; None for a CPU device, whose units the caller times with the host's clock."""
    return EventClock() if device.type == "cuda" else None
