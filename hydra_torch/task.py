"""ModelTask: one model to train, with everything that defines its training run."""
from __future__ import annotations

import collections.abc

import itertools
import threading
from typing import Any, Callable, Iterable

import torch
from torch import nn

from hydra_torch.models import frozen_base, sharding
from hydra_torch.models.first_batch import first_batch, has_workers
from hydra_torch.models.frozen_base import FrozenBase
from hydra_torch.models.hf import adapt
from hydra_torch.recipe import optim, schedules
from hydra_torch.recipe import param_groups as param_groups_
from hydra_torch.recipe.callables import check_callable
from hydra_torch.recipe.reals import integral, real, whole

PRECISIONS = ("fp32", "bf16")


def _default_inputs(batch):
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, collections.abc.Mapping):  # a dict, or a tokenizer's BatchEncoding
        if "input_ids" not in batch:
            raise KeyError("a dict batch needs 'input_ids' (or pass inputs=lambda batch: ...)")
        return batch["input_ids"]
    return batch


_DTYPE_PRECISION = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def _precision(params, precision: str | None) -> str:
    dtypes = {p.dtype for shard in params for p in shard}
    unsupported = sorted(str(d) for d in dtypes if d not in _DTYPE_PRECISION)
    if unsupported:
        raise ValueError(f"model parameters in {', '.join(unsupported)} are not supported (fp32 or bf16 compute, no "
                         "fp16 loss scaling): pass the model in fp32 (model.float()), with precision='bf16' for bf16")
    if precision is not None:
        return precision
    if len(dtypes) > 1:
        raise ValueError("the model mixes fp32 and bf16 parameters: choose precision='fp32' or 'bf16'")
    return _DTYPE_PRECISION[dtypes.pop()]


def _sized(data) -> bool:
    """Whether `data` is an iterable whose len() answers: a DataLoader over an IterableDataset has __len__, and
    it raises TypeError."""
    if not hasattr(data, "__iter__"):
        return False
    try:
        len(data)
    except TypeError:
        return False
    return True


def _check_batches_form(data, label: str):
    """Data in a form that is no sequence of batches, refused saying what to pass."""
    if isinstance(data, collections.abc.Mapping):  # sized and iterable, but over its keys
        raise TypeError(f"{label} is a dict, one batch: pass a list of batches ([batch, ...]) or a DataLoader")
    if isinstance(data, torch.utils.data.Dataset) and not hasattr(data, "__iter__"):  # map-style: examples
        raise TypeError(f"{label} is a Dataset ({type(data).__name__}): batch its examples with a DataLoader "
                        "(torch.utils.data.DataLoader(dataset, batch_size=..., collate_fn=...))")


def _check_evaluation(eval_data, eval_every):
    if eval_data is None:
        if eval_every is not None:
            raise ValueError("eval_every needs eval_data: the batches to evaluate on")
        return
    _check_batches_form(eval_data, "eval_data")
    if isinstance(eval_data, collections.abc.Iterator):
        raise ValueError(f"eval_data is a one-shot iterator ({type(eval_data).__name__}), spent after one "
                         "evaluation: pass a list or a DataLoader")
    if not _sized(eval_data):
        raise TypeError("eval_data must be a sized iterable of batches (a list or a DataLoader)")
    if len(eval_data) == 0:
        raise ValueError("eval_data is empty: an evaluation needs at least one batch")
    if eval_every is not None and not whole(eval_every, 1):
        raise ValueError(f"eval_every must be a positive int (steps) or None, got {eval_every!r}")


def _first_change(kind: str, built: dict[str, tuple], now: dict[str, tuple]) -> str | None:
    """How `now` differs from what the task was `built` from, or None. Both map a name to (the object, what
    else must stay as it was): the object must be the same one."""
    for name, (thing, *was) in built.items():
        if name not in now:
            return f"its {kind} {name!r} was removed"
        other, *is_ = now[name]
        if other is not thing:
            return f"its {kind} {name!r} was replaced by another"
        if is_ != was:
            return f"its {kind} {name!r} is now {_described(*is_)}, was {_described(*was)}"
    added = next((name for name in now if name not in built), None)
    return None if added is None else f"a {kind} {added!r} was added"


