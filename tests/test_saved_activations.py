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
