"""A task's error as its result keeps it: the traceback as text, the frames let go.

A traceback holds every frame it passed through, and each frame its caller (f_back) with all their locals: a
failed task's error reached the device worker and ht.train's own frame, and so kept the run's engines (an arena
of up to a whole memory budget each, on the GPU too) and models alive for as long as the result was kept."""
from __future__ import annotations

import traceback

_NOTE = "where the task failed (the traceback's frames are not kept):\n"


def detached(error: BaseException | None) -> BaseException | None:
    """`error` itself, its traceback (and those of the errors it was raised from or during) kept as a note."""
    chain = _chain(error)
    if not any(e.__traceback__ is not None for e in chain):
        return error  # nothing to let go: detached already, or never raised
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    for e in chain:
        e.__traceback__ = None
    error.__notes__ = [*getattr(error, "__notes__", ()), _NOTE + text.rstrip("\n")]
    return error


def _chain(error):
    seen, found, todo = set(), [], [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        found.append(e)
        todo += [e.__cause__, e.__context__]
    return found
