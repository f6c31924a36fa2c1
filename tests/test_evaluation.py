"""Evaluation: validation loss through the shards as scheduled units, equal to plain PyTorch's evaluation of the
same weights at the same steps, without disturbing training; and its bad inputs."""
import pytest
import torch

import hydra_torch as ht
from models import lm_loss, model_bytes, tied_transformer, token_batches

SEED = 123


@torch.no_grad()
def plain_eval(model, batches) -> float:
    model.eval()
    losses = [lm_loss(model(b[0]), b).item() for b in batches]
    model.train()
    return sum(losses) / len(losses)


def train_plain_with_eval(model, data, eval_data, every, lr=3e-3):
    """The usual loop, evaluating after every `every` steps and after the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(SEED)
    losses, evals = [], []
    for step, batch in enumerate(data, 1):
        optimizer.zero_grad()
        loss = lm_loss(model(batch[0]), batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % every == 0 or step == len(data):
            evals.append((step, plain_eval(model, eval_data)))
    return losses, evals


def hydra_task(model, data, eval_data=None, every=None, lr=3e-3, **options):
    return ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=lr), loss_fn=lm_loss, data=data, eval_data=eval_data,
                        eval_every=every, **options)


@pytest.mark.parametrize("placement", ["spilled", "resident", "two_devices"])
def test_validation_curve_matches_plain_pytorch_and_training_is_undisturbed(placement):
    data, eval_data = token_batches(10), token_batches(3, seed=7)
    reference = tied_transformer()
    reference_losses, reference_evals = train_plain_with_eval(reference, data, eval_data, every=4)

    model, twin = tied_transformer(), tied_transformer()
    budget = int(0.4 * model_bytes(model)) if placement == "spilled" else None
    devices = ["cpu", "cpu"] if placement == "two_devices" else "cpu"
    torch.manual_seed(SEED)
    # Its batches in a shuffled order each time: the mean is the same, and the shuffle must not draw from the
    # task's training stream.
    shuffled = torch.utils.data.DataLoader(eval_data, batch_size=None, shuffle=True)
    results = ht.train([hydra_task(model, data, shuffled, 4), hydra_task(twin, data, name="no-eval")],
                       devices=devices, memory_budget=budget, progress=False)
    evaluated, plain = results[0], results[1]
    assert evaluated.error is None, evaluated.error
    assert [step for step, _ in evaluated.eval_losses] == [4, 8, 10]
    for (step, ours), (_, theirs) in zip(evaluated.eval_losses, reference_evals):
        assert ours == pytest.approx(theirs, rel=1e-5), step
    # Evaluation draws from no training stream (dropout on, shuffles): training is bit-identical without it.
    assert evaluated.losses == plain.losses
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    assert all(m.training for m in model.modules())  # eval mode only during the evaluation units
    assert results.trace and any(e.phase == "evaluate" for e in results.trace)
    assert plain.eval_losses == [] and evaluated.final_eval_loss == evaluated.eval_losses[-1][1]


def test_evaluation_is_scheduled_between_steps_with_accumulation_and_epochs():
    data, eval_data = token_batches(5), token_batches(2, seed=7)
    model = tied_transformer(blocks=2)
    results = ht.train([hydra_task(model, data, eval_data, every=2, accumulate=2, epochs=2)], devices="cpu",
                       progress=False)
    # 3 steps an epoch (2 + 2 + 1 micro-batches), 6 in all: evaluated after steps 2, 4, 6.
    assert [step for step, _ in results[0].eval_losses] == [2, 4, 6]
    evaluations = [e for e in results.trace if e.phase == "evaluate"]
    assert len(evaluations) == 3 * len(eval_data) * results[0].shard_loads.__len__()


def test_results_name_the_best_by_validation_loss_and_plot_the_curves(tmp_path):
    data, eval_data = token_batches(6), token_batches(2, seed=7)
    tasks = [hydra_task(tied_transformer(seed=i, blocks=1), data, eval_data, every=3, lr=lr, name=f"lr{lr}")
             for i, lr in enumerate([3e-3, 1e-5])]
    results = ht.train(tasks, devices="cpu", progress=False)
    best = min(results, key=lambda r: r.final_eval_loss)
    assert results.best is best
    assert "eval loss" in results.summary() and f"best: {best.name} (validation loss" in results.summary()
    results.plot_curves(tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_bad_evaluation_arguments_are_refused_before_training():
    model = tied_transformer(blocks=1)
    before = [p.detach().clone() for p in model.parameters()]
    data = token_batches(2)
    with pytest.raises(ValueError, match="eval_every needs eval_data"):
        hydra_task(model, data, None, every=2)
    with pytest.raises(ValueError, match="eval_data is empty"):
        hydra_task(model, data, [], every=2)
    with pytest.raises(ValueError, match="one-shot iterator"):
        hydra_task(model, data, iter(token_batches(2)))
    with pytest.raises(ValueError, match="one-shot iterator"):
        hydra_task(model, data, (b for b in token_batches(2)))
    with pytest.raises(TypeError, match="sized iterable"):
        hydra_task(model, data, 5)
    for every in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="eval_every must be a positive int"):
            hydra_task(model, data, token_batches(1), every=every)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


class LyingLength(list):
    def __init__(self, batches, claimed):
        super().__init__(batches)
        self.claimed = claimed

    def __len__(self):
        return self.claimed


@pytest.mark.parametrize("eval_data, message", [
    ([(torch.zeros(2, 3, 5), torch.zeros(2, 3, dtype=torch.long))], "in the evaluation after step 2"),
    (LyingLength(token_batches(2, seed=7), 3), "eval_data ended after 2 batches"),
    (LyingLength(token_batches(3, seed=7), 2), "more than len\\(eval_data\\) = 2"),
])
def test_evaluation_that_fails_stops_only_its_task(eval_data, message):
    data = token_batches(2)
    bad, good = tied_transformer(blocks=1), tied_transformer(seed=1, blocks=1)
    results = ht.train([hydra_task(bad, data, eval_data, name="bad"), hydra_task(good, data, token_batches(1))],
                       devices="cpu", progress=False)
    error = results["bad"].error
    assert error is not None
    assert __import__("re").search(message, str(error) + "\n".join(getattr(error, "__notes__", [])))
    assert results["bad"].steps == 2  # its training was done; its weights are those of its last step
    assert results[1].error is None and results[1].steps == 2 and len(results[1].eval_losses) == 1
