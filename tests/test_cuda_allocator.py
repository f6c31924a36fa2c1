"""The CUDA caching allocator's configuration: a run lets segments grow in place unless the user configured the
allocator. The rule is checked on any machine with a recording stand-in for PyTorch's setter; the setting as
the allocator reports it, on a GPU."""
import pytest
import torch

import hydra_torch as ht
import placed_training
from hydra_torch.run.devices import expandable_segments
from models import lm_loss, tied_transformer, token_batches

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def configure_recorder():
    calls = []
    return calls, calls.append


def test_a_cuda_run_grows_segments_in_place():
    calls, configure = configure_recorder()
    assert expandable_segments([CUDA], environ={}, configure=configure)
    assert calls == ["expandable_segments:True"]


@pytest.mark.parametrize("variable", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_an_allocator_the_user_configured_is_left_alone(variable):
    calls, configure = configure_recorder()
    assert not expandable_segments([CUDA], environ={variable: "max_split_size_mb:128"}, configure=configure)
    assert calls == []


def test_cpu_devices_leave_the_allocator_alone():
    calls, configure = configure_recorder()
    assert not expandable_segments([CPU, CPU], environ={}, configure=configure)
    assert calls == []


def test_the_setter_exists_in_this_torch():
    """The setter the rule calls by default: where torch has neither spelling, a CUDA run would fail."""
    assert (getattr(torch._C, "_accelerator_setAllocatorSettings", None) is not None
            or hasattr(torch.cuda.memory, "_set_allocator_settings"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_after_a_cuda_run_new_segments_are_expandable(monkeypatch):
    for variable in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(variable, raising=False)
    model = tied_transformer()
    task = ht.ModelTask(model, loss_fn=lm_loss, data=token_batches(2))
    budget = placed_training.budget_of(0.5, task, "cuda:0")
    assert ht.train([task], devices="cuda:0", memory_budget=budget, progress=False)[0].error is None
    torch.cuda.empty_cache()  # no segment cached by an earlier test may serve the block below
    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda:0")  # a new segment, made after the run's
    segments = [s for s in torch.cuda.memory_snapshot() if s["address"] <= block.data_ptr() < s["address"] + s["total_size"]]
    assert segments and segments[0].get("is_expandable", False)
