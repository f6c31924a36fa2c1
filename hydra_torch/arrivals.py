"""hydra_torch.arrivals: tasks joining a running ht.train call (see hydra_torch.selection.arrivals)."""
from hydra_torch.selection.arrivals import Arrivals, OpenRun, RunClosedError

__all__ = ["Arrivals", "RunClosedError", "OpenRun"]
