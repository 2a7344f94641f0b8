"""New or resumed: the supervisor tells launch.sh which (RunTraining's Resume), rehearsed
through its synthesized state machine (moto's ASL interpreter) over a simulated fleet, as in
tests/test_supervisor_faults.py. A new job's first attempt is `new` (launch.sh refuses a job
ID whose directory holds a checkpoint: tests/test_launch_scripts.py); its retries and legs
resume, and so does the first attempt of `train --resume` (the execution input's Resume).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from scripts.rehearsal import fleet
from scripts.rehearsal.ssm_agent.runscript import plugin_result
from tests.cdk_support import Synth
from tests.test_supervisor import default
from tests.test_supervisor_faults import SETTINGS, ended, simulated, subjects

__all__ = ["default"]  # the default cluster's synth, a fixture of test_supervisor


def end_together(agents: fleet.SimulatedAgents, code: int) -> None:
    """Every running trainer ends with `code` at once, as a leg's end does on every node: the
    invocations leave the agents' running set together, so the supervisor's cancel of the rest
    of a batch after the first one ended (its grace passes at once here) finds none left to
    kill; then each ends as SimulatedAgents._end writes it (plugin_result: the agent's
    reading of the status). One node at a time, the cancel could end the second first."""
    keys = agents.training()
    with agents._changed:
        items = [agents.running.pop(key) for key in keys]
        agents._changed.notify_all()
    for item in items:
        status, details, returned = plugin_result(code, "")
        for stream, size in (
            ("stdout", fleet.SIMULATED_STDOUT),
            ("stderr", fleet.SIMULATED_STDERR),
        ):
            data = fleet.simulated_output(item.instance, item.document, size, stream)
            (item.folder / stream).write_bytes(data)
        ended = {"status": status, "details": details, "code": returned, "started": item.started}
        fleet._write(item.folder / "status.json", {**ended, "ended": time.time()})


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
        # A successor execution is named by the job ID and the UTC second it starts in
        # (NameSuccessor): the leg's successor must not start in the second the retry's did,
        # which waits that pass at once here would allow (ExecutionAlreadyExists).
        time.sleep(1.1)
        end_together(agents, 75)
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
