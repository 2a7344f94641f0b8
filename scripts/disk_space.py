"""Refuse `make setup` in one line when the disk cannot hold the virtual environment.

pip reports a full disk as "[Errno 28] No space left on device" in the middle of an install and
leaves a half-filled .venv behind; this check runs first and names what is free, where, and what
the install needs. Standard library only: it runs before the venv exists.

    python3 scripts/disk_space.py DIRECTORY GIB
"""

from __future__ import annotations

import shutil
import sys

GIB = 1024**3


def shortfall(directory: str, needed_gib: float) -> str | None:
    """The one-line refusal when `directory`'s file system has less than `needed_gib` free."""
    free = shutil.disk_usage(directory).free
    if free >= needed_gib * GIB:
        return None
    return (
        f"make setup: {free / GIB:.1f} GiB free under {directory}; the virtual environment needs "
        f"about {needed_gib:g} GiB (torch's Linux wheels bring CUDA libraries): free some space "
        "or run make with SETUP_GIB=0 to try anyway"
    )


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: disk_space.py DIRECTORY GIB", file=sys.stderr)
        return 2
    try:
        needed = float(argv[1])
    except ValueError:
        print(f"disk_space.py: GIB must be a number of GiB, not {argv[1]!r}", file=sys.stderr)
        return 2
    message = shortfall(argv[0], needed)
    if message:
        print(message, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
