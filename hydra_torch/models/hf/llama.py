"""Hugging Face Llama (LlamaForCausalLM) as pieces: token embeddings, each decoder layer, final norm + LM head.

As for GPT-2, the pieces hold the model's own submodules (a tie between embeddings and head, when the config
asks for one, stays a tie). Between pieces travels (hidden_states, causal_mask, position_ids); each layer
recomputes its rotary (cos, sin) from the position ids with the model's own rotary module, which is cheap and
keeps floating tensors that need no gradient off the shard boundaries.
"""
from __future__ import annotations

from torch import nn

from hydra_torch.models.hf import causal_lm


def supports(model) -> bool:
    from transformers import LlamaForCausalLM

    return isinstance(model, LlamaForCausalLM)


class Embeddings(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens
        self.config = model.config

    def forward(self, inputs):
        input_ids, attention_mask = inputs
        embeds = self.embed_tokens(input_ids)
        position_ids, mask = causal_lm.positions_and_mask(self.config, input_ids, embeds, attention_mask)
        return embeds, mask, position_ids


class Layer(nn.Module):
    def __init__(self, layer, rotary):
        super().__init__()
        self.layer = layer
        self._rotary = [rotary]  # shared by every layer piece; kept out of this module's children

    def forward(self, inputs):
        hidden, mask, position_ids = inputs
        cos_sin = self._rotary[0](hidden, position_ids=position_ids)  # it moves its inv_freq to hidden's device
        hidden = self.layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=cos_sin,
                            use_cache=False)
        return hidden, mask, position_ids


def adapter(model):
    from hydra_torch.models.hf.adapter import Adapter

    config = model.config
    rotary = model.model.rotary_emb
    pieces = [Embeddings(model), *[Layer(layer, rotary) for layer in model.model.layers],
              causal_lm.LMHead(model.model.norm, model.lm_head)]
    return Adapter(pieces, causal_lm.inputs, causal_lm.causal_lm_loss,
                   causal_lm.batch_checker(config.vocab_size, getattr(config, "max_position_embeddings", None)),
                   f"Llama: token embeddings, {len(model.model.layers)} decoder layers, final norm + LM head",
                   fuse_head=pieces[-1].fuse)
