"""hydra-torch: train many large models at once on few GPUs."""
from hydra_torch import ops  # registers the ops' fake kernels
from hydra_torch import arrivals  # hydra_torch.arrivals.Arrivals after import hydra_torch
from hydra_torch import optim  # ht.optim is hydra_torch.optim
from hydra_torch.api import train
from hydra_torch.models import planner  # ht.planner.apply_plan
from hydra_torch.models.frozen_base import FrozenBase
from hydra_torch.models.planner import Plan
from hydra_torch.planning import plan
from hydra_torch.report.results import Results, TaskResult
from hydra_torch.run.compute import NonFiniteGradNormError, NonFiniteLossError
from hydra_torch.selection.rules import SuccessiveHalving
from hydra_torch.task import ModelTask

__all__ = ["ModelTask", "FrozenBase", "train", "plan", "Plan", "optim", "ops", "Results", "TaskResult",
           "NonFiniteLossError", "NonFiniteGradNormError", "SuccessiveHalving"]
__version__ = "0.1.0"
