"""The main job (python -m hydra_torch.demo) and its offline corpus."""
from hydra_torch.demo.job import main

__all__ = ["main"]
