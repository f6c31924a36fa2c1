"""EventClock on CPU, with events a test moves by hand: units are reported once the device is past their
end, in order, on the host's clock; waiting reports the rest."""
import time

from hydra_torch.run.unit_clock import EventClock, for_device


class FakeDevice:
    def __init__(self):
        self.now_ms = 0.0       # the device's clock
        self.reached_ms = 0.0   # how far it has run


class FakeEvent:
    def __init__(self, device):
        self.device, self.at_ms = device, None

    def record(self):
        self.at_ms = self.device.now_ms

    def query(self):
        return self.at_ms <= self.device.reached_ms

    def synchronize(self):
        self.device.reached_ms = max(self.device.reached_ms, self.at_ms)

    def elapsed_time(self, other):
        assert self.query() and other.query(), "elapsed_time of an event the device has not reached"
        return other.at_ms - self.at_ms


def test_units_are_reported_once_the_device_is_past_them_in_order():
    device = FakeDevice()
    before = time.perf_counter()
    clock = EventClock(lambda: FakeEvent(device))
    reports, failures = [], []
    for begin_ms, end_ms in ((10.0, 30.0), (30.0, 75.0)):
        device.now_ms = begin_ms
        mark = clock.start()
        device.now_ms = end_ms
        clock.stop(mark, lambda start, end: reports.append((start, end)), failures.append)
    assert reports == [], "reported before the device reached the unit's end"
    device.reached_ms = 40.0
    clock.poll()
    assert len(reports) == 1
    start, end = reports[0]
    assert before <= start and abs((end - start) - 0.020) < 1e-9
    clock.poll(wait=True)
    assert len(reports) == 2 and abs((reports[1][1] - reports[1][0]) - 0.045) < 1e-9
    assert abs(reports[1][0] - reports[0][1]) < 1e-9, "both on one device timeline"
    assert failures == []


class FailingEvent(FakeEvent):
    def query(self):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_device_error_read_from_an_event_is_reported_as_that_units_failure():
    device = FakeDevice()
    clock = EventClock(lambda: FakeEvent(device))
    clock._make_event = lambda: FailingEvent(device)
    reports, failures = [], []
    clock.stop(clock.start(), lambda *t: reports.append(t), failures.append)
    clock.poll(wait=True)
    assert reports == [] and len(failures) == 1 and "illegal memory access" in str(failures[0])


def test_a_cpu_device_has_no_event_clock():
    import torch
    assert for_device(torch.device("cpu")) is None
