"""Turns the frames tools/segv_backtrace.c printed into a log into function names and source lines, with
addr2line, on the machine where the crash happened (the libraries must be the ones that crashed).

    python3 tools/resolve_frames.py LOG      # prints each frame: library, offset, function, file:line
"""
import re
import shutil
import subprocess
import sys

FRAME = re.compile(r"hydra-segv (pc|#\d+) 0x[0-9a-f]+ (\S+)\+(0x[0-9a-f]+)")


def resolve(library: str, offset: str, addr2line: str) -> str:
    try:
        out = subprocess.run([addr2line, "-f", "-C", "-i", "-e", library, offset], capture_output=True, text=True,
                             timeout=60).stdout.split("\n")
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"addr2line failed: {error}"
    pairs = [f"{fn} at {loc}" for fn, loc in zip(out[0::2], out[1::2]) if fn]
    return " <- ".join(pairs) or "?"


def main(path: str) -> int:
    addr2line = shutil.which("addr2line")
    frames = [m.groups() for m in map(FRAME.search, open(path, errors="replace")) if m]
    if not frames:
        print(f"no hydra-segv frames in {path}")
        return 0
    if addr2line is None:
        print("no addr2line on this machine: frames left as library+offset")
    for label, library, offset in frames:
        where = resolve(library, offset, addr2line) if addr2line else ""
        print(f"{label:>4} {library.rsplit('/', 1)[-1]}+{offset} {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
