"""The host's memory lane: the bytes host steps touch, counted, and on an emulated host memory bandwidth
(hydra_torch.testing.emulated_host) paced as on a machine whose memory is that fast."""
import time

import pytest
import torch

import hydra_torch as ht
import placed_training
from hydra_torch import testing
from hydra_torch.run import measuring
from models import max_relative_error, tied_transformer, token_batches


def mlp_task(**options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
    data = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(4)]
    task = ht.ModelTask(model, data=data, loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out.float(), batch[1]),
                        **options)
    return task, sum(p.numel() for p in model.parameters())


def train_spilled(task):
    results = ht.train([task], devices="cpu", memory_budget=3 * 64 * 65 * 4 + 65536, progress=False,
                       placement="host")
    assert results[0].ok and results[0].placement == "spilled", results[0]
    return results


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_bytes_a_host_step_touches_are_counted(precision, accumulate):
    # A step reads and writes the fp32 master and AdamW's two moments (24 bytes a parameter) and in bf16 writes
    # the shadow (2). With one micro-batch it reads the gradient where it landed (4, or 2 in bf16): 28 either
    # way. With two, each gradient is summed into the fp32 accumulator (the gradient read, the accumulator read
    # and written: 8), and the step reads the accumulator and zeroes it (8).
    task, params = mlp_task(precision=precision, accumulate=accumulate)
    stats = train_spilled(task).stats[0]
    landed, shadow = (4, 0) if precision == "fp32" else (2, 2)
    per_step = landed + 24 + shadow if accumulate == 1 else accumulate * (landed + 8) + 8 + 24 + shadow
    assert stats["host_step_bytes"] == len(task.data) // accumulate * params * per_step


def test_on_an_emulated_host_steps_take_their_bytes_over_its_bandwidth():
    task, _ = mlp_task()
    plain = train_spilled(task).stats[0]
    rate = plain["host_step_bytes"] / 0.5  # every step together: half a second on the emulated host
    task, _ = mlp_task()
    start = time.perf_counter()
    with testing.emulated_host(rate):
        stats = train_spilled(task).stats[0]
    took = time.perf_counter() - start
    assert stats["host_step_bytes"] == plain["host_step_bytes"]
    # The steps share one memory lane: one after another, each at least its bytes over the rate.
    assert stats["host_step_seconds"] >= 0.5 * 0.999 and took >= 0.5
    assert testing.host_bytes_per_second() == 0.0, "the emulation ends with its block"


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "9e10"])
def test_an_emulated_host_bandwidth_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="emulated_host: bytes_per_second must be a positive number"):
        with testing.emulated_host(bad):
            pass


@pytest.mark.skipif(not ht._C.HostSteps.sizes_openmp_teams,
                    reason="this build of the extension has no OpenMP (the ThreadSanitizer test build)")
def test_host_step_threads_open_teams_of_their_share_of_the_cores():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # what a thread's first parallel call would otherwise size its team to
        assert ht._C.HostSteps(1, 1).openmp_threads() == 1
        assert ht._C.HostSteps(2, 0).openmp_threads() == 2, "0: the process's count"
    finally:
        torch.set_num_threads(before)


def test_with_gpus_host_steps_get_the_cores_their_workers_and_lanes_leave(monkeypatch):
    from hydra_torch.run import devices
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 16)
    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert devices.host_step_threads(None, [gpu]) == (4, 3)  # 16 - 3 cores: 4 threads of 3
    assert devices.host_step_threads(None, [gpu, torch.device("cuda", 1)]) == (4, 2)
    assert devices.host_step_threads(2, [gpu]) == (2, 6)
    assert devices.host_step_threads(None, [cpu]) == (4, 0), "CPU devices: the compute takes the cores"
    monkeypatch.setattr(devices.os, "cpu_count", lambda: 4)
    assert devices.host_step_threads(None, [gpu]) == (1, 1)


