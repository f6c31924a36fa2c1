"""Before a task has been timed, the scheduler ranks it by its shard costs (parameters), not as if every task
were as small as the ones timed first."""
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import hydra_torch as ht
from hydra_torch import _C
from hydra_torch.models import sharding


def _gpt2(width, layers=2, vocab=256):
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=32, n_embd=width, n_layer=layers, n_head=4,
                                      bos_token_id=0, eos_token_id=0))


def _first_task(scheduler):
    unit = scheduler.next_for(0, 0.0)
    assert unit is not None
    return unit.task


def test_an_untimed_larger_task_goes_first():
    assert _first_task(_C.Scheduler([(3, 4, None, [1.0] * 3), (3, 4, None, [4.0] * 3)], 1, "lrtf", 0)) == 1
    # Without costs both look alike and the lower id wins: the behaviour the costs correct.
    assert _first_task(_C.Scheduler([(3, 4, None, []), (3, 4, None, [])], 1, "lrtf", 0)) == 0


def _cheap_first_unit_run(costs):
    """Two tasks alike (an embedding lookup, two blocks, a head) each time their cheap first unit; then one
    of them times its first block. Returns (remaining seconds of that one, of the other), as the scheduler
    sees them."""
    scheduler = _C.Scheduler([(4, 8, None, costs), (4, 8, None, costs)], 2, "lrtf", 0)
    firsts = [scheduler.next_for(device, 0.0) for device in (0, 1)]
    assert sorted((u.task, u.shard) for u in firsts) == [(0, 0), (1, 0)]
    for device, unit in enumerate(firsts):
        scheduler.complete(device, unit, 0.001)   # a lookup: 0.05 of a 20 ms block
    block = scheduler.next_for(0, 0.0)
    assert block.shard == 1
    scheduler.complete(0, block, 0.02)
    return scheduler.remaining_seconds(block.task), scheduler.remaining_seconds(1 - block.task)


def test_one_cheap_timed_unit_does_not_make_its_task_look_small():
    # The other task is one block behind, so it has more left. Without costs its one cheap timed unit stood
    # for all of its units and it looked 20 times shorter: LRTF would have starved it (the demo's larger
    # models waited a third of the run this way).
    ahead, behind = _cheap_first_unit_run([0.05, 1.0, 1.0, 2.0])
    assert behind == pytest.approx(ahead + 0.02, rel=1e-6)
    ahead, behind = _cheap_first_unit_run([])
    assert behind < ahead / 5


def test_bad_shard_costs_are_refused():
    with pytest.raises(ValueError, match="1 shard costs for 3 shards"):
        _C.Scheduler([(3, 1, None, [1.0])], 1, "lrtf", 0)
    with pytest.raises(ValueError, match="positive and finite"):
        _C.Scheduler([(2, 1, None, [1.0, 0.0])], 1, "lrtf", 0)


def test_gpt2_shard_costs_follow_the_parameters_that_compute():
    small, large = _gpt2(64), _gpt2(128)
    ids = torch.zeros(1, 8, dtype=torch.long)
    data = [{"input_ids": ids, "labels": ids}]
    costs = [sharding.shard_costs(ht.ModelTask(m, data=data).modules) for m in (small, large)]
    for c, width in zip(costs, (64, 128)):
        assert len(c) == 4 and min(c) > 0
        assert c[0] == pytest.approx(0.01 * max(c))                # the embedding shard: lookups only
        assert c[-1] == 256 * width + 2 * width                     # the tied head counts where it multiplies
    assert costs[1][1] / costs[0][1] == pytest.approx(4.0, rel=0.02)   # a block: ~12 width^2
