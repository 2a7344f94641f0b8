"""make setup's disk check (scripts/disk_space.py): one line, what is free and what is needed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from scripts import disk_space

ROOT = Path(__file__).resolve().parent.parent
Usage = namedtuple("Usage", "total used free")


def test_enough_space_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(0, 0, 11 * disk_space.GIB))
    assert disk_space.shortfall("/x", 10) is None


def test_too_little_space_is_one_line_naming_free_and_needed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(0, 0, int(0.3 * disk_space.GIB)))
    message = disk_space.shortfall("/work/clone", 10)
    assert message is not None and "\n" not in message
    assert "0.3 GiB free under /work/clone" in message
    assert "needs about 10 GiB" in message
    assert "SETUP_GIB=0" in message


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    script = str(ROOT / "scripts" / "disk_space.py")
    return subprocess.run(
        [sys.executable, script, *args], check=False, capture_output=True, text=True
    )


def test_the_command_exits_non_zero_with_the_line_and_refuses_bad_input(tmp_path: Path) -> None:
    ok = _run(str(tmp_path), "0")
    assert ok.returncode == 0 and ok.stderr == ""
    short = _run(str(tmp_path), "1e9")
    assert short.returncode == 1
    assert short.stderr.count("\n") == 1 and "GiB free under" in short.stderr
    bad = _run(str(tmp_path), "ten")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "disk_space.py: GIB must be a number of GiB, not 'ten'"


def test_make_setup_checks_the_disk_before_pip_installs() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile.split("$(STAMP):", 1)[1]
    assert recipe.index("scripts/disk_space.py") < recipe.index("pip install")
