"""What decoder-only language models share: the causal-LM loss and the checks of a batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def causal_lm_loss(logits, batch):
    """Hugging Face's causal-LM loss: predict token t+1 from tokens <= t, mean over labels != -100."""
    labels = batch["labels"].to(logits.device)
    return F.cross_entropy(logits[:, :-1, :].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX)


def positions_and_mask(config, input_ids, embeds, attention_mask):
    """Position ids 0..T-1 and the model's own causal mask (None where its attention applies causality
    itself), as the Hugging Face model computes them without a cache."""
    from transformers.masking_utils import create_causal_mask

    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    # The cache goes by position: transformers renamed that parameter (past_key_values -> cache) during 5.x.
    mask = create_causal_mask(config, embeds, attention_mask, None, position_ids=position_ids)
    return position_ids, mask


def inputs(batch):
    return batch["input_ids"], batch.get("attention_mask")


def batch_checker(vocab_size: int, max_positions: int | None):
    def check_batch(batch):
        if not isinstance(batch, dict) or "input_ids" not in batch or "labels" not in batch:
            raise KeyError("a language-model batch is a dict with 'input_ids' and 'labels' "
                           "(and optionally 'attention_mask')")
        ids = batch["input_ids"]
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be a 2-d integer tensor (batch, sequence), got {tuple(ids.shape)} "
                             f"{ids.dtype}")
        if max_positions is not None and ids.shape[1] > max_positions:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds the model's n_positions={max_positions}")
        if ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            raise ValueError(f"token ids must lie in [0, {vocab_size}) (the model's vocab_size); found "
                             f"[{int(ids.min())}, {int(ids.max())}]: does the tokenizer match the model?")
        if batch["labels"].shape != ids.shape:
            raise ValueError(f"labels {tuple(batch['labels'].shape)} must have the shape of input_ids "
                             f"{tuple(ids.shape)}")

    return check_batch
