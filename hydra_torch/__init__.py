"""hydra-torch: train many large models at once on few GPUs."""
from hydra_torch._loader import load as _load

_C = _load()

__version__ = "0.1.0"
