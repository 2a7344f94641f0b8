"""tests/cpu_times.py: `--cpu-durations=N` lists the tests that took the most CPU time, counting
the processes a test waited for, in a serial run and under xdist (the measure travels from the
worker in the test's report). pytest runs in a process of its own on a small test file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

#: CPU seconds the busy test's child process spends (by its own clock, not a timer).
BUSY = 0.6
TESTS = f"""
import subprocess
import sys

SPIN = "import time\\nwhile time.process_time() < {BUSY}:\\n    pass\\n"


def test_busy_child():
    subprocess.run([sys.executable, "-c", SPIN], check=True)


def test_idle():
    pass
"""
ROW = re.compile(r"^\s*([0-9.]+)s cpu  (\S+)$")


def _run(tmp_path: Path, *args: str) -> str:
    (tmp_path / "test_cases.py").write_text(TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "400"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.cpu_times", "-p", "no:cacheprovider",
         "-q", *args, str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["serial", "xdist"])
def test_the_busiest_test_is_listed_first_with_its_childs_cpu(
    tmp_path: Path, workers: list[str]
) -> None:
    output = _run(tmp_path, "--cpu-durations=5", *workers)
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if "most CPU time: 5 tests" in line)
    rows = [m.groups() for line in lines[start + 1 : start + 3] if (m := ROW.match(line))]
    assert [nodeid.rsplit("::", 1)[1] for _, nodeid in rows] == ["test_busy_child", "test_idle"]
    busy, idle = (float(seconds) for seconds, _ in rows)
    # The child's own clock and its rusage, read by its parent, differ by the kernel's rounding.
    assert busy >= 0.9 * BUSY, output
    assert idle < 0.5 * BUSY, output
    assert re.search(r"s cpu  all 2 tests together$", lines[start + 3]), output


def test_without_the_option_there_is_no_table(tmp_path: Path) -> None:
    assert "most CPU time" not in _run(tmp_path)