def test_results_show_the_busy_share_of_each_lane():
    # A slow emulated host makes the host steps the busiest lane; a slow emulated link, the copies (it paces both
    # directions); a resident model keeps both idle. Each shows in Results.lanes() and the summary.
    task, _ = mlp_task()
    plain = train_spilled(task)
    task, _ = mlp_task()
    with testing.emulated_host(plain.stats[0]["host_step_bytes"] / 1.0):  # every step together: a second
        host_bound = train_spilled(task)
    lanes = host_bound.lanes()
    device = lanes["devices"]["cpu"]
    assert lanes["host"] >= 0.999 / host_bound.wall_time / host_bound.stats[0]["host_threads"]
    assert lanes["host"] * host_bound.stats[0]["host_threads"] > max(device["copies_in"], device["copies_out"])
    # The device's units wait for the stepped weights: busy, but not computing.
    assert device["compute"] < host_bound.utilisation()["cpu"] - 0.25
    assert "host steps: busy" in host_bound.summary() and "copies in" in host_bound.summary()

    task, _ = mlp_task()
    with testing.emulated_link(plain.stats[0]["host_to_device_bytes"] / 1.0):  # every copy in: a second
        link_bound = train_spilled(task)
    lanes = link_bound.lanes()
    device = lanes["devices"]["cpu"]
    assert device["copies_in"] >= 0.9 / link_bound.wall_time
    assert device["copies_in"] > lanes["host"] * link_bound.stats[0]["host_threads"]  # the link, both ways, binds

    task, _ = mlp_task()
    resident = ht.train([task], devices="cpu", progress=False)
    assert resident[0].placement == "resident"
    device = resident.lanes()["devices"]["cpu"]
    assert device["copies_in"] == device["copies_out"] == 0.0 and resident.lanes()["host"] == 0.0
    assert 0.0 < device["compute"] <= 1.0
    assert "host steps" not in resident.summary()


def test_a_models_host_steps_run_one_at_a_time_the_lowest_shard_that_can_first():
    # Gradients come home highest shard first, but the next forward needs the lowest first. On a slow host, the
    # shards whose gradients landed while a step ran are stepped lowest first, never two of one model at once (with
    # two host-step threads; a step let in between the parts of another runs within it, on its thread), and the model
    # still trains as plain PyTorch does (the tied head's gradient is summed into the embedding's step, which must
    # wait for it).
    data = token_batches(2)
    plain = placed_training.train(tied_transformer(), data, "host", 2.0)
    rate = plain.stats[0]["host_step_bytes"] / len(plain.steps) / 0.3  # a block's step: at least 0.3 s or so
    model = tied_transformer()
    with testing.emulated_host(rate):
        slow = placed_training.train(model, data, "host", 2.0, host_threads=2)
    assert slow.stats[0]["host_threads"] == 2
    steps = sorted(slow.steps, key=lambda e: e.start)
    for i, a in enumerate(steps):
        for b in steps[i + 1:]:  # b begins no earlier: after a, or within it
            assert a.end <= b.start or b.end <= a.end, ("two steps of one model ran at once", a, b)
    for k in (1, 2):
        start = {e.shard: e.start for e in steps if e.step == k}
        # The blocks' gradients (shards 1-5) come home highest first, each step taking ~0.3 s against milliseconds
        # of backward: as one ends, the model's landing buffers hold gradients of lower blocks, and the lowest goes
        # first. In submission order the blocks would step 5, 4, 3, 2, 1.
        blocks = sorted(range(1, 6), key=start.get)
        assert blocks != [5, 4, 3, 2, 1], (k, sorted(start, key=start.get))
    reference, reference_losses = placed_training.plain_reference(data)
    assert slow[0].losses == pytest.approx(reference_losses, rel=1e-5)
    assert max_relative_error(model, reference) <= 1e-5


