"""hydra-torch: train many large models at once on few GPUs."""
from hydra_torch._loader import load as _load

_C = _load()

from hydra_torch import ops  # noqa: E402  (registers the ops' fake kernels; needs _C loaded)
from hydra_torch import optim  # noqa: E402
from hydra_torch.api import train  # noqa: E402
from hydra_torch.planner import Plan, plan  # noqa: E402
from hydra_torch.results import Results, TaskResult  # noqa: E402
from hydra_torch.runner import NonFiniteGradNormError, NonFiniteLossError  # noqa: E402
from hydra_torch.selection import SuccessiveHalving  # noqa: E402
from hydra_torch.task import ModelTask  # noqa: E402

__all__ = ["ModelTask", "train", "plan", "Plan", "optim", "ops", "Results", "TaskResult", "NonFiniteLossError",
           "NonFiniteGradNormError", "SuccessiveHalving"]
__version__ = "0.1.0"
