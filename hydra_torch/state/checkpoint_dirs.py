"""Each task's directory under checkpoint_dir: its name, and a run's hold on it.

A run holds each of its tasks' directories (`claim`: a lock the OS lets go of when the process ends, however
it ends) while it reads the checkpoint, and from just before training until it ends (or the task stops at its
own request), so a second run of the same task is refused instead of deleting the first one's files.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
import urllib.parse
import warnings
from pathlib import Path

LOCK = "lock"
_NAME_MAX = 255  # bytes in a file name on the usual filesystems


def prepare_directory(root):
    """Creates the checkpoint directory if needed; ValueError if it cannot be created or written."""
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"checkpoint_dir {str(root)!r} cannot be created: {error}") from None
    if not os.access(root, os.W_OK):
        raise ValueError(f"checkpoint_dir {str(root)!r} is not writable")


def check_name(name) -> str:
    """The name of the task's directory: the name quoted, so that "a/b" stays one name, and a leading "."
    (which quote keeps) escaped too, so that ".", ".." and ".x" are directories of their own inside
    checkpoint_dir, apart from any other. Other names map as they always have. ValueError for a name that
    cannot be a directory's."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"task name {name!r} cannot name a checkpoint directory: give the task a non-empty str name")
    quoted = urllib.parse.quote(name, safe="")
    if quoted.startswith("."):
        quoted = "%2E" + quoted[1:]
    if len(quoted) > _NAME_MAX:
        raise ValueError(f"task name {name[:40]!r}... is too long for a checkpoint directory: {len(quoted)} bytes "
                         f"quoted, at most {_NAME_MAX}")
    return quoted


def task_dir(root, name) -> Path:
    return Path(root) / check_name(name)


def _holder() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


class Claim:
    """A run's hold on one task's checkpoint directory: an exclusive flock on its lock file, which names the
    run's process. Not `held` where the filesystem has no locks."""

    def __init__(self, fd: int | None):
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self):
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)  # also where a forked process (a loader's worker) shares the file
            os.close(self._fd)
            self._fd = None


def claim(root, name: str) -> Claim:
    """Takes the task's checkpoint directory under `root`, which exists, for this run. Raises ValueError,
    touching nothing, while another run holds it, in this process or another. flock's lock belongs to the open
    file: two in one process conflict as two processes do, and the OS lets go of it when the process ends."""
    directory = task_dir(root, name)
    try:
        fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise ValueError(f"task {name!r}: cannot open the lock of its checkpoints: {error}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip()
        os.close(fd)
        who = ("another ht.train call in this process" if holder.startswith(_holder() + ",")
               else f"another run ({holder or 'which has not named itself yet'})")
        raise ValueError(f"task {name!r}: its checkpoints in {directory} are in use by {who}: let it end, or use "
                         "another checkpoint_dir") from None
    except OSError as error:  # a filesystem without locks (NFS mounted with nolock, say)
        os.close(fd)
        warnings.warn(f"checkpoint_dir {str(root)!r} cannot be locked ({error}): a second run of the same tasks "
                      "on it would not be refused", RuntimeWarning)
        return Claim(None)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{_holder()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
    except OSError:
        pass  # a full disk: the lock holds all the same, without the note of who holds it
    return Claim(fd)
