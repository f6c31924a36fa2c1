"""The lane model through its binding (_C.lane_forecast, used by benchmarks/bench_link_bound.py for its bound and
forecast): a given placement is simulated, none given is chosen within the room, and bad input is refused by name."""
import pytest

from hydra_torch._loader import native as _C

# Three shards of 100 elements each: forward 0.05 s, backward 0.1 s; 8 micro-batches, one step each, not clipped.
SHAPE = ([(0.05, 0.1, 100, 100, 100, -1)] * 3, 8, 1, False)
SLOW_HOST = (2e4, 2e4, 100 * 28 / 0.3, 1e5)  # a host step of a shard: 0.3 s, twice its compute


def test_a_given_placement_is_simulated_above_its_bound():
    host = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, placement=[["host"] * 3] * 2)
    assert host["headroom"] is None and host["placement"] == [["host"] * 3] * 2
    assert host["bound"]["bound"] == host["bound"]["host"] == pytest.approx(2 * 3 * 8 * 0.3)
    assert host["makespan"] >= host["bound"]["bound"]
    assert host["span"] <= host["makespan"]  # the last unit ends before the last host step
    assert host["busy_seconds"]["host"] == pytest.approx(host["bound"]["host"])
    resident = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, placement=[["resident"] * 3] * 2)
    assert resident["busy_seconds"]["host"] == resident["busy_seconds"]["host_to_device"] == 0.0
    # Nothing but the compute and the device steps is left: the run keeps to it, well under the host's.
    assert resident["makespan"] == pytest.approx(resident["bound"]["compute"], rel=0.05)
    assert resident["makespan"] < 0.7 * host["bound"]["host"]


def test_without_a_placement_one_is_chosen_within_the_room():
    host = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, placement=[["host"] * 3] * 2)
    # Room for two device steps' master, moments and new weights (100 * 14 each: one step's state goes home as the
    # next one's comes in), no home (100 * 16): each backward is followed by its step, so a device-stepped shard's
    # gradients need no buffer of their own beyond the unit's working set.
    chosen = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, room=2 * 100 * 14)
    assert {place for places in chosen["placement"] for place in places} <= {"host", "device"}
    assert "device" in chosen["placement"][0] + chosen["placement"][1]
    assert chosen["makespan"] < 0.7 * host["makespan"]
    # Room for one step: the steps take turns in it, and more shards step on the device than the one it holds with
    # two steps at once, for a shorter run in that room.
    one = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, room=100 * 14)
    assert (one["placement"][0] + one["placement"][1]).count("device") > 1
    single = [["device", "host", "host"], ["host"] * 3]
    assert one["makespan"] < _C.lane_forecast([SHAPE] * 2, SLOW_HOST, placement=single, room=100 * 14)["makespan"]
    assert _C.lane_forecast([SHAPE] * 2, SLOW_HOST, room=0)["placement"] == [["host"] * 3] * 2
    # Summed over micro-batches or clipped, a step needs each device-stepped shard's gradients held (100 * 2 each),
    # and leaves the unit's room for them to the step (100 * 12 beyond it).
    for held in [(SHAPE[0], 8, 2, False), (SHAPE[0], 8, 1, True)]:
        assert _C.lane_forecast([held] * 2, SLOW_HOST, room=100 * 12)["placement"] == [["host"] * 3] * 2
        summed = _C.lane_forecast([held] * 2, SLOW_HOST, room=100 * 12 + 6 * 100 * 2)["placement"]
        assert "device" in summed[0] + summed[1]


def test_a_fixed_task_keeps_its_start_and_the_others_are_placed_around_it():
    start = [["device", "host", "host"], ["host"] * 3]
    # Room for the fixed task's device step and one more (one step's state goes home as the next one's comes in).
    chosen = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, room=2 * 100 * 14, start=start,
                              fixed=[True, False])["placement"]
    assert chosen[0] == start[0] and "device" in chosen[1]
    free = _C.lane_forecast([SHAPE] * 2, SLOW_HOST, room=1 << 30, start=start, fixed=[False, True])["placement"]
    assert free[1] == start[1] and free[0] != start[0]


# An embedding (shard 0, 100 elements) whose head (shard 2, 30 of its own) borrows 40 of them.
TIED = ([(0.05, 0.1, 100, 100, 100, -1), (0.05, 0.1, 100, 100, 100, -1), (0.05, 0.1, 140, 70, 30, 0)], 8, 1, False)


def test_a_tie_the_budget_split_is_forecast_as_split_and_a_task_so_placed_is_kept_so():
    """The engine's budget may step a tie's owner on the device and its borrower on the host (a task already
    training so is the start of a later choice): the head's gradient out then holds only what it owns, and the host
    sums nothing of the tied weight."""
    split = [["device", "host", "host"]]
    whole = [["device", "host", "device"]]
    host = [["host"] * 3]
    forecasts = {name: _C.lane_forecast([TIED], SLOW_HOST, placement=p)
                 for name, p in (("split", split), ("whole", whole), ("host", host))}
    busy = {name: f["busy_seconds"] for name, f in forecasts.items()}
    assert forecasts["split"]["placement"] == split
    assert busy["whole"]["host"] < busy["split"]["host"] < busy["host"]["host"]
    # Off the host: the embedding's 8 steps, and the 40 borrowed elements the head's steps no longer sum there (the
    # landed gradient read, the sum read and written).
    assert busy["host"]["host"] - busy["split"]["host"] == pytest.approx(
        8 * (100 * 28 + 40 * (2 + 8)) / SLOW_HOST[2], rel=1e-6)
    kept = _C.lane_forecast([TIED, SHAPE], SLOW_HOST, room=1 << 30, start=[split[0], ["host"] * 3],
                            fixed=[True, False])
    assert kept["placement"][0] == split[0]
    with pytest.raises(ValueError, match="its owner is resident too"):
        _C.lane_forecast([TIED], SLOW_HOST, placement=[["host", "host", "resident"]])


