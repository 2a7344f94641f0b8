"""Faults that span the batches of a job: the synthesized state machine of a 60-node cluster (two
batches of SendCommand: 50 nodes and 10) runs in moto's interpreter, made to do what Step
Functions does where moto is kinder (scripts/rehearsal/supervisor.py: a Distributed Map whose
child fails, the SDK integrations' error names), against the AWS stand-in and its simulated
fleet (scripts/rehearsal/fleet.py: agents that answer each invocation as the test tells them,
instances that hang or die).

- Another batch cancels the command of the batch whose node is gone: SSM reports that command
  Cancelling for as long as the dead node's invocation does not acknowledge the cancel, which is
  forever; the batch must end on the node being gone, not wait for the status.
- A node terminated between the read of the group and a batch's SendCommand: SSM refuses the
  command (InvalidInstanceId), the batch's child execution fails, Step Functions fails the map
  run and aborts the other children, and the attempt's other commands must be cancelled and
  the job retried, or failed with the cause named when no retry is left.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.fleet import SimulatedAgents, SimulatedHosts, SimulatedInstances
from scripts.rehearsal.job_queue import claim_slot
from scripts.rehearsal.supervisor import (
    MAP_RUN_FAILED,
    local_supervisor,
    map_run_histories,
    step_functions_as_on_aws,
    synthesize_operations,
)
from scripts.rehearsal.supervisor import definition as machine_definition
from stacks.supervisor import JOB_DEFAULTS
from stacks.supervisor_limits import SEND_BATCH
from stacks.supervisor_run import CAUSE_GONE, INVALID_INSTANCE
from tests.cluster_support import LONGEST_CODE
from tests.test_supervisor import placeholder_refs, states

NODES = 60  # two batches: SEND_BATCH and 10
CLUSTER = "faults"
JOB_ID = "fault-rehearsal"
#: A poll a second and a short grace: the rehearsal measures the workflow, not AWS's pace.
SETTINGS = {"PollSeconds": 1, "RetryDelaySeconds": 1, "FailureGraceSeconds": 1}
#: Upper bounds only: each wait ends on an event (a command sent, a status reached).
WAIT = 240


@pytest.fixture(scope="module")
def template() -> dict[str, Any]:
    return synthesize_operations(CLUSTER, NODES)


@dataclass
class Job:
    cloud: LocalCloud
    agents: SimulatedAgents
    client: Any
    execution: str
    children: list[Any]

    def commands(self, ids: frozenset[str]) -> tuple[Any, Any]:
        """The attempt's RunTraining commands: the batch of SEND_BATCH nodes and the other."""
        big, small = sorted(
            (self.cloud.ssm.commands[c] for c in ids), key=lambda c: -len(c.invocations)
        )
        assert (len(big.invocations), len(small.invocations)) == (SEND_BATCH, NODES - SEND_BATCH)
        return big, small

    def status(self) -> str:
        """The status of the job's first execution."""
        return str(self.client.describe_execution(executionArn=self.execution)["status"])

    def end(self) -> tuple[str, list[str], dict[str, Any]]:
        """Follows the job's executions (each hand-over's ContinuedAs) to the last one; returns
        its status, the executions' names and the last one's description."""
        chain, deadline = [self.execution], time.monotonic() + WAIT
        while True:
            described = self.client.describe_execution(executionArn=chain[-1])
            if described["status"] != "RUNNING":
                successor = json.loads(described.get("output") or "{}").get("ContinuedAs")
                if not successor:
                    break
                chain.append(f"{chain[-1].rsplit(':', 1)[0]}:{successor}")
                continue
            assert time.monotonic() < deadline, f"the job still runs after {WAIT} s"
            time.sleep(0.2)
        return described["status"], [a.rsplit(":", 1)[1] for a in chain], described


def until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"not within {WAIT} s: {what}"
        time.sleep(0.1)


