"""ht.optim: the optimizers hydra-torch runs natively on each shard (see hydra_torch.recipe.optim)."""
from hydra_torch.recipe.optim import NO_WEIGHT_DECAY, OPTIMIZERS, SGD, Adam, AdamW

__all__ = ["Adam", "AdamW", "SGD", "NO_WEIGHT_DECAY", "OPTIMIZERS"]
