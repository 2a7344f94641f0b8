"""Which tests `make test` runs on one pytest-xdist worker, and the scheduler that does it.

Some tests share work that is made once per process: the stack tests' syntheses and their one
cfn-lint run (tests/cdk_support.py caches them), the 1,024-node synth, and the module-scoped
fixtures of MODULE_GROUPS (a reference training run, a benchmark, a wheel build). Each group
runs on one worker, so that work is done once per run, not once per worker.

The group of a test is read from its node ID (its module's file name, its name), not from an
`xdist_group` mark: pytest-xdist 3.8's loadgroup passes a mark's group to the controller by
appending it to the item's legacy `_nodeid` attribute in the worker, which pytest 9.2 no longer
reads (node IDs are structured there; pytest-dev/pytest-xdist#1386, open), so a mark groups
nothing and every worker made every synth, lint and module fixture. GroupScheduling is
xdist's LoadScopeScheduling with group_of() as the scope: the controller computes it from the
node IDs the workers report, and xdist's default `--loadscope-reorder` starts the largest groups
first.
"""

from __future__ import annotations

from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

#: Modules whose tests synthesize many configurations (tests/cdk_support.py caches each once
#: per process). The end-to-end tests use only the default synth, which each worker makes once.
SYNTH_GROUP = "synth"
SYNTH_MODULES = (
    "test_stacks_",
    "test_checkov",
    "test_api_rates",
    "test_iam_actions",
    "test_sdk_parameters",
    "test_ec2_shapes",
    "test_node_image",
    "test_cdk_cli",
    "test_settings_changes",
    "test_cluster_deploy",
    "test_redeploy_resume",
)
#: Tests outside those modules that read the whole matrix's one cfn-lint run
#: (tests/cdk_support.py lint_every_configuration): on the synth worker too.
SYNTH_TESTS = ("test_the_operations_template_with_the_supervisor_lints_clean",)
#: The 1,024-node synth, made once for the supervisor's scale tests and the scale rehearsal.
SCALE_GROUP = "scale"
SCALE_MODULES = ("test_supervisor_scale.py", "test_scale_rehearsal.py")
#: Modules whose module-scoped fixture runs a job (a reference training run, a benchmark, a wheel
#: build) that several of their tests read: each is one group, so the job runs once.
MODULE_GROUPS = (
    "test_bench.py",
    "test_workload_train.py",
    "test_workload_xla.py",
    "test_job_python.py",
)


def group_of(nodeid: str) -> str | None:
    """The group of the test with this node ID (`tests/test_x.py::test_y[param]`), or None
    for a test that may run on any worker."""
    path, _, rest = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    name = rest.rsplit("::", 1)[-1].split("[", 1)[0]
    if module.startswith(SYNTH_MODULES) or name in SYNTH_TESTS:
        return SYNTH_GROUP
    if module in SCALE_MODULES:
        return SCALE_GROUP
    if module in MODULE_GROUPS:
        return module.removesuffix(".py")
    return None


class GroupScheduling(LoadScopeScheduling):
    """Whole groups to one worker each; every other test on its own, as `--dist load`."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid) or nodeid


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> GroupScheduling | None:
    """`--dist loadgroup` (make test) schedules by group_of(); other modes are xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    return GroupScheduling(config, log)
