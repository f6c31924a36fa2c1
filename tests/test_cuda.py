"""The CUDA path: equivalence, the budget as the CUDA allocator sees it, and overlap. Skipped without a GPU."""
import pytest
import torch

import hydra_torch as ht
import placed_training
from models import lm_loss, max_relative_error, model_bytes, tied_transformer, token_batches, train_plain
from placed_training import SEED

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def budget_of(fraction, task):
    """placed_training.budget_of on the GPU (checked on the CPU by test_hand_cut_budget, where no GPU runs this
    file)."""
    return placed_training.budget_of(fraction, task, "cuda:0")


def cuda_batches(count):
    return token_batches(count)


@pytest.mark.parametrize("fraction", [0.4, 100.0])
def test_cuda_training_matches_cpu_reference(fraction):
    data = cuda_batches(10)
    reference = tied_transformer(dropout=0.0)
    train_plain(reference, data, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    model = tied_transformer(dropout=0.0)
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=3e-3), loss_fn=lm_loss, data=data)
    result = ht.train([task], devices="cuda:0", memory_budget=budget_of(fraction, task))[0]
    assert result.error is None
    assert result.resident == (fraction > 1)
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert model[0].weight is model[-1].weight
    # Different kernels (cuBLAS, SDPA) round differently from the CPU ones; TF32 is off by default.
    assert max_relative_error(model, reference) <= 1e-3


def test_cuda_allocations_stay_within_budget():
    model = tied_transformer()
    task = ht.ModelTask(model, loss_fn=lm_loss, data=cuda_batches(4))
    # Run alone, this test is its process's first CUDA user: cuBLAS's workspace and the kernels' first-use
    # allocations would count against the arena. Measuring the task and one untimed run first put them in the
    # baseline.
    budget = budget_of(0.5, task)
    warm = ht.ModelTask(tied_transformer(), loss_fn=lm_loss, data=cuda_batches(1))
    assert ht.train([warm], devices="cuda:0", memory_budget=budget, progress=False)[0].error is None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    results = ht.train([task], devices="cuda:0", memory_budget=budget)
    assert results[0].error is None
    assert results.stats[0]["high_water_bytes"] <= budget
    # The arena is the engine's only allocation for weights and gradients: at most the budget. Activations
    # and the batch come on top; at this size they are far smaller than the model.
    arena_peak = torch.cuda.max_memory_allocated() - baseline
    activation_allowance = 4 * 2**20
    assert arena_peak <= budget + activation_allowance


def test_cuda_bf16_trains():
    model = tied_transformer(dropout=0.0)
    task = ht.ModelTask(model, loss_fn=lm_loss, data=cuda_batches(12), precision="bf16",
                        optimizer=ht.optim.AdamW(lr=3e-3))
    result = ht.train([task], devices="cuda:0", memory_budget=budget_of(0.4, task))[0]
    assert result.error is None
    assert result.losses[-1] < result.losses[0]


def test_cuda_four_spilled_models_stay_within_the_whole_budget():
    """memory_budget is all the device memory a run uses: four planned models at a batch whose saved activations
    would not fit beside each other (nor a resident model's whole graph beside its state) keep every allocation
    of the run, as the CUDA allocator counts it, within the budget."""
    data = token_batches(2, batch=256)
    smallest = ht.plan(ht.ModelTask(tied_transformer(dropout=0.0), loss_fn=lm_loss, data=data), "cuda:0",
                       budget="1GiB")
    budget = int(1.1 * smallest.min_budget_bytes)
    assert sum(smallest.piece_activation_bytes) > budget, "unthrottled, one resident micro-batch would not fit"

    def tasks():
        return [ht.ModelTask(tied_transformer(seed=i, dropout=0.0), optimizer=ht.optim.AdamW(lr=1e-3),
                             loss_fn=lm_loss, data=data, shards="auto", name=f"m{i}") for i in range(4)]
    # A first run puts cuBLAS's workspace and the kernels' first-use allocations in the baseline.
    assert all(r.ok for r in ht.train(tasks(), devices="cuda:0", memory_budget=budget, progress=False))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    results = ht.train(tasks(), devices="cuda:0", memory_budget=budget, progress=False)
    assert all(r.ok for r in results) and not any(r.resident for r in results)
    stats = results.stats[0]
    assert 0 < stats["saved_high_water_bytes"] <= stats["saved_allowance_bytes"]
    assert torch.cuda.max_memory_allocated() - baseline <= budget


