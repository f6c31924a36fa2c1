"""What ht.train (and Arrivals.add) check and warn of across the tasks of a call, once each is built."""
from __future__ import annotations

import warnings

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd


def check_own_models(tasks):
    """Raises ValueError when two tasks train a parameter in common: each needs a model of its own."""
    owners = {}
    for task in tasks:
        for p in (p for shard in task.shard_params for p in shard):
            other = owners.setdefault(id(p), task)
            if other is task:
                continue
            shared = f"tasks {other.name!r} and {task.name!r} share a parameter of shape {tuple(p.shape)}"
            if task.base is not None and other.base is task.base:  # the base shares values, not parameter objects
                raise ValueError(f"{shared} although both have base {task.base!r}: each task needs a model of its "
                                 "own even so (copy.deepcopy it), and the base holds the frozen weights once")
            raise ValueError(f"{shared}: each task needs a model of its own (copy.deepcopy it; to hold frozen "
                             "weights they have in common once, pass both base=ht.FrozenBase())")


def warn_restarted(tasks, resumed, stacklevel: int):
    """Warns of each task an earlier call cut short after some steps that this call (or a run it joins) trains from
    the start again, with no checkpoint of it (`resumed`: its checkpoint, or None): a notebook cell run again after a
    Ctrl-C does not continue the run it stopped. `stacklevel`: the user's frame, counted from here."""
    for task, checkpoint in zip(tasks, resumed):
        if task.cut_short_after and checkpoint is None:
            warnings.warn(f"task {task.name!r} was cut short after {task.cut_short_after} of its {task.total_steps} "
                          "steps by an earlier call; this call trains it again from the start of its data and "
                          "schedule, its weights as they are and its optimizer state new (a call with checkpoint_dir= "
                          "keeps what a later call with the same checkpoint_dir resumes)", RuntimeWarning,
                          stacklevel=stacklevel + 1)


def warn_eval_mode(tasks, stacklevel: int):
    """Warns for each task whose model has a layer in eval mode whose mode changes what it computes (dropout, batch
    norm): it trains so, as a plain loop would, where transformers.Trainer calls model.train() first, and
    from_pretrained leaves a model in eval mode. `stacklevel`: the user's frame, counted from here."""
    for task in tasks:
        # The model's own mode (a peft model's base's): a layer put in eval mode alone (a frozen batch norm in a
        # model that trains) is deliberate.
        model = task.model.get_base_model() if hasattr(task.model, "get_base_model") else task.model
        roots = [model] if isinstance(model, nn.Module) else task.pieces
        off = {id(m): m for root in roots if not root.training for m in root.modules() if not m.training and (
            (isinstance(m, _BatchNorm) and m.track_running_stats) or (isinstance(m, _DropoutNd) and m.p > 0))}
        if not off:
            continue
        dropout = sum(isinstance(m, _DropoutNd) for m in off.values())
        kinds = [(dropout, "dropout", "no dropout"),
                 (len(off) - dropout, "batch-norm", "batch norm on its running statistics")]
        counts = [f"{n} {kind} layer{'s' if n > 1 else ''}" for n, kind, _ in kinds if n]
        effects = [effect for n, _, effect in kinds if n]
        warnings.warn(f"task {task.name!r}: its model is in eval mode ({' and '.join(counts)}), as from_pretrained "
                      f"leaves a model, and trains so ({', '.join(effects)}), as a plain loop would; call "
                      "model.train() first to train as transformers.Trainer does", UserWarning,
                      stacklevel=stacklevel + 1)
