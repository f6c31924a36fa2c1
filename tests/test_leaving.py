"""A task that ends leaves the engines at once, in every call (with arrivals or without): its weights written back,
its device memory freed, and the tasks still training placed again in the room it left (run/replacement.py)."""
import time

import pytest
import torch

import hydra_torch as ht
from hydra_torch import testing
from hydra_torch.run import lane_choice, measuring, moving, replacement
from models import lm_loss, model_bytes, tied_transformer, token_batches


def adamw():
    return ht.optim.AdamW(lr=3e-3, weight_decay=0.05)


def short_and_long_on_two_devices():
    """Two models on two devices, the host a second a step: "short", small, resident on one of them, ends after two
    steps; "long", spilled, trains ten. Beside short, the budget holds one of long's device steps (its untied shard 9);
    once short has left, its room holds them for shards 1-8. Returns the results and long's model."""
    short, long = tied_transformer(seed=1, blocks=2), tied_transformer(seed=2, blocks=8)
    tasks = [ht.ModelTask(short, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(2), name="short"),
             ht.ModelTask(long, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(10), name="long")]
    with testing.emulated_link(1e10), testing.emulated_host(2e6):
        # The arena as 1.5 models: beside it the budget keeps the tasks' working set and saved inputs, and short's
        # graph.
        budget = int(1.5 * model_bytes(long)) + measuring.kept_beside_arena(tasks, resident=["short"])
        results = ht.train(tasks, devices=["cpu", "cpu"], memory_budget=budget, progress=False)
    return results, long