@contextlib.contextmanager
def simulated_job(template: dict[str, Any], **settings: Any) -> Iterator[Job]:
    """A job on NODES simulated nodes under the synthesized supervisor, started."""
    with (
        tempfile.TemporaryDirectory(prefix="supervisor-faults-") as folder,
        LocalCloud(SimulatedHosts(NODES), Path(folder), cluster_name=CLUSTER,  # type: ignore[arg-type]
                   instances=SimulatedInstances) as cloud,
        local_supervisor(cloud, template) as arn,
        map_run_histories() as children,
        contextlib.ExitStack() as stack,
    ):  # fmt: skip
        agents = SimulatedAgents(cloud.instances)  # type: ignore[arg-type]
        stack.callback(agents.close)
        agents.attach(cloud)
        client = cloud.client("stepfunctions")
        claim_slot(cloud.session(), cloud.stack_outputs()["JobQueueTableName"], JOB_ID, JOB_ID)
        execution = client.start_execution(
            stateMachineArn=arn, name=JOB_ID,
            input=json.dumps({"JobId": JOB_ID, **LONGEST_CODE, **SETTINGS, **settings}),
        )["executionArn"]  # fmt: skip
        yield Job(cloud, agents, client, execution, children)


@pytest.mark.slow
def test_a_batch_whose_node_is_gone_ends_when_another_batch_cancelled_its_command(
    template: dict[str, Any],
) -> None:
    """A node of the big batch hangs (its agent answers nothing more; EC2 and Auto Scaling
    still count it until a health check fails), a node of the small batch fails, and the
    small batch cancels both commands. The big batch's command stays Cancelling (SSM API
    reference, Command.Status: the hung invocation never acknowledges the cancel) after the
    group has terminated the node; the big batch must end on its node being gone, whoever
    cancelled, and the job retry on the replacement. Before, it polled "Cancelling" until its
    history ran out."""
    with simulated_job(template, MaxRetries=1) as job:
        first = job.agents.wait_launched(NODES, WAIT)
        big, small = job.commands(first)
        hung = next(iter(big.invocations.values())).instance
        job.agents.hang(hung)
        job.agents.fail(next(iter(small.invocations.values())).instance)
        # The small batch's cancel reaches the big batch's command: every live node of it
        # ends Cancelled, the hung one stays Cancelling, and so does the command.
        until(
            lambda: (
                job.cloud.ssm._command_view(big)["Status"] == "Cancelling"
                and job.cloud.ssm._command_view(big)["CompletedCount"] == SEND_BATCH - 1
            ),
            "the big batch's command Cancelling",
        )
        job.agents.die(hung)  # the group finds it unhealthy and replaces it
        job.agents.wait_launched(NODES, WAIT, after=first)
        assert job.cloud.ssm._command_view(big)["Status"] == "Cancelling"
        job.agents.finish()
        status, executions, _ = job.end()
    assert status == "SUCCEEDED" and len(executions) == 2, (status, executions)
    (retry,) = [n for n in job.cloud.notifications if n["Subject"].endswith(" retries")]
    assert (
        CAUSE_GONE.format(document="RunTraining").replace("{}", hung.instance_id)
        in (retry["Message"])
    )


def _terminate_before_the_second_send(job: Job, document: str) -> list[Any]:
    """When the second batch's SendCommand of `document` (Preflight or RunTraining) in the first
    attempt comes, one of its nodes has just been terminated (the group replaced it after
    ReadNodes read it); returns [the node] once that happened."""
    ssm, victims = job.cloud.ssm, []
    send = ssm._ssm_SendCommand

    def send_after_a_node_went(params: dict[str, Any]) -> dict[str, Any]:
        sent = [c for c in ssm.commands.values() if c.document.endswith(document)]
        if params["DocumentName"].endswith(document) and len(sent) == 1 and not victims:
            victim = job.cloud.instances.instance(params["InstanceIds"][-1])
            assert victim is not None
            victims.append(victim)
            job.agents.die(victim)
        answer: dict[str, Any] = send(params)
        return answer

    ssm._ssm_SendCommand = send_after_a_node_went  # type: ignore[method-assign]
    return victims


