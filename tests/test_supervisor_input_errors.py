"""A job whose own input is wrong is not retried: rehearsed through the synthesized state
machine (moto's ASL interpreter) over a simulated fleet, as in tests/test_supervisor_faults.py.

launch.sh exits 2 when the trainer's argparse refused a flag or its data is missing (the
trainer's status, which torchrun's report names: tests/test_launch_scripts.py) and writes one
line to the agent's stderr, which the invocation's Output keeps whole at its end (the agent's
truncateOutput: scripts/rehearsal/ssm_agent/runscript.py plugin_output). The supervisor ends
the job at once, FAILED, its cause naming the input error with that line, instead of spending
every retry (each a wait for nodes and a preflight) on input no retry can fix. The operator
names other statuses not to retry (`train --no-retry-on 5`) or retries 2 (`--retry-on 2`):
the job's NoRetryStatuses.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from scripts.rehearsal import fleet
from tests.cdk_support import Synth
from tests.test_supervisor import default
from tests.test_supervisor_faults import SETTINGS, ended, simulated, subjects

__all__ = ["default"]  # the default cluster's synth, a fixture of test_supervisor

#: launch.sh's mark of the line (stacks/supervisor_run.py INPUT_ERROR_MARK).
INPUT_ERROR_MARK = "input error (status 2)"
#: The trainer's own line, as launch.sh's read_trainer_status writes it to the agent's stderr
#: (no newline after it).
TRAINER_LINE = (
    "train.py: error: unrecognized arguments: --bogus 3 (train.py --help lists the flags)"
)


def launch_output(bad: str) -> Any:
    """fleet.simulated_output, but the node `bad`'s RunTraining stderr is launch.sh's one line
    for an input error; its stdout stays full size (32,000 bytes), so only the agent's keeping
    of a short stderr brings the line into the Output."""
    original = fleet.simulated_output

    def output(instance: Any, document: str, size: int, stream: str) -> bytes:
        if instance.instance_id == bad and document.endswith("RunTraining") and stream == "stderr":
            line = f"job bad-input: {INPUT_ERROR_MARK} on node rank 0: {TRAINER_LINE}"
            return line.encode()
        return original(instance, document, size, stream)

    return output


def training_commands(cloud: Any) -> list[str]:
    return [c for c in cloud.commands if cloud.commands[c].document.endswith("RunTraining")]


@pytest.mark.slow
def test_an_input_error_ends_the_job_after_one_attempt_naming_it(
    tmp_path: Path, default: Synth
) -> None:
    """Rank 0's trainer refuses a flag (launch.sh: 2); the other node's torchrun loses its
    rendezvous (1). With retries left, the job ends after its one attempt: FAILED, its cause
    and the notification name the input error and quote the trainer's line. Before, status 2
    was a failure like any other and the job was retried (a second execution)."""
    from stacks import supervisor_run

    assert supervisor_run.INPUT_ERROR_MARK == INPUT_ERROR_MARK
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        first, *others = cloud.running()
        with patch.object(fleet, "simulated_output", launch_output(first.instance_id)):
            execution = supervisor.start("bad-input", MaxRetries=2, **SETTINGS)
            agents.wait_launched(nodes, 300)
            agents.fail(first, 2)
            for node in others:
                agents.fail(node, 1)
            assert ended(supervisor, execution, 300, most=1) == "FAILED", supervisor.trace(
                execution
            )
        failed = supervisor.describe(execution)
        assert failed["error"] == "JobFailed"
        said = (
            f"{first.instance_id}: RunTraining failed with status 2, an input error of the job "
            f"(not retried): job bad-input: {INPUT_ERROR_MARK} on node rank 0: {TRAINER_LINE}"
        )
        assert said in failed["cause"], failed["cause"]
        assert failed["cause"].startswith("attempt 1 failed with a status this job does not retry")
        assert len(training_commands(cloud)) == 1
        assert subjects(cloud) == ["started", "failed"], subjects(cloud)
        message = cloud.notifications[-1]["Message"]
        assert "not retried" in message and said in message
        assert "Status 2 is an input error of the job" in message


@pytest.mark.slow
def test_a_status_the_operator_names_is_not_retried(tmp_path: Path, default: Synth) -> None:
    """`train --no-retry-on 5` (NoRetryStatuses [2, 5]): a trainer's status 5, which launch.sh
    passes on, ends the job after one attempt with the status named. Before, it was retried."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        first = cloud.running()[0]
        execution = supervisor.start("named", MaxRetries=2, NoRetryStatuses=[2, 5], **SETTINGS)
        agents.wait_launched(nodes, 300)
        agents.fail(first, 5)
        agents.finish()
        assert ended(supervisor, execution, 300, most=1) == "FAILED", supervisor.trace(execution)
        cause = supervisor.describe(execution)["cause"]
        assert (
            f"{first.instance_id}: RunTraining failed with status 5, a status this job does not "
            "retry (NoRetryStatuses: train --no-retry-on)"
        ) in cause, cause
        assert subjects(cloud) == ["started", "failed"], subjects(cloud)


@pytest.mark.slow
def test_an_input_error_the_operator_retries_is_retried(tmp_path: Path, default: Synth) -> None:
    """`train --retry-on 2` (NoRetryStatuses []): status 2 is a failure like any other, retried
    with resume; the retry finishes the job."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        first = cloud.running()[0]
        execution = supervisor.start("retried", MaxRetries=1, NoRetryStatuses=[], **SETTINGS)
        commands = agents.wait_launched(nodes, 300)
        agents.fail(first, 2)
        agents.finish()
        agents.wait_launched(nodes, 300, after=commands)
        agents.finish()
        assert ended(supervisor, execution, 300) == "SUCCEEDED", supervisor.trace(execution)
        assert len(supervisor.chain(execution)) == 2
        assert subjects(cloud) == ["started", "retries", "finished"], subjects(cloud)
        successor = json.loads(supervisor.describe(supervisor.chain(execution)[1])["input"])
        assert successor["NoRetryStatuses"] == []
