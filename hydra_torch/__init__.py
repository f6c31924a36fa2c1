"""hydra-torch: train many large models at once on few GPUs."""
from hydra_torch._loader import load as _load

_C = _load()

from hydra_torch import ops  # noqa: E402  (registers the ops' fake kernels; needs _C loaded)

__version__ = "0.1.0"
