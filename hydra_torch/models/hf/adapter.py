"""The adapter protocol, and the lookup from a model's class to its adapter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

# The transformers releases the adapters are tested against (CI runs them on the oldest and the newest): they
# call the 5.x API (create_causal_mask, decoder blocks returning a tensor). Kept in step with pyproject.toml.
TRANSFORMERS_RANGE = ((5, 17), (6, 0))


@dataclass
class Adapter:
    pieces: list[nn.Module]                        # run in order; each takes the previous one's output
    inputs: Callable[[Any], Any]                   # batch -> what the first piece takes
    loss_fn: Callable[[Any, Any], Any]             # (last piece's output, batch) -> scalar loss
    check_batch: Callable[[Any], None]             # raises a clear error for a batch the model cannot take
    description: str
    # Makes the last piece hand loss_fn what it computes the LM head from, chunk by chunk, instead of the logits
    # (causal_lm.HeadOutput): for the default loss only, since a user's loss_fn takes the logits.
    fuse_head: Callable[[], None]


def adapt(model) -> Adapter | None:
    """The adapter for a Hugging Face model, None for models hydra-torch shards directly (Sequential,
    lists). Raises TypeError for a Hugging Face model of an architecture with no adapter."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config") or not hasattr(model, "base_model_prefix"):
        return None
    check_transformers_version()
    from hydra_torch.models.hf import gpt2, llama

    for family in (gpt2, llama):
        if family.supports(model):
            return family.adapter(model)
    raise TypeError(f"not supported: {type(model).__name__}. hydra-torch shards Hugging Face GPT2LMHeadModel and "
                    f"LlamaForCausalLM as they are; other models can be passed as an nn.Sequential, a list of "
                    f"modules, or with explicit shards=[[module, ...], ...]")


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