def test_once_a_task_ends_the_one_still_training_steps_shards_on_the_devices_in_the_room_it_left():
    # Beside "short", resident, the budget holds one device step of "long"; once "short" has ended (two steps),
    # "long" is placed again at its next step boundary and steps shards 1-8 on the devices from then on. Its state is
    # in the store between steps: it ends as it trains alone.
    results, long = short_and_long_on_two_devices()
    assert all(r.ok for r in results), [r.error for r in results]
    moved = results["long"]
    assert results["short"].placement == "resident" and 1 in moved.device_shards, moved.placement
    shard = 1
    places = [e.place for e in sorted(results.steps, key=lambda e: e.step)
              if e.task_name == "long" and e.shard == shard]
    # Long's first step is placed beside short; which step boundary first follows short's end depends on the pace.
    switched = places.index("device")
    assert len(places) == 10 and switched >= 1 and places == ["host"] * switched + ["device"] * (10 - switched)
    short_end = max(e.end for e in results.trace if e.task_name == "short")
    first_device_step = min(e.start for e in results.steps
                            if e.task_name == "long" and e.shard == shard and e.place == "device")
    assert first_device_step > short_end, "placed again only once short had left"
    alone = tied_transformer(seed=2, blocks=8)
    reference = ht.train(ht.ModelTask(alone, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(10), name="a"),
                         devices=["cpu", "cpu"], progress=False, placement="host")[0]
    assert moved.losses == pytest.approx(reference.losses, rel=1e-5)
    for a, b in zip(long.parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_task_added_back_on_one_device_only_trains_on_there(monkeypatch):
    # Placed again once "short" has left, "long" is taken back by device 0 alone (device 1 refuses, as where its arena
    # is taken; so with the steps it held before, moving.put_back's fallback): it trains on pinned to device 0, the
    # scheduler handing its units there alone, and ends as it trains alone. Before, the scheduler went on handing its
    # units to device 1, which no longer held it.
    adding = moving.on_devices

    def device_1_refuses_adds(slots, job, own=None, gone=None):
        def add_but_not_on_device_1(slot):
            if slot.index == 1:
                raise RuntimeError("device 1's arena is taken")
            return job(slot)
        return adding(slots, add_but_not_on_device_1 if job.__name__ == "add" else job, own=own, gone=gone)
    monkeypatch.setattr(moving, "on_devices", device_1_refuses_adds)
    pinned, pin = [], replacement.pin

    def noted_pin(slot, runner, unit):
        pin(slot, runner, unit)
        pinned.append((time.perf_counter(), runner.home))
    monkeypatch.setattr(replacement, "pin", noted_pin)
    results, long = short_and_long_on_two_devices()
    assert all(r.ok for r in results), [r.error for r in results]
    assert [home for _, home in pinned] == [0], "placed again once, on device 0 alone"
    after = [e for e in results.trace if e.task_name == "long" and e.start > pinned[0][0]]
    assert after and {e.device for e in after} == {0}
    moved = results["long"]
    alone = tied_transformer(seed=2, blocks=8)
    reference = ht.train(ht.ModelTask(alone, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(10), name="a"),
                         devices=["cpu", "cpu"], progress=False, placement="host")[0]
    assert moved.losses == pytest.approx(reference.losses, rel=1e-5)
    for a, b in zip(long.parameters(), alone.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_task_stopped_early_has_its_weights_home_and_its_result_as_it_ended():
    # "short" ends after two steps while "long" trains on: its model holds its trained weights at once (written back
    # as it left), and its result is the same as at the call's end. FIFO takes the two tasks in turn, so short ends
    # with most of long's batches still to read (longest-remaining-first would run long down to short's steps first,
    # and whether long reads a batch after short's last step would then be a race).
    short, long = tied_transformer(seed=1), tied_transformer(seed=2)
    seen = {}

    class Watch:
        """Records short's weights the first time long's data is read after short has ended."""
        def __init__(self, batches):
            self.batches = batches

        def __len__(self):
            return len(self.batches)

        def __iter__(self):
            for batch in self.batches:
                if tasks[0].ended.is_set() and "short" not in seen:
                    seen["short"] = [p.detach().clone() for p in short.parameters()]
                yield batch
    tasks = [ht.ModelTask(short, optimizer=adamw(), loss_fn=lm_loss, data=token_batches(2), name="short"),
             ht.ModelTask(long, optimizer=adamw(), loss_fn=lm_loss, data=Watch(token_batches(12)), name="long")]
    results = ht.train(tasks, devices="cpu", memory_budget=int(1.5 * model_bytes(long)), progress=False,
                       schedule="fifo")
    assert all(r.ok for r in results) and results["short"].steps == 2
    assert "short" in seen, "long read a batch after short had ended"
    for during, after in zip(seen["short"], short.parameters()):
        assert torch.equal(during, after)


def test_a_task_that_leaves_early_has_its_final_checkpoint_and_resumes_exactly(tmp_path):
    # "short" leaves after two steps while "long" trains on: its final checkpoint is taken as it leaves, and a later
    # call resumes it to four steps as one uninterrupted run of four.
    def task(name, seed, steps, data):
        model = tied_transformer(seed=seed, dropout=0.0, blocks=2)
        return ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=data, name=name,
                            max_steps=steps), model
    reference, reference_model = task("short", 0, 4, token_batches(4))
    whole = ht.train(reference, devices="cpu", progress=False)
    first, _ = task("short", 0, 2, token_batches(4))
    other, _ = task("long", 1, 12, token_batches(12))
    results = ht.train([first, other], devices="cpu", progress=False, checkpoint_dir=tmp_path, schedule="fifo")
    assert [r.steps for r in results] == [2, 12]
    assert max(e.end for e in results.trace if e.task_name == "short") < \
        max(e.end for e in results.trace if e.task_name == "long")
    resumed, model = task("short", 0, 4, token_batches(4))
    again = ht.train(resumed, devices="cpu", progress=False, checkpoint_dir=tmp_path)
    assert again[0].steps == 4 and 2 * len(again.trace) == len(whole.trace), "resumed at step 2"
    for a, b in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(a, b)


def test_a_move_is_weighed_against_the_weights_it_copies_in_again(monkeypatch):
    # The first test's run: "long" moves once "short" has ended, the slow host making the device steps pay over its
    # steps left. Asked again with no step left, the same move does not pay (its weights would be copied in again for
    # nothing); with every step still ahead it does.
    weighed = []
    real = lane_choice.move_pays

    def weigh(runner, running, uncommitted, placement, lane_plan, wanted):
        pays = real(runner, running, uncommitted, placement, lane_plan, wanted)
        steps = runner.steps
        runner.steps = runner.task.total_steps
        try:
            none_left = real(runner, running, uncommitted, placement, lane_plan, wanted)
        finally:
            runner.steps = steps
        weighed.append((runner.task.name, wanted, pays, none_left))
        return pays
    monkeypatch.setattr(lane_choice, "move_pays", weigh)
    results, _ = short_and_long_on_two_devices()
    assert all(r.ok for r in results), [r.error for r in results]
    assert [(name, pays, none_left) for name, _, pays, none_left in weighed] == [("long", True, False)]
    assert results["long"].device_shards == weighed[0][1]


def test_a_move_is_weighed_in_the_room_its_shards_were_chosen_in(monkeypatch):
    # The first test's move: the lane model chooses "long"'s device steps in the room every device leaves
    # (added_device_shards) and move_pays forecasts the run both ways in that same room, from where the task steps
    # now; forecast without it (no weights kept between visits, no device step's state waiting for room) the move
    # would be weighed by a model other than the one that chose it.
    forecasts = []
    real = lane_choice._C

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def lane_forecast(shapes, rates, bytes_, devices, placement=None, room=None, start=None, *rest, **named):
            forecasts.append((placement, room, start))
            return real.lane_forecast(shapes, rates, bytes_, devices, placement, room, start, *rest, **named)
    monkeypatch.setattr(lane_choice, "_C", Recording())
    results, _ = short_and_long_on_two_devices()
    assert all(r.ok for r in results), [r.error for r in results]
    chose = [f for f in forecasts if f[0] is None and len(f[2]) == 1]  # "long" added back, alone in the run
    weighed = [f for f in forecasts if f[0] is not None and f[1] is not None]
    assert len(chose) == 1 and len(weighed) == 2, forecasts
    hosts = ["host"] * len(chose[0][2][0])
    assert [(room, start) for _, room, start in weighed] == [(chose[0][1], [hosts])] * 2, "its room, from the host"
    assert [placement[0] for placement, _, _ in weighed] == \
        [hosts, ["device" if s in results["long"].device_shards else "host" for s in range(len(hosts))]]


def test_a_move_that_does_not_pay_leaves_the_task_where_it_is(monkeypatch):
    monkeypatch.setattr(lane_choice, "move_pays", lambda *args: False)
    results, _ = short_and_long_on_two_devices()
    assert all(r.ok for r in results) and 1 not in results["long"].device_shards
    assert {e.place for e in results.steps if e.task_name == "long" and e.shard == 1} == {"host"}


def test_a_lane_model_that_cannot_weigh_a_move_warns_and_leaves_the_task_where_it_is(monkeypatch):
    def fails(*args):
        raise RuntimeError("no rates")
    monkeypatch.setattr(lane_choice, "move_pays", fails)
    with pytest.warns(RuntimeWarning, match="could not weigh moving 'long'.*no rates"):
        results, _ = short_and_long_on_two_devices()
    assert all(r.ok for r in results) and 1 not in results["long"].device_shards
    assert {e.place for e in results.steps if e.task_name == "long" and e.shard == 1} == {"host"}
