"""ht.plan: pieces measured on the device, shards chosen by the native partitioner, the user's model untouched."""
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hydra_torch as ht
from hydra_torch import _C
from models import lm_loss, tied_transformer, token_batches

WIDTH = 256
# A 4x spread of work between pieces, and enough of them that contiguous shards can balance: an optimal plan
# of k shards is within one piece of total / k, and the slowest piece is under a fifth of total / 3.
HIDDEN = [256, 1024, 512, 256, 768, 512, 1024, 256] * 4


@pytest.fixture(autouse=True)
def one_thread():
    # Two intra-op threads on a 2-core machine shared with other jobs time erratically; one is steady.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def uneven_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, h), nn.ReLU(), nn.Linear(h, WIDTH)) for h in HIDDEN])


def regression_data(count=3, rows=128, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)) for _ in range(count)]


def mse(output, batch):
    return F.mse_loss(output, batch[1])


def mlp_task(model=None, **kwargs):
    return ht.ModelTask(model if model is not None else uneven_mlp(), data=regression_data(), loss_fn=mse,
                        optimizer=ht.optim.SGD(lr=0.01), **kwargs)


def need(plan, a, b, prefetch):
    """A shard's weights, gradients and the prefetched next shard's weights in the arena, and beside it what
    the budget keeps for one unit's working set (the most demanding piece's activations) and one micro-batch's
    saved inputs (every piece's input, at most)."""
    weights = sum(plan.piece_weight_bytes[a:b])
    assert plan.reserve_bytes == max(plan.piece_activation_bytes) + sum(plan.piece_input_bytes)
    return 2 * weights + prefetch + _C.shard_slack_bytes + plan.reserve_bytes


def best_bottleneck(seconds, max_shards):
    """The smallest largest-shard time over contiguous partitions into at most `max_shards` shards (linear
    partition by dynamic programming), from the plan's own measurements; the budget must not bind."""
    n = len(seconds)
    prefix = list(itertools.accumulate(seconds, initial=0.0))
    best = [[math.inf] * (n + 1) for _ in range(max_shards + 1)]
    best[0][0] = 0.0
    for k in range(1, max_shards + 1):
        for i in range(1, n + 1):
            best[k][i] = min(max(best[k - 1][j], prefix[i] - prefix[j]) for j in range(i))
    return min(best[k][n] for k in range(1, max_shards + 1))


def test_measurements_are_positive_and_follow_layer_size():
    plan = ht.plan(mlp_task(), budget="1GiB")
    assert len(plan.piece_seconds) == len(HIDDEN)
    assert all(s > 0 for s in plan.piece_seconds)
    assert all(a > 0 for a in plan.piece_activation_bytes)
    # Every width is a multiple of 16, so no padding: weights + biases in fp32.
    assert plan.piece_weight_bytes == [4 * (2 * WIDTH * h + h + WIDTH) for h in HIDDEN]
    by_width = {h: [s for s, w in zip(plan.piece_seconds, HIDDEN) if w == h] for h in set(HIDDEN)}
    median = {h: sorted(times)[len(times) // 2] for h, times in by_width.items()}
    assert median[1024] > 2 * median[256], median  # 4x the work; allow for overheads and noise
    assert median[1024] > median[512] > median[256], median


def test_plan_is_balanced_and_optimal_for_its_measurements():
    task = mlp_task()
    for max_shards in (2, 3):
        plan = ht.plan(task, budget="1GiB", max_shards=max_shards)
        assert need(plan, 0, len(HIDDEN), sum(plan.piece_weight_bytes)) <= plan.budget_bytes  # time decides
        assert plan.num_shards <= max_shards
        assert plan.bottleneck_seconds <= 1.25 * plan.ideal_seconds, str(plan)
        assert plan.bottleneck_seconds == pytest.approx(best_bottleneck(plan.piece_seconds, max_shards), rel=1e-9)
        assert plan.starts[0] == 0 and plan.piece_ranges[-1][1] == len(HIDDEN)
        assert sum(plan.shard_seconds) == pytest.approx(sum(plan.piece_seconds))
    # Without a limit the slowest piece is the bottleneck; the plan reaches it with as few shards as it can.
    plan = ht.plan(task, budget="1GiB")
    assert plan.bottleneck_seconds == pytest.approx(max(plan.piece_seconds))
    # Fewest shards: no two neighbours could merge without exceeding the bottleneck.
    merged = [sum(plan.shard_seconds[s:s + 2]) for s in range(plan.num_shards - 1)]
    assert all(m > plan.bottleneck_seconds for m in merged) or plan.num_shards == 1


def test_plan_respects_the_budget_and_trains():
    probe = ht.plan(mlp_task(), budget="1GiB")
    budget = int(1.3 * probe.min_budget_bytes)
    plan = ht.plan(mlp_task(), budget=budget)
    assert plan.num_shards > 1
    for s, (a, b) in enumerate(plan.piece_ranges):
        assert plan.prefetch_bytes == max(sum(plan.piece_weight_bytes[x:y]) for x, y in plan.piece_ranges)
        assert plan.shard_bytes[s] == need(plan, a, b, plan.prefetch_bytes) <= budget
    assert "shard" in str(plan) and "bottleneck" in str(plan)

    task = mlp_task(shards=plan.starts)
    assert task.num_shards == plan.num_shards
    results = ht.train([task], memory_budget=budget, devices="cpu", progress=False)
    result = results[task.name]
    assert result.ok and result.steps == 3 and all(math.isfinite(loss) for loss in result.losses)


def test_too_small_budget_names_the_minimum():
    task = mlp_task()
    minimum = ht.plan(task, budget="1GiB").min_budget_bytes
    with pytest.raises(ValueError, match=f"smallest budget that works is {minimum} bytes"):
        ht.plan(task, budget=minimum - 1)
    tight = ht.plan(task, budget=minimum)  # the minimum itself works (byte counts do not vary between probes)
    assert max(tight.shard_bytes) <= minimum
    with pytest.raises(ValueError, match="memory_budget"):
        ht.plan(task, budget="lots")


def test_planning_leaves_the_model_and_generators_unchanged():
    model = nn.Sequential(nn.Linear(WIDTH, 512), nn.BatchNorm1d(512), nn.Dropout(0.5), nn.Linear(512, WIDTH))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = [p for p in model.parameters()]
    rng = torch.get_rng_state()
    task = mlp_task(model)
    plan = ht.plan(task, budget="1GiB")
    assert plan.piece_seconds[2] > 0
    after = model.state_dict()
    assert before.keys() == after.keys()
    for key in before:  # bit-exact, BatchNorm's running statistics included
        assert torch.equal(before[key], after[key]) and before[key].dtype == after[key].dtype, key
    assert [p for p in model.parameters()] == params and all(p.grad is None for p in params)
    assert all(p.device.type == "cpu" and p.requires_grad for p in params)
    assert model.training
    assert torch.equal(torch.get_rng_state(), rng)


def test_hf_gpt2_plan_trains():
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=4, n_head=4, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 16), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    task = ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3))
    assert len(task.pieces) == 6  # embeddings, 4 blocks, final norm + LM head
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = ht.plan(task, budget="1GiB", max_shards=3)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert 1 <= plan.num_shards <= 3
    # Four equal blocks in three shards cannot come near total / 3; the plan is still the best there is.
    assert plan.bottleneck_seconds == pytest.approx(best_bottleneck(plan.piece_seconds, 3), rel=1e-9)
    # The tied wte / lm_head weight counts in both pieces that use it, as the engine stores it for both shards.
    wte_bytes = 4 * config.vocab_size * config.n_embd
    assert plan.piece_weight_bytes[0] >= wte_bytes and plan.piece_weight_bytes[-1] >= wte_bytes

    planned = ht.ModelTask(model, data=data, optimizer=ht.optim.AdamW(lr=1e-3), shards=plan.starts)
    results = ht.train([planned], memory_budget=plan.budget_bytes, devices="cpu", progress=False)
    assert results[planned.name].ok and results[planned.name].steps == 2


