"""New or resumed: the supervisor tells launch.sh which (RunTraining's Resume), rehearsed
through its synthesized state machine (moto's ASL interpreter) over a simulated fleet, as in
tests/test_supervisor_faults.py. A new job's first attempt is `new` (launch.sh refuses a job
ID whose directory holds a checkpoint: tests/test_launch_scripts.py); its retries and legs
resume, and so does the first attempt of `train --resume` (the execution input's Resume).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cdk_support import Synth
from tests.test_supervisor import default
from tests.test_supervisor_faults import SETTINGS, ended, simulated, subjects

__all__ = ["default"]  # the default cluster's synth, a fixture of test_supervisor


def resume_of(cloud: Any, commands: frozenset[str]) -> set[str]:
    """The Resume each of these RunTraining commands was sent with."""
    return {cloud.commands[c].parameters["Resume"][0] for c in commands}


@pytest.mark.slow
def test_a_new_job_starts_new_and_its_retry_and_its_next_leg_resume(
    tmp_path: Path, default: Synth
) -> None:
    """Attempt 1 `new`; a node fails (1): the retry `resume`s; every node ends its leg (75):
    the next leg `resume`s too, and finishes. Before, RunTraining had no Resume: every
    attempt resumed whatever the job's directory held."""
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("fresh", MaxRetries=1, **SETTINGS)
        first = agents.wait_launched(nodes, 300)
        assert resume_of(cloud, first) == {"new"}
        agents.fail(cloud.running()[0], 1)
        agents.finish()
        retry = agents.wait_launched(nodes, 300, after=first)
        assert resume_of(cloud, retry) == {"resume"}
        for node in cloud.running():
            agents.fail(node, 75)
        leg = agents.wait_launched(nodes, 300, after=first | retry)
        assert resume_of(cloud, leg) == {"resume"}
        agents.finish()
        assert ended(supervisor, execution, 300) == "SUCCEEDED", supervisor.trace(execution)
        assert subjects(cloud) == ["started", "retries", "continues", "finished"]


@pytest.mark.slow
def test_train_resume_resumes_from_the_first_attempt(tmp_path: Path, default: Synth) -> None:
    nodes = default.config.node_count
    with simulated(tmp_path, default, nodes) as (cloud, agents, supervisor):
        execution = supervisor.start("again", Resume="resume", **SETTINGS)
        first = agents.wait_launched(nodes, 300)
        assert resume_of(cloud, first) == {"resume"}
        agents.finish()
        assert ended(supervisor, execution, 300) == "SUCCEEDED", supervisor.trace(execution)
