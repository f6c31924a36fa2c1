"""What a checkpoint's manifest.json holds, and the checks that refuse one edited or damaged by hand."""
from __future__ import annotations

import json
import re

from hydra_torch.recipe.reals import whole
from hydra_torch.task import PRECISIONS

FORMAT = 1
MANIFEST = "manifest.json"
STATE_FILE = re.compile(r"state-\d+-\d+\.safetensors")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pairs(value) -> bool:
    return isinstance(value, list) and all(isinstance(pair, list) and len(pair) == 2 and whole(pair[0]) and
                                           _number(pair[1]) for pair in value)


def _param_entry(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("shape"), list) and all(map(whole, entry["shape"]))
            and whole(entry.get("steps")))


# Each field of a manifest: what it must be, and the test of it.
_FIELDS = {
    "task": ("a str", lambda v: isinstance(v, str)),
    "steps": ("an int >= 0", whole),
    "epochs_done": ("an int >= 0", whole),
    "losses": ("a list of numbers", lambda v: isinstance(v, list) and all(map(_number, v))),
    "params": ("an object of {shape: [int >= 0, ...], steps: int >= 0} by parameter name",
               lambda v: isinstance(v, dict) and all(map(_param_entry, v.values()))),
    "ties": ("an object of parameter names by parameter name",
             lambda v: isinstance(v, dict) and all(isinstance(first, str) for first in v.values())),
    "optimizer": ("an object", lambda v: isinstance(v, dict)),
    "precision": (f"one of {PRECISIONS}", lambda v: v in PRECISIONS),
    "data_length": ("an int >= 1", lambda v: whole(v, 1)),
    "accumulate": ("an int >= 1", lambda v: whole(v, 1)),
    "time": ("a number", _number),
    "tensors": ("the name of a state-*.safetensors file beside it",
                lambda v: isinstance(v, str) and STATE_FILE.fullmatch(v) is not None),
}
# Fields a checkpoint written before they were recorded lacks.
_OPTIONAL = {
    "eval_losses": ("a list of [steps, loss] pairs", _pairs),
    "stopped": ("null or a str", lambda v: v is None or isinstance(v, str)),
    "rung_reports": ("a list of [rung, metric] pairs", _pairs),
    "selection": ("null or an object (the rule)", lambda v: v is None or isinstance(v, dict)),
    "lr_schedule": ("null or a str", lambda v: v is None or isinstance(v, str)),
    "warmup_steps": ("an int >= 0", whole),
    "base": ("null or a str", lambda v: v is None or isinstance(v, str)),  # the FrozenBase's name
    "clip_grad_norm": ("null or a positive number", lambda v: v is None or (_number(v) and v > 0)),
}


def check_fields(manifest, where: str):
    """Refuses a manifest (edited or damaged by hand) with a field missing, of the wrong type or range, or at
    odds with the others, naming the field."""
    if not isinstance(manifest, dict):
        raise ValueError(f"{where} does not hold a JSON object")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{where} has format {manifest.get('format')!r}; this version reads format {FORMAT}")
    for key, (what, valid) in {**_FIELDS, **_OPTIONAL}.items():
        if key not in manifest and key in _FIELDS:
            raise ValueError(f"{where} lacks the field {key!r}")
        if key in manifest and not valid(manifest[key]):
            raise ValueError(f"{where}: field {key!r} must be {what}, got {json.dumps(manifest[key])[:80]}")
    steps = manifest["steps"]
    if len(manifest["losses"]) != steps:
        raise ValueError(f"{where}: field 'losses' holds {len(manifest['losses'])} losses for {steps} steps")
    per_epoch = -(-manifest["data_length"] // manifest["accumulate"])
    if manifest["epochs_done"] != steps // per_epoch:
        raise ValueError(f"{where}: field 'epochs_done' is {manifest['epochs_done']}, but {steps} steps of "
                         f"{per_epoch} an epoch complete {steps // per_epoch}")
    ahead = [name for name, entry in manifest["params"].items() if entry["steps"] > steps]
    if ahead:
        raise ValueError(f"{where}: field 'params' gives {ahead[0]!r} more steps than the task's {steps}")
    if any(at > steps for at, _ in manifest.get("eval_losses", ())):
        raise ValueError(f"{where}: field 'eval_losses' holds an evaluation after step {steps}")
