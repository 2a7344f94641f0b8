"""`make test` runs each group of tests/xdist_groups.py on one pytest-xdist worker: a run of
pytest-xdist itself (its controller, its workers) over stand-in modules named as the groups'."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.xdist_groups import MODULE_GROUPS, SCALE_MODULES, SYNTH_MODULES, SYNTH_TESTS, group_of

REPO_ROOT = Path(__file__).resolve().parent.parent

RECORDING_TEST = """
import os

import pytest


@pytest.mark.parametrize("n", range({count}))
def {name}(n):
    with open(os.environ["WORKERS_LOG"], "a") as log:
        log.write(f"{{__name__}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")
"""


@pytest.mark.parametrize(
    ("nodeid", "group"),
    [
        ("tests/test_stacks_network.py::test_lustre_ports_only", "synth"),
        ("tests/test_checkov.py::test_x[a-b]", "synth"),
        ("tests/test_supervisor.py::test_the_operations_template_with_the_supervisor_lints_clean",
         "synth"),
        ("tests/test_scale_rehearsal.py::test_one_job[1024]", "scale"),
        ("tests/test_workload_train.py::test_outputs_of_a_job", "test_workload_train"),
        ("tests/test_workload_training.py::test_x", None),
        ("tests/test_supervisor.py::test_a_node_that_dies_mid_job", None),
    ],
)  # fmt: skip
def test_group_of_reads_the_module_and_the_test_name(nodeid: str, group: str | None) -> None:
    assert group_of(nodeid) == group


def test_every_module_a_group_names_exists() -> None:
    """A renamed module would silently leave its group."""
    modules = {path.name for path in (REPO_ROOT / "tests").glob("test_*.py")}
    for name in (*MODULE_GROUPS, *SCALE_MODULES):
        assert name in modules, name
    for prefix in SYNTH_MODULES:
        assert any(module.startswith(prefix) for module in modules), prefix
    for test in SYNTH_TESTS:
        assert any(f"def {test}(" in (REPO_ROOT / "tests" / module).read_text()
                   for module in modules), test  # fmt: skip


def test_xdist_runs_each_group_on_one_worker(tmp_path: Path) -> None:
    """Three workers, two modules of the synth group, one module group, and free tests: each
    group's tests on one worker. With an `xdist_group` mark in their place (pytest 9.2,
    pytest-xdist 3.8), the 24 grouped tests went round the workers like the free ones."""
    (tmp_path / "conftest.py").write_text(
        "from tests.xdist_groups import pytest_xdist_make_scheduler  # noqa: F401\n"
    )
    modules = {"test_stacks_a.py": "synth", "test_stacks_b.py": "synth",
               "test_workload_train.py": "test_workload_train", "test_free.py": None}  # fmt: skip
    for module in modules:
        (tmp_path / module).write_text(RECORDING_TEST.format(count=8, name="test_it"))
    log = tmp_path / "workers.log"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "3", "--dist", "loadgroup",
         "-p", "no:randomly", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "WORKERS_LOG": str(log)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    workers: dict[str, set[str]] = collections.defaultdict(set)
    lines = log.read_text().split()
    for module, worker in zip(lines[::2], lines[1::2], strict=True):
        group = modules[f"{module}.py"]
        if group:
            workers[group].add(worker)
    assert len(lines) == 2 * 8 * len(modules)
    assert len(workers["synth"]) == 1, workers
    assert len(workers["test_workload_train"]) == 1, workers
