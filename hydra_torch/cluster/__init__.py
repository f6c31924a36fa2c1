"""hydra_torch.cluster.train: ht.train on every node of a Ray cluster (see hydra_torch.cluster.driver)."""
from hydra_torch.cluster.driver import BALANCE_SECONDS, MOVE_BEFORE, train

__all__ = ["train", "BALANCE_SECONDS", "MOVE_BEFORE"]