def _described(shape, dtype, device) -> str:
    return f"{tuple(shape)} {str(dtype).removeprefix('torch.')} on {device}"


class ModelTask:
    """A model, its optimizer, loss and data.

    model: a Hugging Face decoder-only causal LM as it is (GPT-2, Llama, Mistral, Qwen, Phi, Gemma, ..., or a peft
    LoRA model of one), an nn.Sequential, a list of modules, or any module with
    explicit ``shards=[[m, ...], ...]`` (for an nn.Sequential or a list, its layers in order, each at its place,
    an nn.Sequential in it opened: groups that leave one out, repeat, move or add one are refused; a Hugging Face
    model is cut by start indices, a count or "auto"). ``shards="auto"`` lets ht.train
    measure the pieces on its device and choose balanced shards that fit its budget (see ht.plan). A module
    used at several places of the model is a layer at each, its parameters trained as one tied weight. A model
    changed after its task was built is refused by ht.train (see check_unchanged): build the task again. It
    trains in the mode it is in: one in eval mode (as from_pretrained leaves it) trains without dropout, and
    ht.train warns where it has dropout or batch-norm layers (warn_eval_mode). A torch.compile, DataParallel or
    DistributedDataParallel wrapper is refused: pass the module it wraps (the model runs shard by shard).
    loss_fn(output, batch) -> scalar tensor, where output is the last shard's output (for a Hugging Face
    model the default is its causal-LM loss on batch["labels"]).
    data: an iterable of batches, re-iterable when epochs > 1. ``inputs(batch)`` is what the first shard takes, for
    a model that is no Hugging Face one (default: batch[0] for tuples, batch["input_ids"] for dicts and other
    mappings, as a tokenizer's or data collator's BatchEncoding, else the batch itself).
    accumulate: micro-batches per optimizer step (the loss is averaged over them, as with loss / n in a plain
    loop; transformers.Trainer weighs each micro-batch by its labelled tokens instead, which is the same only where
    every micro-batch has as many: with padding the two differ).
    clip_grad_norm: global gradient-norm clipping as torch.nn.utils.clip_grad_norm_ (steps then wait for
    the whole backward, since the norm needs every shard's gradients).
    lr_schedule: the learning rate's multiplier at each step, as transformers.get_scheduler's schedules: a name
    ("linear", "cosine", "constant_with_warmup", ...) with ``warmup_steps``, over the task's steps (epochs and
    max_steps counted), or a callable step -> multiplier (LambdaLR semantics: step 0 is the first step).
    param_groups: other learning rates and weight decays for some parameters, as torch.optim's param groups,
    chosen by name pattern, module type or callable (see hydra_torch.recipe.param_groups); e.g.
    ``[{"params": ht.optim.NO_WEIGHT_DECAY, "weight_decay": 0.0}]`` exempts biases and norms, as
    transformers.Trainer does.
    eval_data: validation batches (a sized iterable, like data): the mean of loss_fn over them, each batch
    weighing alike (transformers.Trainer weighs each by its examples: the two differ where batches differ in
    size), is measured under no_grad, the modules in eval mode, after every ``eval_every`` steps and after the
    last step, as units of their own, so one model's evaluation overlaps others' training. Results keep the curve
    (``TaskResult.eval_losses``); evaluation draws no random numbers from the task's training streams.
    base: a hydra_torch.FrozenBase this task's frozen weights are shared with: the tasks built with it hold
    them once on the host and once on a device (a LoRA sweep over one pretrained model; see FrozenBase).
    precision: "fp32" or "bf16" compute (weights and gradients on the device); master weights and optimizer
    state are fp32 either way, and the trained weights come back in the parameters' own dtype. Default: the
    model's dtype (an fp32 model computes in fp32, a bf16 one in bf16).
    """

    _names = itertools.count()

    def __init__(self, model, *, data: Iterable, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                 optimizer=None,
                 epochs: int = 1, name: str | None = None, precision: str | None = None, shards=None,
                 accumulate: int = 1, clip_grad_norm: float | None = None,
                 inputs: Callable[[Any], Any] | None = None, max_steps: int | None = None, lr_schedule=None,
                 warmup_steps: int = 0, param_groups=None, eval_data: Iterable | None = None,
                 eval_every: int | None = None, base: FrozenBase | None = None):
        optimizer = optim.AdamW() if optimizer is None else optimizer
        # Whole numbers of NumPy's or torch's as the ints they are (a checkpoint's manifest records them as JSON).
        epochs, accumulate, max_steps, warmup_steps, eval_every, shards = map(
            integral, (epochs, accumulate, max_steps, warmup_steps, eval_every, shards))
        if isinstance(optimizer, torch.optim.Optimizer) or not isinstance(optimizer, optim.OPTIMIZERS):
            raise TypeError(f"optimizer must be one of hydra_torch.optim.{{Adam, AdamW, SGD}}(...), got "
                            f"{type(optimizer).__name__}: hydra-torch steps shards natively")
        if precision is not None and precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}: use one of {PRECISIONS}")
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        if name in ("", ".", ".."):  # a checkpoint directory is named after its task: this one would be another's
            raise ValueError(f"task name {name!r} cannot name a checkpoint directory of its own: give the task "
                             "another name")
        adapter = adapt(model)
        if adapter is not None and inputs is not None:  # its first shard takes the adapter's reading of the batch
            raise TypeError(f"inputs= is for models cut by hand: a {type(model).__name__} takes its inputs from the "
                            "batch's 'input_ids', 'attention_mask' and 'position_ids' (name them so in the data)")
        if loss_fn is None and adapter is not None:
            loss_fn = adapter.use_default_loss()
        check_callable(loss_fn, "loss_fn", "loss_fn(output, batch)", 2)
        if inputs is not None:
            check_callable(inputs, "inputs", "inputs(batch)", 1)
        for label, value in (("epochs", epochs), ("accumulate", accumulate)):
            if not whole(value, 1):
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        if max_steps is not None and not whole(max_steps, 1):
            raise ValueError(f"max_steps must be a positive int or None, got {max_steps!r}")
        if clip_grad_norm is not None:
            clip_grad_norm = real("clip_grad_norm", clip_grad_norm)  # a tensor or NumPy one, as torch takes it
            if not clip_grad_norm > 0:
                raise ValueError(f"clip_grad_norm must be positive, got {clip_grad_norm!r}")
        schedules.check(lr_schedule, warmup_steps)
        _check_evaluation(eval_data, eval_every)
        _check_batches_form(data, "data")
        if not _sized(data):
            raise TypeError("data must be a sized iterable of batches (a list or a DataLoader): the scheduler "
                            "plans each task's remaining work from its length")

        if isinstance(shards, str) and shards != "auto":
            raise ValueError(f"shards={shards!r}: use 'auto', an int, start indices or module groups")
        self.auto_shards = shards == "auto"  # planned by ht.train for its device and budget
        # Measured by the planner (else 0): one unit's peak beside its weights, and what one micro-batch holds
        # through its step, spilled (its shards' inputs) and resident (its whole autograd graph).
        self.working_set_bytes = self.boundary_bytes = self.graph_bytes = 0
        self.piece_seconds = None  # each piece's forward + backward, once the planner has measured them
        if adapter is not None and sharding.is_explicit(shards):  # its pieces are made here, for the task
            raise ValueError(f"shards: a {type(model).__name__} is cut by start indices over its "
                             f"{len(adapter.pieces)} pieces (the embeddings, each decoder layer, the final norm with "
                             "the head), a count, or 'auto', not by groups of modules")
        groups = sharding.split(adapter.pieces if adapter else model, None if self.auto_shards else shards)
        # The ordered modules the shards were cut from: what the planner probes and its starts index.
        if adapter is not None:
            pieces = list(adapter.pieces)
        elif sharding.is_explicit(shards):
            pieces = [module for group in groups for module in group]
        else:
            pieces = sharding.model_pieces(model)
        sharding.refuse_in_place_weights(groups)
        params = sharding.shard_parameters(groups)
        if not any(params):
            raise ValueError("the model has no parameters to train")
        for group_params in params:
            for p in group_params:
                if p.device.type != "cpu":
                    raise ValueError(f"model parameters must be on the CPU (hydra-torch moves them), found one "
                                     f"of shape {tuple(p.shape)} on {p.device}")
                if not p.is_floating_point():
                    raise ValueError(f"model parameters must be floating point, found {p.dtype}")
        precision = _precision(params, precision)
        if base is not None and not isinstance(base, FrozenBase):
            raise TypeError(f"base must be a hydra_torch.FrozenBase, got {type(base).__name__}")
        # id -> name of each frozen weight the base holds for this task (ht.train checks the tasks agree on them)
        weights_of_base = frozen_base.base_weights(pieces, params) if base is not None else {}
        if base is not None and not weights_of_base:
            raise ValueError(f"the model has no frozen parameters to share in {base!r}: a base holds the weights "
                             "its tasks keep frozen (requires_grad=False)")
        if len(data) == 0:
            raise ValueError("data is empty: a task needs at least one batch")
        one_shot = isinstance(data, collections.abc.Iterator)  # iterating it again would find it spent
        if one_shot and epochs > 1:
            raise ValueError(f"data is a one-shot iterator ({type(data).__name__}), so it cannot be read for "
                             f"epochs={epochs}: pass a list or a DataLoader")
        if one_shot and self.auto_shards:
            raise ValueError("shards='auto' measures the model on a batch of data, which a one-shot iterator would "
                             "lose: pass a list or a DataLoader, or choose the shards")
        # A one-shot iterator's first batch would be lost to the check; a loader with workers would start them.
        # Neither is checked here, but each batch is, as it is drawn.
        if adapter is not None and not one_shot and not has_workers(data):
            adapter.check(first_batch(data))
        if adapter is not None and eval_data is not None and not has_workers(eval_data):
            try:
                adapter.check(first_batch(eval_data))
            except (KeyError, ValueError, TypeError) as error:
                raise type(error)(f"eval_data: {error.args[0] if error.args else error}") from None
        # id(parameter) -> (parameter, lr, weight_decay) where a group overrides the optimizer's
        self.param_options = param_groups_.resolve(param_groups, sharding.root_module(model, pieces), optimizer)

        self.model = model
        self.pieces = pieces
        self.modules = groups
        self.shard_params = params
        self.base = base
        self.base_weights = weights_of_base
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.data = data
        self.inputs = inputs or (adapter.inputs if adapter else _default_inputs)
        self.adapter = adapter
        self.epochs = epochs
        self.accumulate = accumulate
        self.clip_grad_norm = clip_grad_norm
        self.max_steps = max_steps
        self.lr_schedule = lr_schedule
        self.warmup_steps = warmup_steps
        self.precision = precision
        self.eval_data = eval_data
        self.eval_every = eval_every
        self.name = name if name is not None else f"task{next(self._names)}"
        # Set by request_stop; the ht.train call training the task reads them (see there).
        self.stop_reason: str | None = None
        self.stopped_on_request = False
        self.ended = threading.Event()  # set once the task runs no more units in the current ht.train call
        self.steps_done = 0  # optimizer steps taken, as the ht.train call training it goes (for other threads)
        # The steps the last call had taken when it cut the task short (Ctrl-C, SIGTERM, request_stop), else None:
        # a later call without its checkpoint trains it from the start again (warn_restarted).
        self.cut_short_after: int | None = None
        self._built_from = self._layout()  # what check_unchanged compares the model with

    def request_stop(self, reason: str = "stopped on request"):
        """Stops the task at its next step boundary in the ht.train call training it; callable from any thread.
        It ends cut short with `reason` (`TaskResult.cut_short`), its weights those of that step. When the call
        keeps checkpoints, the task's checkpoint of that step is on disk before it ends, so another call can
        continue it. `ended` is set once the task runs no more units (stopped so, or ended otherwise). A request
        made while no call trains the task is for the next call to train it (hydra_torch.cluster asks so of a task
        about to train), which then ends it cut short at its first step boundary; each call's end drops a request."""
        self.stop_reason = reason

    def check_unchanged(self):
        """Raises ValueError, touching nothing, when the model changed after the task was built (a module replaced,
        added or removed; a parameter replaced, or its data given another shape, dtype or device): the task would
        train the modules and parameters it recorded, silently ignoring the edit. Training keeps all of these
        (it rebinds the parameters' data and writes it back as it was), so a task trained before passes."""
        modules, params = self._layout()
        built_modules, built_params = self._built_from
        change = _first_change("module", built_modules, modules) or _first_change("parameter", built_params, params)
        if change is not None:
            raise ValueError(f"task {self.name!r}: the model changed after its ModelTask was built ({change}), and "
                             "the task would train it as it was: build the ModelTask again from the model as it is")

    def check_trains_something(self):
        """Raises ValueError, touching nothing, when none of the model's parameters requires a gradient (a model
        frozen whole, say by requires_grad_(False) meant for its base alone): its steps would change nothing, where
        torch.optim refuses an empty parameter list and a plain loop's backward fails."""
        if not any(p.requires_grad for shard in self.shard_params for p in shard):
            raise ValueError(f"task {self.name!r} has nothing to train: every parameter of its model has "
                             "requires_grad=False. Unfreeze the layers it should train (requires_grad_(True))")

    def _layout(self) -> tuple[dict[str, tuple], dict[str, tuple]]:
        """The model's modules by name (a reused one under each of its names), and the pieces' parameters by name
        with their shape, dtype and device: what check_unchanged compares."""
        # A list is read as it is now: a layer put into it or taken out of it counts.
        root = self.model if isinstance(self.model, nn.Module) else nn.ModuleList(sharding.model_pieces(self.model))
        modules = root.named_modules(remove_duplicate=False)
        params = nn.ModuleList(self.pieces).named_parameters()
        return ({name: (module,) for name, module in modules if name},
                {name: (p, p.shape, p.dtype, p.device) for name, p in params})

    @property
    def total_steps(self) -> int:
        """The optimizer steps it takes: every epoch's (len(data) / accumulate, a last short step included), or
        max_steps if fewer. hydra_torch.run.steps.step_sizes lists them."""
        steps = -(-len(self.data) // self.accumulate) * self.epochs
        return steps if self.max_steps is None else min(steps, self.max_steps)

    @property
    def num_shards(self) -> int:
        return len(self.modules)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What its weights, activations and gradients are on a device (its master weights are fp32)."""
        return {precision: dtype for dtype, precision in _DTYPE_PRECISION.items()}[self.precision]

    def buffers(self) -> list[tuple[nn.Module, str]]:
        """(module, name) of every buffer the shards use, each once."""
        found, seen = [], set()
        for group in self.modules:
            for module in group:
                for sub in module.modules():
                    for name, buf in sub._buffers.items():
                        if buf is not None and (id(sub), name) not in seen:
                            seen.add((id(sub), name))
                            found.append((sub, name))
        return found

    def __repr__(self) -> str:
        return (f"ModelTask(name={self.name!r}, shards={self.num_shards}, optimizer={self.optimizer}, "
                f"precision={self.precision!r}, epochs={self.epochs})")