def test_apply_plan_recuts_a_task():
    task = mlp_task()
    plan = ht.plan(task, budget="1GiB", max_shards=3)
    ht.planner.apply_plan(task, plan)
    assert task.num_shards == plan.num_shards
    assert [len(group) for group in task.modules] == [b - a for a, b in plan.piece_ranges]
    assert sum(len(params) for params in task.shard_params) == 2 * 2 * len(HIDDEN)



def test_train_with_automatic_shards():
    """shards="auto": ht.train plans for its device and budget, then trains within that budget."""
    budget = int(1.3 * ht.plan(mlp_task(), budget="1GiB").min_budget_bytes)
    task = mlp_task(shards="auto")
    assert task.auto_shards and task.num_shards == len(task.pieces), "one shard per layer until planned"
    results = ht.train([task], memory_budget=budget, devices="cpu", progress=False)
    assert results[0].ok and results[0].steps == 3
    # Plans follow measured times, which vary run to run: check it was planned, not which plan it got.
    assert 1 < task.num_shards < len(task.pieces)
    assert results.stats[0]["high_water_bytes"] <= budget
    with pytest.raises(ValueError, match="shards='fast'"):
        mlp_task(shards="fast")


def test_planned_tasks_of_different_batches_train_together_at_the_budget_the_planner_names():
    """Each device's arena leaves out the largest working set and micro-batch of any task, so every planned task
    is cut for what that leaves: a small-batch model beside a large-batch one, at the smallest budget the
    planner names for the larger, gets shards the arena holds (cut for its own reserve alone, it would take
    shards too large for the arena and be refused)."""
    def task(batch, seed):
        return ht.ModelTask(tied_transformer(seed=seed, dropout=0.0), loss_fn=lm_loss, shards="auto",
                            data=token_batches(2, batch=batch), name=f"batch{batch}")
    budget = ht.plan(task(256, 0), budget="1GiB").min_budget_bytes
    small, large = task(8, 1), task(256, 0)
    results = ht.train([small, large], devices="cpu", memory_budget=budget, progress=False)
    assert all(r.ok for r in results) and small.num_shards == large.num_shards
    stats = results.stats[0]
    assert stats["capacity_bytes"] + stats["working_set_bytes"] + stats["saved_high_water_bytes"] <= budget


def test_a_device_is_read_as_ht_train_reads_it():
    # A CUDA device on a machine without one failed inside torch's lazy init (AssertionError: Torch not compiled
    # with CUDA enabled); "auto" was not a device.
    with pytest.raises(ValueError, match=r"cuda:99 (was asked for but CUDA is not available|does not exist)"):
        ht.plan(mlp_task(), device="cuda:99", budget="1GiB")
    with pytest.raises(ValueError, match="ht.plan plans for one device"):
        ht.plan(mlp_task(), device=["cpu", "cpu"], budget="1GiB")
    expected = "cuda:0" if torch.cuda.is_available() else "cpu"
    assert ht.plan(mlp_task(), device="auto", budget="1GiB", placement=None).device.startswith(expected)
