"""A task's first batch, read to check it or to measure the model on it, as if it had not been read.

A shuffling DataLoader draws its order as it is iterated: from its own generator (`generator=`, its sampler's),
from torch's where it has none, and a dataset may draw from Python's or NumPy's. Training, plain or here, starts
from those generators as the caller left them; a read that moved one would train on another order, silently,
and the next model the caller builds would draw other initial weights."""
from __future__ import annotations

import contextlib
import random
import sys

import torch


def first_batch(data):
    """`data`'s first batch, every generator its iteration draws from left as it was."""
    with generators_kept(data):
        return next(iter(data))


def has_workers(data) -> bool:
    """Whether iterating `data` starts worker processes (a DataLoader's num_workers): a read to check one batch
    would start them, and a persistent loader keep them and what they drew."""
    return getattr(data, "num_workers", 0) > 0


def own_generators(data) -> list[torch.Generator]:
    """The generators a DataLoader draws its order from beside torch's: its own (`generator=`), its sampler's and
    its batch sampler's sampler's, each once, in that order."""
    samplers = (getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None))
    found = (getattr(data, "generator", None), *(getattr(s, "generator", None) for s in samplers))
    return list({id(g): g for g in found if isinstance(g, torch.Generator)}.values())


@contextlib.contextmanager
def generators_kept(data):
    """torch's CPU generator, Python's and NumPy's, and `data`'s own generators (own_generators), as they were
    before the block."""
    states = [(g, g.get_state()) for g in own_generators(data)]
    python_state = random.getstate()
    numpy = sys.modules.get("numpy")
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for g, state in states:
            g.set_state(state)
        random.setstate(python_state)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)