def linears_on_a_slow_host(width, layers, batches, rows=4):
    """A model of `layers` Linear(width) shards trained with every step on the host, ~0.2 s each on an emulated host,
    one host-step thread whose team is one thread (a part of a step is at least 128k elements a thread), `rows` a batch
    (more make each backward longer). Returns the run's step entries by (step, shard), the trained model, and the same
    model trained by plain PyTorch at the same thread count."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

    torch.manual_seed(1)
    data = [(torch.randn(rows, width), torch.randn(rows, width)) for _ in range(batches)]

    def loss_fn(out, batch):
        return torch.nn.functional.mse_loss(out, batch[1])

    def train(model):
        task = ht.ModelTask(model, data=data, loss_fn=loss_fn, shards=layers,
                            optimizer=ht.optim.AdamW(lr=1e-3, weight_decay=0.01))
        budget = 3 * width * (width + 1) * 4 + 65536 + measuring.kept_beside_arena([task])
        return ht.train([task], devices="cpu", memory_budget=budget, progress=False, placement="host", host_threads=1)

    def plain():
        model = build()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        for batch in data:
            optimizer.zero_grad()
            loss_fn(model(batch[0]), batch).backward()
            optimizer.step()
        return model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = train(build())
        model = build()
        with testing.emulated_host(fast.stats[0]["host_step_bytes"] / len(fast.steps) / 0.2):
            slow = train(model)
        expected = plain()
    finally:
        torch.set_num_threads(threads)
    assert slow[0].ok and slow[0].placement == "spilled", slow[0]
    steps = {(e.step, e.shard): e for e in slow.steps}
    assert sorted(steps) == [(k, s) for k in range(1, batches + 1) for s in range(layers)]
    return steps, model, expected


def test_a_lower_shards_step_runs_between_the_parts_of_a_higher_one_that_began_first():
    # Shard 1's step begins as its gradient lands; shard 0's lands while it runs, and the next forward needs it first.
    # Between shard 1's parts (a shard of 262k parameters is three), shard 0 steps, and shard 1's step ends after it.
    # Without the parts, shard 0's step would wait for shard 1's to end. The model still trains as plain PyTorch does.
    # Batches of 256 rows make shard 0's backward some milliseconds: shard 1's step has begun when its gradient lands
    # (with 4 rows both gradients could land before the host thread took shard 1's, and shard 0's went first).
    steps, model, expected = linears_on_a_slow_host(width=512, layers=2, batches=3, rows=256)
    nested = 0
    for k in (1, 2, 3):
        inner, outer = steps[k, 0], steps[k, 1]
        if outer.start < inner.start:  # shard 1's step began first (shard 0's may begin first where 1's waits)
            assert inner.end <= outer.end, ("shard 0's step waited for shard 1's", k, inner, outer)
            nested += 1
        else:
            assert inner.end <= outer.start, ("two steps of the model at once", k, inner, outer)
    assert nested, "shard 1's step never began first"
    assert max_relative_error(model, expected) <= 1e-5


def test_the_lowest_shards_step_is_let_in_even_with_every_landing_buffer_taken():
    # Four shards, every step ~0.2 s on the host, the backward milliseconds: the gradients of shards 3, 2 and 1 take
    # the model's three landing buffers, and shard 0's copy waits for one. Once it has landed (a step ended), shard 1's
    # step is running or about to, every buffer taken again; shard 0's step, the last gradient of the backward and
    # the one the next forward waits for, is let in between its parts even so (a step of a shard of 1M parameters is
    # eight parts). Without that it would wait for shard 1's step to end. The model still trains as plain PyTorch does.
    steps, model, expected = linears_on_a_slow_host(width=1024, layers=4, batches=2)
    for k in (1, 2):
        first, second = steps[k, 0], steps[k, 1]
        assert first.start < second.end, ("shard 0's step waited for shard 1's", k, first, second)
    assert max_relative_error(model, expected) <= 1e-5
