"""Bad input fails with a clear error before any state changes, and nothing is lost."""
import math

import pytest
import torch
from torch import nn

import hydra_torch as ht
from models import OneShot, lm_loss, model_bytes, tied_transformer, token_batches


def snapshot(model):
    return [(p.data_ptr(), p.detach().clone()) for p in model.parameters()]


def unchanged(model, before):
    return all(p.data_ptr() == ptr and torch.equal(p.detach(), value)
               for p, (ptr, value) in zip(model.parameters(), before))


def test_budget_smaller_than_largest_shard():
    model = tied_transformer()
    before = snapshot(model)
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(2))
    with pytest.raises(ValueError, match="memory budget too small"):
        ht.train([task], devices="cpu", memory_budget=int(0.05 * model_bytes(model)))
    assert unchanged(model, before)


def test_empty_model():
    with pytest.raises(ValueError, match="empty"):
        ht.ModelTask(nn.Sequential(), loss_fn=lm_loss, data=token_batches(1))
    with pytest.raises(ValueError, match="no parameters"):
        ht.ModelTask(nn.Sequential(nn.ReLU(), nn.Tanh()), loss_fn=lm_loss, data=token_batches(1))


class LyingData:
    """Yields `actual` batches while len() says `claimed`; counts the batches read."""

    def __init__(self, actual, claimed):
        self.batches, self.claimed, self.read = token_batches(actual), claimed, 0

    def __len__(self):
        return self.claimed

    def __iter__(self):
        for batch in self.batches:
            self.read += 1
            yield batch


@pytest.mark.parametrize("actual, claimed, message", [(3, 5, "ended after 3 batches, but len"),
                                                      (6, 4, "more than len")])
def test_a_lying_len_stops_that_task_only(actual, claimed, message):
    liar = ht.ModelTask(tied_transformer(seed=0), loss_fn=lm_loss, data=LyingData(actual, claimed), name="liar",
                        epochs=2)
    honest_model = tied_transformer(seed=1)
    honest = ht.ModelTask(honest_model, loss_fn=lm_loss, data=token_batches(4), name="honest", epochs=2)
    with pytest.warns(RuntimeWarning, match="liar"):
        results = ht.train([liar, honest], devices="cpu", progress=False)
    assert isinstance(results[0].error, ValueError) and message in str(results[0].error)
    assert results[1].error is None and results[1].steps == 8
    assert all(torch.isfinite(p).all() for p in honest_model.parameters())


def test_data_is_read_as_the_steps_need_it():
    data = LyingData(300, 300)
    task = ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=data, max_steps=2, accumulate=3)
    results = ht.train([task], devices="cpu", progress=False)
    assert results[0].steps == 2 and data.read == 6, "only the batches of the steps trained were read"


def test_empty_or_one_shot_data():
    with pytest.raises(ValueError, match="data is empty"):
        ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=[])
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}  # one batch, whose iteration yields its keys
    with pytest.raises(TypeError, match="data is a dict, one batch: pass a list of batches"):
        ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=batch)
    with pytest.raises(TypeError, match="eval_data is a dict, one batch"):
        ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=[batch], eval_data=batch)

    with pytest.raises(ValueError, match="one-shot iterator"):
        ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=OneShot(4), epochs=2)
    with pytest.raises(ValueError, match="shards='auto'"):
        ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=OneShot(4), shards="auto")
    results = ht.train([ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=OneShot(4))], devices="cpu",
                       progress=False)
    assert results[0].error is None and results[0].steps == 4, "one pass over a one-shot iterator is fine"


@pytest.mark.parametrize("device", ["meta"] + (["cuda"] if torch.cuda.is_available() else []))
def test_parameters_not_on_cpu(device):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).to(device)
    with pytest.raises(ValueError, match="must be on the CPU"):
        ht.ModelTask(model, loss_fn=lm_loss, data=[])


def test_unsupported_model_type():
    with pytest.raises(TypeError, match="cannot cut a Linear"):
        ht.ModelTask(nn.Linear(3, 3), loss_fn=lm_loss, data=[])


def test_unknown_precision_and_optimizer_arguments():
    model = tied_transformer()
    with pytest.raises(ValueError, match="unknown precision"):
        ht.ModelTask(model, loss_fn=lm_loss, data=[], precision="fp8")
    with pytest.raises(ValueError, match="learning rate"):
        ht.optim.AdamW(lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        ht.optim.Adam(betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="Nesterov"):
        ht.optim.SGD(nesterov=True)
    with pytest.raises(ValueError, match=r"AdamW\(amsgrad=True\) is not supported"):
        ht.optim.AdamW(amsgrad=True)
    with pytest.raises(TypeError, match="hydra_torch.optim"):
        ht.ModelTask(model, loss_fn=lm_loss, data=[], optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="accumulate"):
        ht.ModelTask(model, loss_fn=lm_loss, data=[], accumulate=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        ht.train([ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1))], devices="cpu", schedule="fastest")
    with pytest.raises(ValueError, match=r"pin_memory must be 'auto', True or False, got 'false'"):  # it pinned
        ht.train([ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1))], devices="cpu", pin_memory="false")
    with pytest.raises(TypeError, match="sized iterable"):
        ht.ModelTask(model, loss_fn=lm_loss, data=iter(token_batches(2)))