def test_a_resident_owner_lends_its_tie_to_a_spilled_borrower_that_copies_none_of_it():
    """An embedding resident, its head on the host: the head's visits copy in all it reads but the 40 tied elements,
    and its gradient out holds only its own 30 (the tie's sums in the embedding's home)."""
    resident_owner = [["resident", "host", "host"]]
    forecast = _C.lane_forecast([TIED], SLOW_HOST, placement=resident_owner)
    assert forecast["placement"] == resident_owner
    head = forecast["busy_seconds"]
    both = _C.lane_forecast([TIED], SLOW_HOST, placement=[["resident", "host", "resident"]])["busy_seconds"]
    # Against the head resident too, what differs is the head's 8 visits in (140 elements less the 40 tied) and 8
    # gradients out (30), in bf16.
    assert head["host_to_device"] - both["host_to_device"] == pytest.approx(8 * 100 * 2 / SLOW_HOST[0], rel=1e-6)
    assert head["device_to_host"] - both["device_to_host"] == pytest.approx(8 * 30 * 2 / SLOW_HOST[1], rel=1e-6)


def test_the_shards_kept_stay_as_the_start_has_them_and_the_choice_is_among_the_others():
    """A task placed mid-run steps none of its tied shards off the host (lane_choice.added_device_shards): the lane
    model chooses among the others, so that what it forecasts is what the engine grants."""
    free = _C.lane_forecast([TIED], SLOW_HOST, room=1 << 30)["placement"][0]
    assert free[0] != "host"
    kept = _C.lane_forecast([TIED], SLOW_HOST, room=1 << 30, kept=[[0, 2]])["placement"][0]
    assert kept[0] == kept[2] == "host" and kept[1] != "host"
    assert _C.lane_forecast([TIED], SLOW_HOST, room=1 << 30, kept=[[0, 1, 2]])["placement"] == [["host"] * 3]


def test_a_frozen_tie_lent_by_a_resident_owner_is_not_copied_either():
    """A head whose tied weight is frozen (its gradients only its own 30): told what it borrows (the 7th element), the
    lane model takes the 40 tied elements out of its copies as the engine does; without it only a trainable tie is
    known to be borrowed."""
    frozen = [(0.05, 0.1, 100, 100, 100, -1), (0.05, 0.1, 100, 100, 100, -1), (0.05, 0.1, 140, 30, 30, 0)]
    told = ([*frozen[:2], (*frozen[2], 40)], 8, 1, False)
    resident_owner = [["resident", "host", "host"]]
    unknown = _C.lane_forecast([(frozen, 8, 1, False)], SLOW_HOST, placement=resident_owner)["busy_seconds"]
    known = _C.lane_forecast([told], SLOW_HOST, placement=resident_owner)["busy_seconds"]
    assert unknown["host_to_device"] - known["host_to_device"] == pytest.approx(8 * 40 * 2 / SLOW_HOST[0], rel=1e-6)
    # Told of a trainable tie too, the same forecast as without (grads - params is what it borrows).
    assert _C.lane_forecast([([*TIED[0][:2], (*TIED[0][2], 40)], 8, 1, False)], SLOW_HOST,
                            placement=resident_owner)["busy_seconds"] == \
        _C.lane_forecast([TIED], SLOW_HOST, placement=resident_owner)["busy_seconds"]


@pytest.mark.parametrize("call, message", [
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST, placement=[["host", "gpu", "host"]]),
     "'host', 'device' or 'resident'"),
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST, placement=[["host"]]), "shard count differs"),
    (lambda: _C.lane_forecast([SHAPE], (0.0, 1.0, 1.0, 1.0), room=0), "every lane rate must be finite and > 0"),
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST), "give the room"),
    (lambda: _C.lane_forecast([([(0.1, 0.1, 1, 1, 1, 0)], 1, 1, False)], SLOW_HOST, room=0), "tied_to names no other shard"),
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST, room=-1), "room must be >= 0"),
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST, room=0, fixed=[True, False]), "names 2 tasks of 1"),
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST, room=0, kept=[[], []]), "`kept` names 2 tasks of 1"),
    (lambda: _C.lane_forecast([SHAPE], SLOW_HOST, room=0, kept=[[3]]), "names shard 3 of task 0, which has 3"),
    (lambda: _C.lane_forecast([([(0.1, 0.1, 1, 1, 1, -1, 1)], 1, 1, False)], SLOW_HOST, room=0),
     "borrowed must be >= 0, within its weights, and only where it is tied"),
    (lambda: _C.lane_forecast([([(0.1, 0.1, 1, 1, 1, -1), (0.1, 0.1, 1, 1, 1, 0, 2)], 1, 1, False)], SLOW_HOST,
                              room=0), "borrowed must be"),
])
def test_bad_input_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()
