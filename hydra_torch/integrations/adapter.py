"""The adapter protocol, and the lookup from a model's class to its adapter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn


@dataclass
class Adapter:
    pieces: list[nn.Module]                        # run in order; each takes the previous one's output
    inputs: Callable[[Any], Any]                   # batch -> what the first piece takes
    loss_fn: Callable[[Any, Any], Any]             # (last piece's output, batch) -> scalar loss
    check_batch: Callable[[Any], None]             # raises a clear error for a batch the model cannot take
    description: str


def adapt(model) -> Adapter | None:
    """The adapter for a Hugging Face model, None for models hydra-torch shards directly (Sequential,
    lists). Raises TypeError for a Hugging Face model of an architecture with no adapter."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return None
    from hydra_torch.integrations import gpt2, llama

    for family in (gpt2, llama):
        if family.supports(model):
            return family.adapter(model)
    raise TypeError(f"not supported: {type(model).__name__}. hydra-torch shards Hugging Face GPT2LMHeadModel and "
                    f"LlamaForCausalLM as they are; other models can be passed as an nn.Sequential, a list of "
                    f"modules, or with explicit shards=[[module, ...], ...]")