@pytest.mark.parametrize(
    ("document", "retries"), [("RunTraining", 1), ("RunTraining", 0), ("Preflight", 1)]
)
def test_a_batch_that_cannot_send_fails_the_map_and_the_attempt_is_cancelled_and_retried(
    template: dict[str, Any], document: str, retries: int
) -> None:
    """The second batch's SendCommand names a node terminated since the group was read: SSM
    refuses it (botocore's ssm model, InvalidInstanceId: "Invalid states are: Shutting-down
    and Terminated"), which Step Functions reports as Ssm.InvalidInstanceIdException (developer
    guide, supported-services-awssdk) and no retry can mend. The child fails; the map run
    fails with States.ExceedToleratedFailureThreshold (developer guide, tolerated failure
    threshold: 0 by default) and the other batch's child is aborted. The map's Catch cancels
    the first batch's RunTraining command, which would otherwise run for up to 48 hours (the
    simulated Preflight has ended by then), and the job retries on the replacement (counted),
    or, with no retry left, fails with the map's error in its notification and its cause.
    Before, the job's execution failed at the map with no retry and no message of its own, and
    the first batch's command ran on."""
    with simulated_job(template, MaxRetries=retries) as job:
        victims = _terminate_before_the_second_send(job, document)
        until(lambda: bool(victims), "a node terminated before a batch's SendCommand")
        commands = job.cloud.ssm.commands.values()
        (sent,) = [c for c in commands if c.document.endswith(document)]

        def ended() -> bool:
            status = job.cloud.ssm._command_view(sent)["Status"]
            return bool(status == ("Cancelled" if document == "RunTraining" else "Success"))

        until(
            lambda: ended() or job.status() != "RUNNING",
            "the first batch's command ended, or the job's execution ended",
        )
        assert ended(), (job.status(), job.client.describe_execution(
            executionArn=job.execution).get("cause"))  # fmt: skip
        if retries:
            job.agents.wait_launched(NODES, WAIT, after=frozenset([sent.command_id]))
            job.agents.finish()
        status, executions, described = job.end()
    # The failed child: SendCommand refused, not retried.
    failures = [
        e["taskFailedEventDetails"]
        for history in job.children
        for e in history.get_event_history()
        if e["type"] == "TaskFailed"
    ]
    assert [f["error"] for f in failures] == [INVALID_INSTANCE], failures
    assert victims[0].instance_id in failures[0]["cause"]
    subjects = [n["Subject"].rsplit(" ", 1)[1] for n in job.cloud.notifications]
    said = [
        n["Message"]
        for n in job.cloud.notifications
        if n["Subject"].endswith((" retries", " failed"))
    ]
    assert said and all(f"{document}Batches failed ({MAP_RUN_FAILED})" in m for m in said), said
    if document == "RunTraining":  # the commands it cancelled
        assert all(sent.command_id in m for m in said), said
    if retries:
        assert status == "SUCCEEDED" and len(executions) == 2, (status, executions)
        assert subjects == ["started", "retries", "finished"], subjects
    else:
        assert status == "FAILED" and len(executions) == 1, (status, executions)
        assert subjects == ["started", "failed"], subjects
        assert described["error"] == "JobFailed"
        assert f"{document}Batches failed ({MAP_RUN_FAILED})" in described["cause"]


