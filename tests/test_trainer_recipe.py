"""The usual fine-tuning recipe through hydra-torch equals it through transformers.Trainer: a tiny GPT-2, AdamW,
linear warmup and decay, weight decay that skips biases and LayerNorm weights, max_grad_norm, gradient
accumulation (fp32, CPU). The batches have no padding, so Trainer's token-weighted loss over an accumulated
step is the mean of its micro-batches' losses, which is what hydra-torch averages.

The attention's key bias is left out of the comparison: its gradient is exactly zero in exact arithmetic (a
softmax ignores what it adds to every score of a query), so what either side holds there is rounding noise,
which Adam scales up to full-size updates."""
import copy

import pytest
import torch
from torch.utils.data import SequentialSampler

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (requirements-dev.txt has it)")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

import hydra_torch as ht  # noqa: E402

VOCAB, SEQ, BATCH, ACCUMULATE, STEPS, WARMUP = 64, 16, 4, 2, 6, 2
LR, DECAY, MAX_NORM = 3e-3, 0.1, 0.5


class InOrder(Trainer):
    """Trainer reading the samples in order (its default shuffles), so both see the same batches."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def test_hydra_equals_transformers_trainer_on_the_same_recipe(tmp_path):
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    samples = [{"input_ids": ids, "labels": ids.clone()}
               for ids in torch.randint(0, VOCAB, (STEPS * ACCUMULATE * BATCH, SEQ), generator=g)]

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                             gradient_accumulation_steps=ACCUMULATE, max_steps=STEPS, learning_rate=LR,
                             weight_decay=DECAY, warmup_steps=WARMUP, lr_scheduler_type="linear",
                             max_grad_norm=MAX_NORM, optim="adamw_torch", use_cpu=True, report_to="none",
                             save_strategy="no", logging_strategy="no", dataloader_drop_last=True, seed=0)
    InOrder(model=reference, args=args, train_dataset=samples).train()

    batches = [{key: torch.stack([s[key] for s in samples[i:i + BATCH]]) for key in samples[0]}
               for i in range(0, len(samples), BATCH)]
    task = ht.ModelTask(model, data=batches, optimizer=ht.optim.AdamW(lr=LR, weight_decay=DECAY),
                        accumulate=ACCUMULATE, clip_grad_norm=MAX_NORM, lr_schedule="linear", warmup_steps=WARMUP,
                        param_groups=[{"params": ht.optim.NO_WEIGHT_DECAY, "weight_decay": 0.0}])
    result = ht.train(task, devices="cpu", progress=False)[0]
    assert result.error is None and result.steps == STEPS
    for (name, ours), (_, theirs) in zip(model.named_parameters(), reference.named_parameters()):
        ours, theirs = ours.detach(), theirs.detach()
        if name.endswith("attn.c_attn.bias"):  # query, key, value: drop the key's
            width = config.n_embd
            ours, theirs = torch.cat([ours[:width], ours[2 * width:]]), torch.cat([theirs[:width], theirs[2 * width:]])
        error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert error <= 1e-5, (name, error)