def test_non_scalar_loss_stops_the_task_before_any_update():
    model = tied_transformer()
    before = [p.detach().clone() for p in model.parameters()]
    task = ht.ModelTask(model, loss_fn=lambda out, batch: out.sum(dim=0), data=token_batches(3))
    with pytest.warns(RuntimeWarning, match="scalar"):
        result = ht.train([task], devices="cpu", memory_budget=int(0.5 * model_bytes(model)))[0]
    assert isinstance(result.error, ValueError) and "scalar" in str(result.error)
    assert result.steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert model[0].weight is model[-1].weight


@pytest.mark.parametrize("budget_fraction", [0.5, 100.0])
@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("devices, precision, clip, bad", [("cpu", None, None, math.nan),
                                                          (["cpu", "cpu"], "bf16", 1.0, math.inf)])
def test_nan_loss_keeps_the_last_good_weights(budget_fraction, accumulate, devices, precision, clip, bad):
    # The loss is read only once the micro-batch's backward is issued: every shard's step reads it first (the
    # commit gate) and skips itself, so no step of the bad micro-batch reaches any shard.
    bad_step = 3
    data = token_batches(6 * accumulate)
    calls = {"n": 0}

    def loss_fn(out, batch):
        calls["n"] += 1
        loss = lm_loss(out, batch)
        # Bad on the last micro-batch of step `bad_step`: earlier micro-batches' gradients must be dropped.
        return loss * bad if calls["n"] == (bad_step + 1) * accumulate else loss

    def make_task(model, loss_fn, data):
        return ht.ModelTask(model, loss_fn=loss_fn, data=data, accumulate=accumulate, precision=precision,
                            clip_grad_norm=clip)

    # The reference: the same training stopped after `bad_step` good steps.
    reference = tied_transformer()
    ht.train([make_task(reference, lm_loss, data[:bad_step * accumulate])], devices=devices,
             memory_budget=int(budget_fraction * model_bytes(reference)))

    model = tied_transformer()
    with pytest.warns(RuntimeWarning, match="step 3"):
        result = ht.train([make_task(model, loss_fn, data)], devices=devices,
                          memory_budget=int(budget_fraction * model_bytes(model)))[0]
    assert isinstance(result.error, ht.NonFiniteLossError)
    assert f"step {bad_step}" in str(result.error)
    assert result.steps == bad_step
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


