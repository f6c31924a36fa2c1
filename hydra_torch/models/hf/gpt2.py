"""Hugging Face GPT-2 (GPT2LMHeadModel) as pieces: embeddings, each block, final norm + LM head.

The pieces hold the model's own submodules, so training updates the user's model in place and the tie
between `wte` and `lm_head` stays a tie (the engine stores the shared weight once and sums its gradients).
Between pieces travels (hidden_states, Carried(causal_mask), position_ids): the mask comes from the model's own
`create_causal_mask`, so padding in `attention_mask` and the attention implementation behave as in HF, and
takes no gradient at the shard boundaries (a float mask of eager attention would otherwise get one per block).
A batch's `token_type_ids` are embedded by `wte` and added as GPT2Model adds them (the other decoders' forwards take
none).
"""
from __future__ import annotations

import torch
from torch import nn

from hydra_torch.models.carried import Carried
from hydra_torch.models.hf import causal_lm


def supports(model) -> bool:
    from transformers import GPT2LMHeadModel

    return isinstance(model, GPT2LMHeadModel)


class Embeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.wte, self.wpe, self.drop = model.transformer.wte, model.transformer.wpe, model.transformer.drop
        self.config = model.config

    def forward(self, inputs):
        input_ids, attention_mask, position_ids, token_type_ids = inputs
        if input_ids.shape[-1] > self.config.n_positions:
            raise ValueError(f"sequence length {input_ids.shape[-1]} exceeds the model's "
                             f"n_positions={self.config.n_positions}")
        embeds = self.wte(input_ids)
        position_ids, mask = causal_lm.positions_and_mask(self.config, input_ids, embeds, attention_mask,
                                                                 position_ids)
        hidden = embeds + self.wpe(position_ids)
        if token_type_ids is not None:  # in GPT2Model's order: after the positions, before the dropout
            hidden = hidden + self.wte(token_type_ids)
        return self.drop(hidden), Carried(mask), position_ids


def inputs(batch):
    return (*causal_lm.inputs(batch), batch.get("token_type_ids"))


def batch_checker(config):
    """causal_lm's checks, and token_type_ids of input_ids' shape, each an id of the vocabulary (wte embeds them)."""
    check_causal_lm = causal_lm.batch_checker(config.vocab_size, config.n_positions)

    def check_batch(batch, labels: bool):
        check_causal_lm(batch, labels)
        types, ids = batch.get("token_type_ids"), batch["input_ids"]
        if types is None:
            return
        if not isinstance(types, torch.Tensor) or types.shape != ids.shape or types.dtype not in causal_lm.ID_DTYPES:
            raise ValueError(f"token_type_ids must be an int64 (or int32) tensor of input_ids' shape "
                             f"{tuple(ids.shape)}, got {causal_lm.described(types)}{causal_lm.tensors_hint(types)}")
        causal_lm.check_range("token_type_ids", types, 0, config.vocab_size, "GPT-2 embeds them as tokens")

    return check_batch


class Block(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, inputs):
        hidden, mask, position_ids = inputs
        return self.block(hidden, None, mask.values, use_cache=False, position_ids=position_ids), mask, position_ids


def adapter(model):
    from hydra_torch.models.hf.adapter import Adapter

    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise TypeError("not supported: GPT2LMHeadModel with cross-attention (add_cross_attention=True)")

    pieces = [Embeddings(model), *[Block(b) for b in model.transformer.h],
              causal_lm.LMHead(model.transformer.ln_f, model.lm_head)]
    return Adapter(pieces, inputs, causal_lm.causal_lm_loss, batch_checker(config),
                   f"GPT-2: embeddings, {len(model.transformer.h)} blocks, final norm + LM head",
                   fuse_head=pieces[-1].fuse)
