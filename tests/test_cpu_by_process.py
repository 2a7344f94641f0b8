"""tests/cpu_by_process.py finds the CPU of a grandchild that the sampled command started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
