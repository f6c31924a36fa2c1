"""The device budget is enforced, resident models are copied once, spilled ones are actually spilled."""
import pytest
import torch

import hydra_torch as ht
from hydra_torch.models import memory
from hydra_torch.models.memory import format_bytes, parse_budget
from models import lm_loss, model_bytes, tied_transformer, token_batches


def run(budget, steps=4, precision="fp32", accumulate=1):
    model = tied_transformer()
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(steps), precision=precision, accumulate=accumulate)
    return model, ht.train([task], devices="cpu", memory_budget=budget)


@pytest.mark.parametrize("fraction", [0.4, 0.5, 0.8, 1.5, 3.0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_high_water_never_exceeds_budget(fraction, precision):
    model = tied_transformer()
    budget = int(fraction * model_bytes(model))
    _, results = run(budget, precision=precision, accumulate=2)
    assert results[0].error is None
    stats = results.stats[0]
    assert 0 < stats["high_water_bytes"] <= stats["capacity_bytes"] <= budget


def test_resident_model_is_copied_once():
    model = tied_transformer()
    _, results = run(100 * model_bytes(model), steps=6)
    result = results[0]
    assert result.resident
    assert result.shard_loads == [1] * len(result.shard_loads)
    assert results.stats[0]["host_to_device_copies"] == len(result.shard_loads)


def test_spilled_model_streams_weights():
    model = tied_transformer()
    _, results = run(int(0.4 * model_bytes(model)), steps=3)
    result = results[0]
    assert not result.resident
    # The host step makes a spilled shard's device copy stale, so every shard comes in at least once a step;
    # a 40% budget also cannot keep every shard from its forward to its backward.
    assert min(result.shard_loads) >= 3
    assert sum(result.shard_loads) > 3 * len(result.shard_loads)
    assert results.stats[0]["host_to_device_bytes"] > 3 * model_bytes(model)


def test_budget_parsing():
    cpu = torch.device("cpu")
    assert parse_budget(4096, cpu) == 4096
    assert parse_budget("8GiB", cpu) == 8 * 2**30
    assert parse_budget("512MB", cpu) == 512 * 10**6
    assert parse_budget("1.5 KiB", cpu) == 1536
    assert 0 < parse_budget("50%", cpu) == pytest.approx(parse_budget(0.5, cpu), rel=0.05)
    for bad in ("lots", "-1GB", "0", "2.5", "8 parsecs"):
        with pytest.raises(ValueError):
            parse_budget(bad, cpu)
    # One rule: integers are bytes, numbers with a fraction part are fractions, whatever their spelling.
    assert parse_budget("2", cpu) == parse_budget(2, cpu) == 2
    assert parse_budget("1", cpu) == 1
    assert parse_budget("1.0", cpu) == parse_budget(1.0, cpu) > 1000
    assert parse_budget("8e9", cpu) == parse_budget(8e9, cpu) == 8 * 10**9, "a whole number is bytes"
    import numpy
    assert parse_budget(numpy.int64(4096), cpu) == 4096
    for bad, message in (("%", "cannot read"), ("abc%", "cannot read"), (2**63, "more than any device"),
                         ("1e400", "not a finite"), ("1e400GB", "not a finite"), ("1e30 TB", "more than any device"),
                         (float("nan"), "fraction"), ("150%", "fraction"), ("2.5", "fraction"), (0, "positive")):
        with pytest.raises(ValueError, match=message):
            parse_budget(bad, cpu)
    with pytest.raises(ValueError):
        parse_budget(-5, cpu)
    with pytest.raises(TypeError):
        parse_budget([1], cpu)
    # Two virtual CPU devices share one memory: each gets half of what one would.
    assert parse_budget("50%", cpu, sharing=2) == pytest.approx(parse_budget("25%", cpu), rel=0.05)
    assert parse_budget(None, cpu, sharing=4) == pytest.approx(parse_budget(None, cpu) / 4, rel=0.05)
    assert parse_budget("8GiB", cpu, sharing=2) == 8 * 2**30, "bytes are per device"
    assert format_bytes(3 * 2**30) == "3.00 GiB"


def _mlp(width=64, depth=4):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


@pytest.mark.parametrize("precision,resident", [("bf16", False), ("bf16", True), ("fp32", False)])
@pytest.mark.parametrize("recipe,accumulator", [({}, False), ({"clip_grad_norm": 1.0}, True),
                                                ({"accumulate": 2}, True)])
def test_host_state_per_parameter(precision, resident, recipe, accumulator):
    # fp32 master 4 + two AdamW moments 8 (+ bf16 shadow 2). A gradient is kept on the host only where a step
    # waits for more than one: an fp32 accumulator (4) to sum micro-batches, and with clipping (every shard
    # waits for the norm) the gradient as it landed: 2 in bf16, 4 in fp32. (Parameters are padded to 16
    # elements; these layers' sizes are multiples of it.)
    model = _mlp()
    params = sum(p.numel() for p in model.parameters())
    data = [(torch.randn(8, 64), torch.randn(8, 64)) for _ in range(4)]
    task = ht.ModelTask(model, data=data, loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out.float(), batch[1]),
                        precision=precision, **recipe)
    budget = 100 * params * 4 if resident else 3 * 64 * 65 * 4 + 65536
    # "host": every shard spilled (a resident shard's state is on the device; the store keeps its master).
    result = ht.train([task], devices="cpu", memory_budget=budget, progress=False, placement="host")[0]
    assert result.error is None and result.resident == resident
    gradient = 2 if precision == "bf16" and "clip_grad_norm" in recipe else 4
    per_param = 12 + (2 if precision == "bf16" else 0) + (gradient if accumulator and not resident else 0)
    assert result.host_bytes == per_param * params
    if not resident:
        assert memory.host_state_bytes(task) == result.host_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("recipe", [{}, {"clip_grad_norm": 1.0}, {"accumulate": 2}])
def test_host_state_of_a_tied_model_is_estimated_exactly(precision, recipe):
    # The embedding's shard owns the weight the head borrows: its step sums both gradients. In bf16 with one
    # micro-batch a step and no clipping, the head's waits as it landed (2 bytes for each of the shard's
    # parameters); otherwise they are summed in an fp32 accumulator (4). The other shards as above.
    model = tied_transformer()
    task = ht.ModelTask(model, data=token_batches(4), loss_fn=lm_loss, precision=precision, **recipe)
    result = ht.train([task], devices="cpu", memory_budget=int(0.5 * model_bytes(model)), progress=False,
                      placement="host")[0]
    assert result.error is None and not result.resident
    assert memory.host_state_bytes(task) == result.host_bytes
    params = sum(p.numel() for p in model.parameters())
    embedding = model[0].weight.numel()
    base = 12 + (2 if precision == "bf16" else 0)
    gradient = 0 if not recipe else (2 if precision == "bf16" and "clip_grad_norm" in recipe else 4)
    tied = 2 if precision == "bf16" and not recipe else 4
    assert result.host_bytes == base * params + tied * embedding + gradient * (params - embedding)


def test_host_state_beyond_available_memory_is_refused_before_anything_is_allocated(monkeypatch):
    model = tied_transformer()
    before = [p.detach().clone() for p in model.parameters()]
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(2))
    params = sum(p.numel() for p in set(model.parameters()))
    # AdamW: master and two moments; the tied embedding's shard an fp32 accumulator.
    assert memory.host_state_bytes(task) == params * 12 + model[0].weight.numel() * 4
    assert memory.host_state_bytes(ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(2), precision="bf16",
                                                accumulate=2)) == params * 18
    monkeypatch.setattr(memory, "available_host_bytes", lambda: params * 12 - 1)
    with pytest.raises(MemoryError, match=r"needs .* but the host has .* available"):
        ht.train([task], devices="cpu", progress=False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())

