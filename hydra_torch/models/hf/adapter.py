"""The adapter protocol, and the lookup from a model's class to its adapter."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

# The transformers releases the adapters are tested against (CI runs them on the oldest and the newest): they
# call the 5.x API (create_causal_mask, decoder blocks returning a tensor). Kept in step with pyproject.toml.
TRANSFORMERS_RANGE = ((5, 17), (6, 0))


@dataclass
class Adapter:
    pieces: list[nn.Module]                        # run in order; each takes the previous one's output
    inputs: Callable[[Any], Any]                   # batch -> what the first piece takes
    loss_fn: Callable[[Any, Any], Any]             # (last piece's output, batch) -> scalar loss
    # (batch, labels) -> None: raises a clear error for a batch the model (and with `labels` its loss) cannot take
    check_batch: Callable[[Any, bool], None]
    description: str
    # Makes the last piece hand loss_fn what it computes the LM head from, chunk by chunk, instead of the logits
    # (causal_lm.HeadOutput): for the default loss only, since a user's loss_fn takes the logits.
    fuse_head: Callable[[], None]
    default_loss: bool = False  # the task's loss is loss_fn (use_default_loss), so its batches' labels are its

    def use_default_loss(self):
        """loss_fn, for a task that passed none: its head fused and its batches' labels checked."""
        self.default_loss = True
        self.fuse_head()
        return self.loss_fn

    def check(self, batch) -> None:
        self.check_batch(batch, self.default_loss)


def check_drawn_batch(adapter: Adapter | None, batch) -> None:
    """A batch drawn as its task runs, checked as the first one was when the task was built: a token id or label
    outside the vocabulary would fail on the device (on CUDA as a device-side assert, which ends every task of the
    process). Its values are read where they lie on the CPU only (read on a device, the host would wait for it)."""
    if adapter is None:
        return
    values = batch.values() if isinstance(batch, Mapping) else ()
    if all(not isinstance(value, torch.Tensor) or value.device.type == "cpu" for value in values):
        adapter.check(batch)


def adapt(model) -> Adapter | None:
    """The adapter for a Hugging Face causal LM (or a peft model wrapping one), None for models hydra-torch shards
    directly (Sequential, lists). Raises TypeError, naming what is missing, for a Hugging Face model it cannot
    shard (an encoder-decoder or encoder-only model, parts it does not know), or a wrapper of the model."""
    refuse_wrapper(model)
    if is_peft_model(model):
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(f"the peft model {type(model).__name__} has no trainable parameters: every adapter is "
                             "frozen (was it loaded with is_trainable=False?)")
        config = getattr(model, "active_peft_config", None)
        base = model.get_base_model()
        if getattr(config, "is_prompt_learning", False) or not any(p.requires_grad for p in base.parameters()):
            kind = getattr(getattr(config, "peft_type", None), "value", type(config).__name__)
            raise TypeError(f"not supported: a peft {kind} model, whose trainable parameters live outside the base "
                            "model's layers (prompt learning); hydra-torch trains adapters inside the layers "
                            "(LoRA and its kin)")
        model = base
    if not isinstance(model, nn.Module) or not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return None
    check_transformers_version()
    from hydra_torch.models.hf import decoder, gpt2

    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"not supported: {name} is an encoder-decoder model; hydra-torch trains decoder-only causal "
                        "LMs (AutoModelForCausalLM)")
    if gpt2.supports(model):
        return gpt2.adapter(model)
    if not is_causal_lm(model):
        raise TypeError(f"not supported: {name} is not a causal language model; hydra-torch trains decoder-only "
                        "causal LMs (AutoModelForCausalLM) as they are, other models as an nn.Sequential, a list of "
                        "modules, or with explicit shards=[[module, ...], ...]")
    built = decoder.adapter(model)
    if getattr(model.config, "model_type", None) not in decoder.TESTED:
        decoder.check_against_model(model, built.pieces)
    return built


def refuse_wrapper(model) -> None:
    """Raises TypeError, naming the module to pass instead, for a module that only wraps the model: torch.compile's
    (its `_orig_mod`), DataParallel's or a DistributedDataParallel's (its `module`). hydra-torch runs a model shard by
    shard on the devices it places it on: the wrapper's forward, a whole-model graph or replicas, would never run.
    The wrapper shares the module's parameters, so the module trained is the one the wrapper holds."""
    if not isinstance(model, nn.Module):
        return
    name = type(model).__name__
    if name == "OptimizedModule" and isinstance(model._modules.get("_orig_mod"), nn.Module):
        wrapped, why = "_orig_mod", "torch.compile's wrapper: hydra-torch runs the model shard by shard, not whole"
    elif name in ("DataParallel", "DistributedDataParallel", "FullyShardedDataParallel") \
            and isinstance(model._modules.get("module"), nn.Module):
        wrapped, why = "module", "a wrapper that replicates it: hydra-torch places the model's shards itself"
    else:
        return
    raise TypeError(f"the model is a {name}, {why}; pass the module it wraps (model.{wrapped}), whose parameters the "
                    "wrapper shares")


def is_peft_model(model) -> bool:
    """A peft PeftModel (by its class's module, so that peft is imported only by those who use it)."""
    return type(model).__module__.split(".")[0] == "peft" and callable(getattr(model, "get_base_model", None))


def is_causal_lm(model) -> bool:
    """The class is one AutoModelForCausalLM builds (or named like one, for a model registered elsewhere)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    return name in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or name.endswith("ForCausalLM")


def installed_transformers() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:  # importable without package metadata (a source tree on sys.path)
        import transformers

        return transformers.__version__


def check_transformers_version(version: str | None = None) -> None:
    """Raises ImportError, naming both, when the installed transformers is outside TRANSFORMERS_RANGE."""
    version = installed_transformers() if version is None else version
    digits = ["".join(c for c in part if c.isdigit()) or "0" for part in (version.split(".") + ["0"])[:2]]
    low, high = TRANSFORMERS_RANGE
    if not low <= (int(digits[0]), int(digits[1])) < high:
        raise ImportError(f"hydra-torch's Hugging Face adapters need transformers >= {low[0]}.{low[1]}, < {high[0]}; "
                          f"transformers {version} is installed (pip install 'transformers>={low[0]}.{low[1]},<{high[0]}')")
