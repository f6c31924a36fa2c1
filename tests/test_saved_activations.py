"""The budget covers saved activations: many models in flight on one device never hold more saved bytes there
than the budget leaves them (the runner's own accounting of what each micro-batch holds), and the results say how
the budget was split."""
import hydra_torch as ht
from models import lm_loss, model_bytes, tied_transformer, token_batches

DATA = token_batches(3, batch=16)


def tasks(count):
    return [ht.ModelTask(tied_transformer(seed=i, blocks=3, dropout=0.0), optimizer=ht.optim.AdamW(lr=1e-3),
                         loss_fn=lm_loss, data=DATA, shards=[0, 2, 4], name=f"m{i}") for i in range(count)]


def run(budget, count=8):
    results = ht.train(tasks(count), devices="cpu", memory_budget=budget, progress=False)
    assert all(r.ok for r in results)
    return results, results.stats[0]


def test_models_in_flight_hold_no_more_saved_bytes_than_the_budget_leaves_them():
    # Resident, each micro-batch keeping its shards' autograd graphs until their backward: the arena is their
    # training state whatever the budget above it, and what is left is the saved activations'.
    budget = 256 * model_bytes(tied_transformer(blocks=3))
    _, alone = run(budget, count=1)
    one = alone["saved_high_water_bytes"]  # what one micro-batch holds
    assert one > 0
    _, roomy = run(budget)
    assert roomy["saved_allowance_bytes"] == budget - roomy["capacity_bytes"] >= 8 * one
    assert roomy["saved_high_water_bytes"] >= 4 * one, "with room, LRTF keeps most of the eight models in flight"
    results, tight = run(roomy["capacity_bytes"] + int(2.5 * one))
    assert tight["capacity_bytes"] == roomy["capacity_bytes"], "every model is still resident"
    assert tight["saved_allowance_bytes"] == int(2.5 * one)
    assert one <= tight["saved_high_water_bytes"] <= tight["saved_allowance_bytes"]
    assert "saved activations" in results.summary() and "held at most" in results.summary()


def planned_tasks(count, data):
    return [ht.ModelTask(tied_transformer(seed=i, dropout=0.0), optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss,
                         data=data, shards="auto", name=f"p{i}") for i in range(count)]


def test_the_whole_run_fits_the_budget_arena_working_set_and_saved_inputs_together():
    """Planned tasks whose activations dwarf their weights (batch 256): a budget a little above the planner's
    smallest holds the arena, one unit's working set and the micro-batches in flight all at once, for one model
    (whose whole autograd graph, kept were it resident, would not fit: it is spilled) and for eight (whose arena
    demand alone would fill the budget)."""
    data = token_batches(2, batch=256)
    smallest = ht.plan(planned_tasks(1, data)[0], "cpu", budget="1GiB")
    budget = int(1.1 * smallest.min_budget_bytes)
    assert sum(smallest.piece_activation_bytes) > budget, "a resident micro-batch's graph alone exceeds the budget"
    for count in (1, 8):
        results = ht.train(planned_tasks(count, data), devices="cpu", memory_budget=budget, progress=False)
        assert all(r.ok for r in results) and not any(r.resident for r in results)
        stats = results.stats[0]
        assert stats["working_set_bytes"] > 0 and stats["saved_high_water_bytes"] > 0
        assert stats["saved_high_water_bytes"] <= stats["saved_allowance_bytes"]
        assert stats["capacity_bytes"] + stats["working_set_bytes"] + stats["saved_high_water_bytes"] <= budget


def test_a_model_whose_graph_fits_beside_its_state_stays_resident():
    data = token_batches(2, batch=256)
    graph = sum(ht.plan(planned_tasks(1, data)[0], "cpu", budget="1GiB").piece_activation_bytes)
    results = ht.train(planned_tasks(1, data), devices="cpu", memory_budget=4 * graph, progress=False)
    assert results[0].ok and results[0].resident
    stats = results.stats[0]
    assert stats["capacity_bytes"] + stats["working_set_bytes"] + stats["saved_high_water_bytes"] <= 4 * graph
