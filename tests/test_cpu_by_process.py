"""tests/cpu_by_process.py finds the CPU of a grandchild that the sampled command started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_by_process import merge, record

TOOL = Path(__file__).with_name("cpu_by_process.py")


def test_a_grandchilds_cpu_is_counted_under_its_command() -> None:
    busy = f"{sys.executable} -c 'sum(range(20_000_000)); import time; time.sleep(0.5)'"
    run = subprocess.run(
        [sys.executable, str(TOOL), "sh", "-c", busy],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = run.stdout.splitlines()
    assert lines[0].startswith("exit status 0; CPU ")
    python = [line for line in lines[1:] if "-c sum(range(20_000_000));" in line]
    assert len(python) == 1
    assert float(python[0].split()[0]) >= 0.1


def test_no_command_is_a_usage_line() -> None:
    run = subprocess.run(
        [sys.executable, str(TOOL)], check=False, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert run.stderr.strip() == "usage: cpu_by_process.py COMMAND [ARG...]"


def test_an_exited_process_keeps_the_command_line_it_was_seen_with() -> None:
    # Exited and not yet reaped, a process reads an empty cmdline: the sample names it "[comm]".
    seen = merge(None, 0.3, "python3 -c sum(range(20_000_000))")
    seen = merge(seen, 0.5, "[python3]")
    assert seen == (0.5, "python3 -c sum(range(20_000_000))")
    # A command line that changes (sh execs the command it was given) is followed.
    assert merge((0.0, "sh -c python3 x.py"), 0.1, "python3 x.py") == (0.1, "python3 x.py")


def test_a_pid_used_again_by_a_new_process_is_counted_as_another_process() -> None:
    # PIDs wrap at pid_max (32,768 here): a later process may get an earlier one's PID. Its
    # start time (stat field 22) tells them apart; by PID alone the trainer's 5 s would be
    # credited to the `sleep` and the `sleep`'s own sample lost.
    seen: dict[tuple[int, int], tuple[float, str]] = {}
    record(seen, 1, {1: [7]}, {1: ((1, 10), 0.1, "sh"), 7: ((7, 20), 5.0, "python3 train.py")})
    record(seen, 1, {1: [7]}, {1: ((1, 10), 0.1, "sh"), 7: ((7, 900), 0.01, "sleep 0.5")})
    assert seen[(7, 20)] == (5.0, "python3 train.py")
    assert seen[(7, 900)] == (0.01, "sleep 0.5")
    assert sum(cpu for cpu, _ in seen.values()) == pytest.approx(5.11)