def test_every_distributed_map_catches_its_failure_and_the_job_retries(
    template: dict[str, Any],
) -> None:
    """Each of the three Distributed Maps catches its own failure (States.ALL matches
    States.ExceedToleratedFailureThreshold, though not States.DataLimitExceeded or a runtime
    error in the state itself: Step Functions developer guide, error names) and goes on to
    RetryLeft; after PreflightBatches and RunTrainingBatches through a cancel of that document's
    executing commands. Each batch's SendCommand does not retry INVALID_INSTANCE (a terminated
    node stays terminated) and tries that retrier first: Step Functions takes the first retrier
    whose ErrorEquals matches."""
    found = dict(states(machine_definition(template, placeholder_refs(template))))
    maps = [n for n, s in found.items() if s.get("ItemProcessor", {}).get("ProcessorConfig", {})
            .get("Mode") == "DISTRIBUTED"]  # fmt: skip
    assert sorted(maps) == ["PreflightBatches", "ReadNodes", "RunTrainingBatches"], maps
    for name in maps:
        (catch,) = found[name]["Catch"]
        assert catch["ErrorEquals"] == ["States.ALL"] and catch["ResultPath"] == "$.MapFailure"
        path, state = [], catch["Next"]
        while state != "RetryLeft":
            assert state not in path, path
            path.append(state)
            step = found[state]
            state = step.get("Next") or step.get("Default")
        if name == "ReadNodes":
            assert path == ["ReadNodesFailed"], path
            continue
        document = name.removesuffix("Batches")
        cancel = found[f"{document}MapFailedCancelOtherBatches"]
        assert f"{document}MapFailedCancelOtherBatches" in path and path[-1] == (
            f"{document}MapFailed"
        ), path
        cancel_batch = cancel["ItemProcessor"]["States"][f"{document}MapFailedCancelBatch"]
        assert cancel_batch["Resource"].endswith(":ssm:cancelCommand")
        listing = found[f"{document}MapFailedListOtherBatches"]["Parameters"]["Filters"]
        assert f"<{document}Document>" in json.dumps(listing) and "Executing" in json.dumps(listing)
        retriers = found[f"{document}Send"]["Retry"]
        assert retriers[0] == {"ErrorEquals": [INVALID_INSTANCE], "MaxAttempts": 0}, retriers


def test_a_failed_read_of_the_nodes_is_caught_and_the_job_fails_naming_it(
    template: dict[str, Any],
) -> None:
    """The wait for nodes of the definition, from PartitionGroup to DescribeFailure (no retry
    left), with a ReadNodes whose batch's child execution fails, as any child can (a state's
    data past 256 KiB, a runtime error): run in moto's interpreter made to fail the map run
    as Step Functions does, the map's failure is caught and the job's failure names it.
    Before, ReadNodes had no Catch: the execution failed with the map's error, no message of
    its own."""
    from moto import mock_aws

    found = dict(states(machine_definition(template, placeholder_refs(template))))
    names = ["PartitionGroup", "ReadNodes", "ReadNodesFailed", "RetryLeft", "DescribeFailure"]
    chosen = {name: json.loads(json.dumps(found[name])) for name in names}
    chosen["ReadNodes"]["ItemProcessor"]["StartAt"] = "BatchFails"
    chosen["ReadNodes"]["ItemProcessor"]["States"] = {
        "BatchFails": {"Type": "Fail", "Error": "BatchFailed", "Cause": "a batch's read failed"}
    }
    chosen["RetryLeft"]["Default"] = "NotRetried"  # a retry is left: not this test's path
    chosen["NotRetried"] = {"Type": "Fail", "Error": "NotRetried"}
    chosen["DescribeFailure"] = {**chosen["DescribeFailure"], "End": True}
    del chosen["DescribeFailure"]["Next"]
    given = {
        "Job": {**JOB_DEFAULTS, **LONGEST_CODE, "JobId": JOB_ID, "MaxRetries": 0},
        "Counters": {"Retries": 0, "Legs": 1, "Attempts": 0},
        "ContinuedFrom": "",
        "NodeWaits": {"Count": 0},
        "Group": {"Ids": [f"i-{n:017x}" for n in range(NODES)]},
    }
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
    ):
        import boto3

        client = boto3.client("stepfunctions", region_name="us-east-1")
        arn = client.create_state_machine(
            name="read-nodes", definition=json.dumps({"StartAt": "PartitionGroup",
                                                      "States": chosen}),
            roleArn="arn:aws:iam::123456789012:role/read-nodes",
        )["stateMachineArn"]  # fmt: skip
        execution = client.start_execution(stateMachineArn=arn, input=json.dumps(given))
        until(
            lambda: (
                client.describe_execution(executionArn=execution["executionArn"])["status"]
                != "RUNNING"
            ),
            "the execution ended",
        )
        described = client.describe_execution(executionArn=execution["executionArn"])
        assert described["status"] == "SUCCEEDED", described.get("cause")
        why = json.loads(described["output"])["Why"]["Text"]
    assert why.startswith("attempt 0 failed after 0 retries: ") and (
        f"ReadNodes failed ({MAP_RUN_FAILED})" in why
    ), why
