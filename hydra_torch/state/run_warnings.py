"""Warnings given while a run trains, on its workers' threads or its own (device 0's worker is the caller's).

A warnings filter that raises (`python -W error`, pytest's filterwarnings = error) would turn such a warning into
an exception in the middle of the run: a device's worker that died of it left its tasks cut short and reported as
finished, a callback thread that died of it left the run waiting for ever, and a unit that raised it failed its
task. Every one of these warnings says the run goes on; under a filter that raises, it is written to stderr (where
there is one) and the run goes on as it says."""
from __future__ import annotations

import sys
import warnings


def warn_in_run(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    try:
        warnings.warn(message, category, stacklevel=stacklevel + 1)
    except Warning:
        if sys.stderr is not None:
            sys.stderr.write(f"{category.__name__}: {message}\n")