# tied_transformer(): 8 layers, the embedding (0) tied to the head (7); under twice its fp32 weights "device" keeps the
# tied ends resident and steps every other shard on the device with the CUDA optimizer kernel.
DEVICE_STEPPED = "spilled, shards 0, 7 resident, shards 1-6 stepped on the device"


def test_cuda_device_stepped_shards_match_cpu_reference():
    data = cuda_batches(10)
    reference = tied_transformer(dropout=0.0)
    train_plain(reference, data, lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.05), seed=SEED)
    model = tied_transformer(dropout=0.0)
    results = placed_training.train(model, data, "device", 2.0, devices="cuda:0")
    result, stats = results[0], results.stats[0]
    assert result.placement == DEVICE_STEPPED
    assert stats["device_steps"] == 6 * result.steps and stats["host_steps"] == 0
    assert stats["high_water_bytes"] <= stats["budget_bytes"]
    assert all(p.device.type == "cpu" for p in model.parameters()) and model[0].weight is model[-1].weight
    assert max_relative_error(model, reference) <= 1e-3


def test_cuda_bf16_device_steps_train_as_host_steps_do():
    data = cuda_batches(8)
    stepped, spilled = tied_transformer(dropout=0.0), tied_transformer(dropout=0.0)
    got = placed_training.train(stepped, data, "device", 2.0, devices="cuda:0", precision="bf16")[0]
    want = placed_training.train(spilled, data, "host", 2.0, devices="cuda:0", precision="bf16")[0]
    assert got.placement == DEVICE_STEPPED and want.placement == "spilled"
    # The CUDA kernel and the host's round the fp32 arithmetic apart; the bf16 weights follow within rounding.
    assert got.losses == pytest.approx(want.losses, rel=1e-2)
    assert got.losses[-1] < got.losses[0]


def test_cuda_device_stepped_shards_keep_their_master_and_moments_pinned():
    # A device-stepped shard's master and AdamW moments cross the link both ways every step: pinned, so that the
    # copies are DMA and do not hold their lane; a host-stepped shard's stay in pageable memory (bf16: its master
    # never crosses).
    model = tied_transformer()
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=cuda_batches(1),
                        precision="bf16")
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), True, True)
    engine = ht._C.DeviceEngine("cuda:0", 100 * model_bytes(model))
    engine.add_model(store, allow_resident=False, resident_shards=[0, 7], device_shards=[2, 3])
    assert store.pinned
    shard_of = {id(p): s for s, params in enumerate(task.shard_params) for p in params}
    for param, master, states, _ in store.param_states():
        stepped = shard_of[id(param)] in (2, 3)
        assert master.is_pinned() == stepped and all(state.is_pinned() == stepped for state in states)
    # One block for the device-stepped shards' masters and moments together.
    blocks = {tensor.untyped_storage().data_ptr() for param, master, states, _ in store.param_states()
              if shard_of[id(param)] in (2, 3) for tensor in (master, *states)}
    assert len(blocks) == 1


def test_cuda_a_models_pinned_transfer_sources_are_one_block_of_the_bytes_they_hold():
    # Not a block per shard rounded up to a power of two, as the caching host allocator would: one block per model
    # at its exact size, each shard's piece starting on a 64-byte line.
    model = tied_transformer()
    task = ht.ModelTask(model, optimizer=ht.optim.AdamW(lr=1e-3), loss_fn=lm_loss, data=cuda_batches(1))
    store = ht._C.ShardStore(task.shard_params, task.optimizer.spec(), False, True)
    assert store.pinned
    masters = [store.master(s) for s in range(store.num_shards)]
    block = masters[0].untyped_storage()
    assert all(m.is_pinned() and m.untyped_storage().data_ptr() == block.data_ptr() for m in masters)
    assert block.nbytes() == sum(-(-store.owned_numel(s) * 4 // 64) * 64 for s in range(store.num_shards))