class _NonFiniteGradient(torch.autograd.Function):
    """The identity, whose backward hands down a non-finite gradient: the loss stays finite."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * math.inf


@pytest.mark.parametrize("budget_fraction", [0.5, 100.0])
@pytest.mark.parametrize("devices, precision, accumulate", [("cpu", None, 1), (["cpu", "cpu"], "bf16", 2)])
def test_a_non_finite_gradient_norm_keeps_the_last_good_weights(budget_fraction, devices, precision, accumulate):
    # A clipped step's norm is summed after the device has gone on: the task ends at its next unit, with no shard
    # stepped, its gradients forgotten, and a model that trains alongside it unaffected.
    bad_step = 3
    data = token_batches(5 * accumulate)
    calls = {"n": 0}

    def loss_fn(out, batch):
        calls["n"] += 1
        bad = calls["n"] == bad_step * accumulate  # the last micro-batch of step `bad_step`
        return lm_loss(_NonFiniteGradient.apply(out) if bad else out, batch)

    def make_task(model, loss_fn, data, name):
        return ht.ModelTask(model, loss_fn=loss_fn, data=data, accumulate=accumulate, precision=precision,
                            clip_grad_norm=1.0, name=name)

    reference, other_reference = tied_transformer(), tied_transformer()
    budget = int(budget_fraction * model_bytes(reference))
    ht.train([make_task(reference, lm_loss, data[:(bad_step - 1) * accumulate], "bad"),
              make_task(other_reference, lm_loss, data, "good")], devices=devices, memory_budget=budget)

    model, other = tied_transformer(), tied_transformer()
    with pytest.warns(RuntimeWarning, match="gradient norm"):
        bad, good = ht.train([make_task(model, loss_fn, data, "bad"), make_task(other, lm_loss, data, "good")],
                             devices=devices, memory_budget=budget)
    assert isinstance(bad.error, ht.NonFiniteGradNormError), bad.error
    assert f"at step {bad_step - 1}" in str(bad.error)
    assert bad.steps == bad_step - 1 and len(bad.losses) == bad_step - 1
    assert good.error is None and good.steps == 5
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(other.parameters(), other_reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works where CUDA is available")
def test_pinned_memory_unavailable_falls_back_with_a_warning():
    model = tied_transformer()
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(2))
    with pytest.warns(RuntimeWarning, match="pinned host memory is unavailable"):
        result = ht.train([task], devices="cpu", memory_budget=int(0.5 * model_bytes(model)), pin_memory=True)[0]
    assert result.error is None and result.steps == 2


def test_unavailable_device():
    model = tied_transformer()
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1))
    with pytest.raises(ValueError):
        ht.train([task], devices="tpu:0")
    if not torch.cuda.is_available():
        for devices in ("cuda:0", 0, ["cpu", 1]):  # an index names a CUDA device, as in model.cuda(0)
            with pytest.raises(ValueError, match="CUDA is not available"):
                ht.train([task], devices=devices)


@pytest.mark.parametrize("groups, message", [
    (lambda L: [L[:2], L[3:]], "layer 2 .* missing"),                  # a block left out
    (lambda L: [L[:3], L[2:]], "layer 2 .* twice"),                    # a block run twice
    (lambda L: [[L[1], L[0]], L[2:]], "layer 1 .* at place 0"),        # two layers swapped
    (lambda L: [L[:2], [nn.Linear(32, 32)], L[2:]], "not one of its layers"),  # a module from elsewhere
    (lambda L: [L[:4]], "layer 4 .* missing"),                         # the head left out
])
def test_explicit_shards_that_are_not_the_models_layers_in_order_are_refused(groups, message):
    """An nn.Sequential or a list of modules runs its layers in order: groups that leave one out, repeat, reorder
    or add one would train another computation."""
    model = tied_transformer()
    with pytest.raises(ValueError, match=message):
        ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1), shards=groups(list(model)))
    blocks = [nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)]
    with pytest.raises(ValueError, match="layer 1 .* missing"):
        ht.ModelTask(nn.ModuleList(blocks), loss_fn=lm_loss, data=token_batches(1), shards=[[blocks[0]], blocks[2:]])


def test_tasks_sharing_parameters_are_refused():
    backbone = nn.Linear(8, 8)
    a = ht.ModelTask(nn.Sequential(backbone, nn.Linear(8, 2)), loss_fn=lm_loss, data=token_batches(1), name="a")
    b = ht.ModelTask(nn.Sequential(backbone, nn.Linear(8, 3)), loss_fn=lm_loss, data=token_batches(1), name="b")
    with pytest.raises(ValueError, match="share a parameter"):
        ht.train([a, b], devices="cpu", progress=False)
    # Even frozen and with one base: the base shares the weights, each task still needs its own module.
    base = ht.FrozenBase()
    frozen = nn.Linear(8, 8).requires_grad_(False)
    a, b = (ht.ModelTask(nn.Sequential(frozen, nn.Linear(8, 2)), loss_fn=lm_loss, data=token_batches(1), name=name,
                         base=base) for name in "ab")
    with pytest.raises(ValueError, match=r"share a parameter of shape \(8, 8\) although both have base "
                                         r"FrozenBase\(.*\): .*copy\.deepcopy"):
        ht.train([a, b], devices="cpu", progress=False)


def test_a_bf16_model_trains_in_bf16_and_fp16_is_refused():
    model = tied_transformer(seed=3).to(torch.bfloat16)
    as_fp32 = tied_transformer(seed=3).to(torch.bfloat16).float()  # the same values, given in fp32
    data = token_batches(3)
    task = ht.ModelTask(model, loss_fn=lm_loss, data=data)
    assert task.precision == "bf16", "the model's own dtype"
    reference = ht.ModelTask(as_fp32, loss_fn=lm_loss, data=data, precision="bf16")
    results = ht.train([task, reference], devices="cpu", progress=False)
    assert all(r.error is None for r in results) and results[0].losses == results[1].losses
    for a, b in zip(model.parameters(), as_fp32.parameters()):
        assert a.dtype == torch.bfloat16 and b.dtype == torch.float32
        assert torch.equal(a, b.to(torch.bfloat16))
    assert ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=data).precision == "fp32"
    with pytest.raises(ValueError, match="float16 are not supported"):
        ht.ModelTask(tied_transformer().half(), loss_fn=lm_loss, data=data)
    with pytest.raises(ValueError, match=r"float64 are not supported \(fp32 or bf16 compute"):
        ht.ModelTask(tied_transformer().double(), loss_fn=lm_loss, data=data)
    mixed = tied_transformer()
    mixed[1].to(torch.bfloat16)
    with pytest.raises(ValueError, match="mixes fp32 and bf16"):
        ht.ModelTask(mixed, loss_fn=lm_loss, data=data)
    assert ht.ModelTask(mixed, loss_fn=lm_loss, data=data, precision="fp32").precision == "fp32"


@pytest.mark.parametrize("seed", [-1, 2**64, 1.5, "7", True, None])
def test_a_seed_outside_the_schedulers_range_is_refused(seed):
    model = tied_transformer()
    before = snapshot(model)
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1))
    with pytest.raises((ValueError, TypeError), match=r"seed must be an int in \[0, 2\*\*64\)"):
        ht.train([task], devices="cpu", progress=False, seed=seed)
    assert unchanged(model, before)


@pytest.mark.parametrize("budget", ["1e-300", 1e-300, "0.0000000000000000001%"])
def test_a_fraction_of_free_memory_below_one_byte_is_refused(budget):
    model = tied_transformer()
    before = snapshot(model)
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1))
    with pytest.raises(ValueError, match=r"memory_budget .* less than one byte"):
        ht.train([task], devices="cpu", progress=False, memory_budget=budget)
    assert unchanged(model, before)


@pytest.mark.parametrize("where, error, message", [("", ValueError, "checkpoint_dir is an empty path"),
                                                   (17, TypeError, "checkpoint_dir must be a path")])
def test_a_checkpoint_dir_that_names_no_directory_is_refused(where, error, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = tied_transformer()
    before = snapshot(model)
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1))
    with pytest.raises(error, match=message):
        ht.train([task], devices="cpu", progress=False, checkpoint_dir=where)
    assert unchanged(model, before)
    assert list(tmp_path.iterdir()) == []


def test_a_second_concurrent_call_in_one_process_is_refused():
    # Both calls' tasks would draw from the one CPU generator the process has: the second is refused, the
    # first trains on as if alone.
    import threading
    first = ht.ModelTask(tied_transformer(seed=0), loss_fn=lm_loss, data=token_batches(4), epochs=500,
                         name="first")
    model = tied_transformer(seed=1)  # built first: building it draws from the generator the run's tasks use
    before = snapshot(model)
    second = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(1), name="second")
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("results", ht.train(
        [first], devices="cpu", progress=False)))
    thread.start()
    try:
        while first.steps_done < 1 and thread.is_alive():
            thread.join(0.01)
        with pytest.raises(RuntimeError, match="another ht.train call is running in this process"):
            ht.train([second], devices="cpu", progress=False)
        assert unchanged(model, before)
    finally:
        first.request_stop("enough")
        thread.join()
    assert outcome["results"]["first"].cut_short
    # Once the first call has returned, the next one runs.
    assert ht.train([second], devices="cpu", progress=False)["second"].steps == 1


def test_a_model_frozen_whole_is_refused_before_any_task_trains():
    # torch.optim refuses an empty parameter list and a plain loop's backward fails; a task that steps nothing
    # would spend its run changing nothing.
    frozen, other = tied_transformer(seed=0).requires_grad_(False), tied_transformer(seed=1)
    before, other_before = snapshot(frozen), snapshot(other)
    tasks = [ht.ModelTask(other, loss_fn=lm_loss, data=token_batches(2), name="trains"),
             ht.ModelTask(frozen, loss_fn=lm_loss, data=token_batches(2), name="frozen")]
    with pytest.raises(ValueError, match="task 'frozen' has nothing to train: every parameter of its model has "
                                         r"requires_grad=False"):
        ht.train(tasks, devices="cpu", progress=False)
    assert unchanged(frozen, before) and unchanged(other, other_before)
    # Frozen after the task was built counts too, and unfreezing one layer is enough.
    thawed = tied_transformer(seed=2)
    task = ht.ModelTask(thawed, loss_fn=lm_loss, data=token_batches(2), name="thawed")
    thawed.requires_grad_(False)
    with pytest.raises(ValueError, match="task 'thawed' has nothing to train"):
        ht.train([task], devices="cpu", progress=False)
    thawed[-2].requires_grad_(True)  # the final norm
    assert ht.train([task], devices="cpu", progress=False)[0].error is None


def test_train_takes_tasks_as_one_task_or_any_collection_of_them_and_names_a_dict():
    def tasks():
        return {f"t{i}": ht.ModelTask(tied_transformer(seed=i, blocks=1), data=token_batches(1), loss_fn=lm_loss,
                                      name=f"t{i}") for i in range(2)}

    with pytest.raises(TypeError, match=r"got a dict of them: pass its values, list\(tasks.values\(\)\)"):
        ht.train(tasks(), devices="cpu", progress=False)  # iterating it gives the names
    for bad in ([], ["t0"], None):
        with pytest.raises(TypeError, match="a non-empty list of ModelTask"):
            ht.train(bad, devices="cpu", progress=False)
    assert [r.name for r in ht.train(tasks().values(), devices="cpu", progress=False)] == ["t0", "t1"]
