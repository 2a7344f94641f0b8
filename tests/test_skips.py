"""tests/skips.py: under TRAINIUM_CLUSTER_REQUIRE_ALL=1 (.ci/run) a skip for want of a tool or
privilege fails the run; a `not_applicable` skip stays a skip. Each case runs pytest (the
rule-holder for what a skip is: `pytest.skip`, `skipif`, `importorskip`) in a process of its
own on a small test file, with tests/conftest.py loaded as a plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.skips import REQUIRE_ALL

TESTS = """
import shutil

import pytest

from tests.skips import not_applicable


def test_needs_a_tool():
    if shutil.which("no-such-tool-here") is None:
        pytest.skip("no-such-tool-here is not installed")


@pytest.mark.skipif(True, reason="strace is not installed")
def test_needs_strace():
    pass


def test_premise():
    not_applicable("this machine has a CUDA device")


@pytest.mark.xfail(reason="a known defect", strict=True)
def test_known():
    assert False


def test_runs():
    pass
"""
MODULE_SKIP = """
import pytest

pytest.importorskip("no_such_module_here")


def test_never_collected():
    pass
"""


def run_pytest(
    tmp_path: Path, require: str | None, tests: str = TESTS
) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_cases.py").write_text(tests)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ALL}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["COLUMNS"] = "400"  # summary lines in full
    if require is not None:
        env[REQUIRE_ALL] = require
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
         "-rA", "-q", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("require", [None, "0"])
def test_without_the_setting_a_skip_is_a_skip(tmp_path: Path, require: str | None) -> None:
    result = run_pytest(tmp_path, require)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 3 skipped, 1 xfailed" in result.stdout
    result = run_pytest(tmp_path, require, MODULE_SKIP)
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout
    assert "1 skipped" in result.stdout


def test_under_require_all_a_skip_for_a_missing_tool_fails(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, "1")
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    summary = lines[-1]
    # A skip in the call fails the test; a `skipif` (at setup) is an error of its setup.
    assert "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error" in summary, result.stdout
    failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    assert len(failed) == 2, failed
    assert any("test_needs_a_tool" in line and "no-such-tool-here is not installed" in line
               for line in failed), failed  # fmt: skip
    assert any("test_needs_strace" in line and "strace is not installed" in line
               for line in failed), failed  # fmt: skip
    assert f"{REQUIRE_ALL}=1" in result.stdout
    # The premise that does not hold stays a skip; an expected failure stays one.
    assert any(line.startswith("SKIPPED") and "CUDA device" in line for line in lines), lines
    assert not any("test_premise" in line for line in failed)


def test_under_require_all_a_module_that_skips_at_collection_fails(tmp_path: Path) -> None:
    result = run_pytest(tmp_path, "1", MODULE_SKIP)
    assert result.returncode != 0, result.stdout
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR ")]
    assert len(errors) == 1 and "test_cases.py" in errors[0], result.stdout
    assert f"{REQUIRE_ALL}=1" in result.stdout and "no_such_module_here" in result.stdout
