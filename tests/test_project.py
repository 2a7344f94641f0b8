"""The project's own contract: the README's two commands, CI running exactly the test command,
and exact pins so that a fresh install is repeatable."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.conftest import REPO_ROOT

REQUIREMENT_FILES = ["requirements.txt", "requirements-dev.txt", "workload/requirements.txt"]


def _first_code_block(markdown: str) -> str:
    match = re.search(r"```(?:bash)?\n(.*?)```", markdown, re.S)
    assert match is not None, "README.md has no code block"
    return match.group(1)


def test_readme_leads_with_the_two_commands() -> None:
    commands = [
        line.split("#")[0].strip()
        for line in _first_code_block((REPO_ROOT / "README.md").read_text()).splitlines()
    ]
    assert commands == ["make demo", "make test"]


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    lines = [
        line.strip()
        for line in (REPO_ROOT / ".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # Two settings: a test skipped for want of a tool fails the run there (tests/skips.py), and
    # pip keeps no download cache on the fresh machine (the disk make setup checks for).
    assert lines == [
        "set -euo pipefail", 'cd "$(dirname "$0")/.."', "export TRAINIUM_CLUSTER_REQUIRE_ALL=1",
        "export PIP_NO_CACHE_DIR=1", "make test",
    ]  # fmt: skip


@pytest.mark.parametrize("target", ["demo", "test", "setup", "check"])
def test_make_targets_exist_and_do_work(target: str) -> None:
    # `make -n` prints the recipe without running it: each target must run real commands.
    result = subprocess.run(
        ["make", "-n", "--always-make", target],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "pip install" in result.stdout, "every entry point starts with the idempotent setup"
    expected = {"demo": "cluster.py rehearse", "test": "pytest", "setup": "npm ci", "check": "mypy"}
    assert expected[target] in result.stdout


@pytest.mark.parametrize("path", REQUIREMENT_FILES)
def test_requirements_are_pinned_exactly(path: str) -> None:
    for raw in (REPO_ROOT / path).read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line or line.startswith("-r "):
            continue
        assert re.fullmatch(r"[A-Za-z0-9_.\-]+(\[[a-z0-9,_-]+\])?==[0-9][A-Za-z0-9.+]*", line), (
            f"{path}: {line!r} is not an exact pin (name==version)"
        )
