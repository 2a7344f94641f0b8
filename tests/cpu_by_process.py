"""Where a test's CPU goes: run a command, sample every process under it, sum CPU by command.

    .venv/bin/python tests/cpu_by_process.py .venv/bin/pytest -q -p no:randomly tests/test_x.py -k y

Every 0.2 s it reads /proc/<pid>/stat (utime + stime, proc(5)) of each descendant and keeps the
largest value seen per process; an exited process keeps what it had used at its last sample
(its stat stays readable until its parent reaps it). A process is its PID and its start time
(stat field 22): the kernel hands a PID out again once it wraps at pid_max (32,768 here, and a
test suite starts far more processes than that), and a new process with an old PID is another
process, not the old one's later sample. CPU seconds, unlike wall time, hardly change
with what else the machine runs, so a test's figure before and after a change compares on a
shared machine. The command's own output is discarded; its exit status is printed first.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


#: A process: its PID and its start time in clock ticks since boot.
Process = tuple[int, int]


def _snapshot() -> tuple[dict[int, list[int]], dict[int, tuple[Process, float, str]]]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    stats: dict[int, tuple[Process, float, str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
            fields = text[text.rindex(")") + 2 :].split()
            command = (entry / "cmdline").read_text().replace("\0", " ").strip()
            if not command:
                command = f"[{(entry / 'comm').read_text().strip()}]"
        except (OSError, ValueError):
            continue
        pid = int(entry.name)
        children[int(fields[1])].append(pid)
        stats[pid] = ((pid, int(fields[19])), (int(fields[11]) + int(fields[12])) / TICKS, command)
    return children, stats


def _kind(command: str) -> str:
    """The first four words of a command line, each without its directory."""
    return " ".join(word.rsplit("/", 1)[-1] for word in command.split()[:4])


def merge(before: tuple[float, str] | None, cpu: float, command: str) -> tuple[float, str]:
    """A process's largest CPU so far and its latest command line. A process that has exited
    and is not yet reaped reads an empty cmdline (its name in brackets here): that never
    replaces the command line already seen, and a busy machine samples more processes in that
    state (a sample that takes longer leaves a longer window between an exit and the reap)."""
    if before is None:
        return cpu, command
    known = before[1] if command.startswith("[") and not before[1].startswith("[") else command
    return max(cpu, before[0]), known


def record(
    seen: dict[Process, tuple[float, str]],
    root: int,
    children: dict[int, list[int]],
    stats: dict[int, tuple[Process, float, str]],
) -> None:
    """Adds one sample of `root` and its descendants to `seen`."""
    stack = [root]
    while stack:
        pid = stack.pop()
        if pid in stats:
            key, cpu, command = stats[pid]
            seen[key] = merge(seen.get(key), cpu, command)
        stack.extend(children.get(pid, []))


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: cpu_by_process.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: dict[Process, tuple[float, str]] = {}
    while process.poll() is None:
        record(seen, process.pid, *_snapshot())
        time.sleep(0.2)
    total: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for cpu, command in seen.values():
        total[_kind(command)] += cpu
        count[_kind(command)] += 1
    print(f"exit status {process.returncode}; CPU {sum(total.values()):.1f} s in all")
    for kind, cpu in sorted(total.items(), key=lambda item: -item[1])[:30]:
        print(f"{cpu:8.1f} s {count[kind]:4d}  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
