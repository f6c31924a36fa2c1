"""Adapters that turn models people already have into ordered, shardable pieces."""
from __future__ import annotations

from hydra_torch.models.hf.adapter import Adapter, adapt

__all__ = ["Adapter", "adapt"]
