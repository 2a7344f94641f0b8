"""The drain at a Capacity Block's end (stacks/drain.py): its rules as synthesized, and a
rehearsal in which the synthesized drain state machine runs in moto's ASL interpreter while a job
trains on the Run Command stand-in's nodes (scripts/rehearsal/supervisor.py): the job ends
stopped with its checkpoint at its stop step, no retry spent, and the group scaled in. The
group's termination lifecycle hook is the synthesized compute stack's: a node the scale-in takes
leaves InService at once and keeps running in Terminating:Wait until the hook is completed or
its heartbeat times out (scripts/rehearsal/lifecycle_hooks.py), as Auto Scaling keeps it.
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.executions import job_of
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.job_queue import matches
from scripts.rehearsal.lifecycle_hooks import termination_hook
from scripts.rehearsal.sdk_clients import one_at_a_time
from stacks.config import TIME_FORMAT
from stacks.drain import DRAIN_ERROR, DRAIN_LEAD, STOP_GRACE_SECONDS
from stacks.job_queue import SLOT_KEY
from tests.cdk_support import Synth, alternative, resources, synth
from tests.node_support import unique_job_id
from tests.test_fault_rehearsals import slow_saves
from tests.test_rehearsal import (
    HOLD_AT_5,
    Cli,
    checkpoints,
    gone,
    held,
    job_metrics,
    sample_data,
    short_legs,
    stand_in,
    train_args,
    wait_for,
)

__all__ = ["sample_data", "short_legs"]  # fixtures shared here

#: A Capacity Block in the stand-in's region, the default cluster otherwise.
BLOCK = {
    "az_id": "use1-az6",
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "capacity_block": "true",
    "capacity_block_start": "2026-12-01T11:30:00Z",
    "capacity_block_end": "2026-12-08T11:30:00Z",
    "capacity_block_drain_minutes": "60",
    "ami": "ami-0123456789abcdef0",
}


def _drain_rules(synthesized: Synth) -> dict[str, dict[str, Any]]:
    return {
        k: v["Properties"]
        for k, v in resources(synthesized.templates["operations"], "AWS::Events::Rule").items()
        if k.startswith("CapacityDrain")
    }


def in_service(cloud: Any) -> list[str]:
    """The group's InService nodes as the supervisor reads them (DescribeAutoScalingInstances)."""
    autoscaling = cloud.client("autoscaling")
    return sorted(
        i["InstanceId"]
        for i in autoscaling.describe_auto_scaling_instances()["AutoScalingInstances"]
        if i["LifecycleState"] == "InService"
    )


def entered(sfn: Any, execution: str) -> list[str]:
    """The states an execution entered, in order."""
    return [
        e["stateEnteredEventDetails"]["name"]
        for e in whole_history(sfn, execution)
        if "stateEnteredEventDetails" in e
    ]


def command_reads(sfn: Any, execution: str) -> list[str]:
    """The StopTraining command's statuses as the drain read them (ReadStopTraining), in order."""
    return [
        json.loads(e["taskSucceededEventDetails"]["output"])["Commands"][0]["Status"]
        for e in whole_history(sfn, execution)
        if e["type"] == "TaskSucceeded"
        and e["taskSucceededEventDetails"]["resource"] == "listCommands"
    ]


def _stop_reads(history: list[dict[str, Any]], invocations: Any) -> str:
    """What a failure of the StopTraining assertion needs: each invocation's status file and
    its node agent's starts and ends of it, and when the drain read which command status (its
    ReadStopTraining outputs)."""
    lines = []
    for i in invocations:
        lines.append(f"{i.key}: {(i.folder / 'status.json').read_text()}")
        log = (i.instance.root / "agent.log").read_text(errors="replace").splitlines()
        lines += [f"  agent: {line}" for line in log if i.key in line or " agent " in line]
    for e in history:
        if e["type"] == "TaskSucceeded":
            task = e["taskSucceededEventDetails"]
            said = task["output"][:120]
            if task["resource"] == "listCommands":
                (command,) = json.loads(task["output"])["Commands"]
                said = f"{command['Status']}, {command['CompletedCount']} completed"
            lines.append(f"{e['timestamp']:%H:%M:%S.%f} {task['resource']}: {said}")
        elif e["type"] == "WaitStateEntered":
            lines.append(f"{e['timestamp']:%H:%M:%S.%f} wait")
    return "\n".join(lines)


def test_only_a_capacity_block_has_a_drain() -> None:
    operations = synth().templates["operations"]
    assert not [k for k in operations["Resources"] if k.startswith("CapacityDrain")]


def test_the_drain_starts_the_stop_grace_and_a_margin_before_the_scale_in() -> None:
    block = alternative()  # ends 2026-12-08T11:30:00Z, scales in 90 minutes before
    (cron,) = [
        r["ScheduleExpression"] for r in _drain_rules(block).values() if "ScheduleExpression" in r
    ]
    scale_in = datetime.strptime(block.config.capacity_block_scale_in_time, TIME_FORMAT)
    at = scale_in - DRAIN_LEAD
    # EventBridge's cron: minutes hours day-of-month month day-of-week year (UTC).
    assert cron == f"cron({at.minute} {at.hour} {at.day} {at.month} ? {at.year})"
    assert cron == "cron(55 9 8 12 ? 2026)"
    # The lead leaves the trainers stop.sh's whole grace before the nodes go.
    assert timedelta(seconds=STOP_GRACE_SECONDS) < DRAIN_LEAD
    assert STOP_GRACE_SECONDS == 120


def test_ec2s_expiration_warning_for_this_block_starts_the_drain() -> None:
    """The event as the EC2 user guide shows it ("Monitor Capacity Blocks using EventBridge"),
    matched against the synthesized rule's pattern; another block's warning is not."""
    block = alternative()
    (pattern,) = [r["EventPattern"] for r in _drain_rules(block).values() if "EventPattern" in r]
    event = {
        "version": "0",
        "id": "0d9c0d8f-0000-4000-8000-000000000000",
        "detail-type": "Capacity Block Expiration Warning",
        "source": "aws.ec2",
        "account": "123456789012",
        "time": "2026-12-08T10:50:00Z",
        "region": "us-west-2",
        "resources": [
            "arn:aws:ec2:us-west-2:123456789012:capacity-reservation/cr-0123456789abcdef0"
        ],
        "detail": {
            "capacity-reservation-id": "cr-0123456789abcdef0",
            "end-date": "2026-12-08T11:30:00Z",
        },
    }
    assert matches(pattern, event)
    other = {
        **event,
        "detail": {**event["detail"], "capacity-reservation-id": "cr-0aaaaaaaaaaaaaaaa"},
    }
    assert not matches(pattern, other)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_a_job_running_at_the_drain_time_stops_with_its_checkpoint_and_no_retry_spent(
    tmp_path: Path, sample_data: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The job trains and holds after step 5 with no checkpoint yet; the drain starts (as its
    rule would at the drain time): the supervisor's execution ends ABORTED by the drain, the
    trainers save at step 5 and exit through StopTraining's grace, no second RunTraining
    follows, and the group is scaled in. The trainers' save is held until the drain has read
    StopTraining still running, so the drain's wait for the command's end is exercised, not
    only a command that ended before the drain's first read."""
    from scripts.rehearsal.supervisor import local_supervisor

    block = synth(**BLOCK)
    cluster_name, template = block.config.cluster_name, block.templates["operations"]
    job = unique_job_id("drained")
    args = train_args(sample_data, "--max-steps", "5000", "--checkpoint-every", "1000",
                      "--eval-every", "5000", "--log-every", "5")  # fmt: skip
    hook = termination_hook(block.templates["compute"])
    gate = tmp_path / "saves-may-proceed"
    settings = {**HOLD_AT_5, **slow_saves(tmp_path, gate)}
    with (
        stand_in(
            tmp_path, cluster_name=cluster_name, node_settings=settings, termination_hook=hook
        ) as cloud,
        local_supervisor(cloud, template) as supervisor,
    ):
        train = Cli(cloud, "train", "--job-id", job, "--max-retries", "2", "--retry-delay", "1",
                    "--check-every", "1", "--detach", "--", *args)  # fmt: skip
        train.run()
        assert train.code == 0, capfd.readouterr()
        held(tmp_path, job, 5, 400, capfd.readouterr)
        assert checkpoints(tmp_path / "jobs" / job) == []  # the drain's save is the only one
        nodes = sorted(i.instance_id for i in cloud.running())

        sfn = cloud.client("stepfunctions")
        drain = sfn.start_execution(
            stateMachineArn=cloud.stack_outputs()["DrainStateMachineArn"],
            name="drain-time",
            input="{}",
        )["executionArn"]
        wait_for(
            "the drain reading StopTraining while the trainers save",
            lambda: (
                "InProgress" in command_reads(sfn, drain)
                or sfn.describe_execution(executionArn=drain)["status"] != "RUNNING"
            ),
            600,
            capfd.readouterr,
        )
        gate.touch()
        wait_for(
            "the drain's end",
            lambda: sfn.describe_execution(executionArn=drain)["status"] != "RUNNING",
            600,
            capfd.readouterr,
        )
        described = sfn.describe_execution(executionArn=drain)
        assert described["status"] == "SUCCEEDED", (described, capfd.readouterr())
        # It read the command running, waited, and ended once it read it ended.
        reads = command_reads(sfn, drain)
        assert reads[0] == "InProgress" and reads[-1] == "Success", (
            reads,
            entered(sfn, drain),
        )
        assert gone(job), "a process of the job outlived the drain"

        (execution,) = [
            e for e in sfn.list_executions(stateMachineArn=supervisor)["executions"]
            if job_of(e["name"]) == job
        ]  # fmt: skip
        assert execution["status"] == "ABORTED"
        # Stopped by the drain (its StopExecution task named the execution and its error).
        history = whole_history(sfn, drain)
        stops = [
            json.loads(e["taskScheduledEventDetails"]["parameters"])
            for e in history
            if e["type"] == "TaskScheduled"
            and e["taskScheduledEventDetails"]["resource"] == "stopExecution"
        ]
        assert [(p["ExecutionArn"], p["Error"]) for p in stops] == [
            (execution["executionArn"], DRAIN_ERROR)
        ]
        # Saved at the step it stopped at, by the stop's signal.
        assert checkpoints(tmp_path / "jobs" / job) == [5]
        summaries = job_metrics(tmp_path, job, "summary")
        assert [(s["step"], s["stopped_by_signal"]) for s in summaries] == [(5, True)]
        # One RunTraining, no retry; StopTraining on every node, by the cluster's tag.
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert len(legs) == 1
        (stop,) = [c for c in cloud.commands.values() if c.document.endswith("StopTraining")]
        assert sorted(stop.invocations) == nodes
        assert [i.status()["status"] for i in stop.invocations.values()] == ["Success"] * 2, (
            _stop_reads(history, stop.invocations.values())
        )
        # The group scaled in: its nodes left InService and wait in Terminating:Wait, still
        # running (StopTraining reached them there), until their termination watch completes
        # the hook, as termination_watch.sh does.
        assert cloud.desired == 0 and in_service(cloud) == []
        assert sorted(i.instance_id for i in cloud.running()) == nodes
        autoscaling = cloud.client("autoscaling")
        for node in nodes:
            autoscaling.complete_lifecycle_action(
                LifecycleHookName=hook.name, AutoScalingGroupName=cloud.group_name,
                InstanceId=node, LifecycleActionResult="CONTINUE",
            )  # fmt: skip
        assert cloud.running() == []
        # The job left the cluster: the queue's slot is free for the next window's job.
        dynamodb = cloud.client("dynamodb")
        table = cloud.stack_outputs()["JobQueueTableName"]
        wait_for(
            "the queue's slot freed",
            lambda: "Item" not in dynamodb.get_item(TableName=table, Key=SLOT_KEY),
            60,
            capfd.readouterr,
        )

        # EC2's warning, 40 minutes before the end, starts the drain again while the queue's
        # next job holds the slot, waiting for the next window: the group is at 0, nothing to
        # save, nothing of the next job is stopped.
        dynamodb.put_item(
            TableName=table,
            Item={**SLOT_KEY, "JobId": {"S": "next"}, "ExecutionName": {"S": "next-20261208"}},
        )
        warned = sfn.start_execution(
            stateMachineArn=cloud.stack_outputs()["DrainStateMachineArn"],
            name="expiration-warning",
            input=json.dumps({"detail-type": "Capacity Block Expiration Warning"}),
        )["executionArn"]
        wait_for(
            "the second drain's end",
            lambda: sfn.describe_execution(executionArn=warned)["status"] != "RUNNING",
            120,
            capfd.readouterr,
        )
        assert sfn.describe_execution(executionArn=warned)["status"] == "SUCCEEDED"
        states = entered(sfn, warned)
        assert states[-2:] == ["AnyNodes", "GroupEmpty"], states
        assert len([c for c in cloud.commands.values() if c.document.endswith("StopTraining")]) == 1


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_a_job_queued_behind_the_drained_one_waits_for_the_next_windows_nodes(
    tmp_path: Path, sample_data: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A second job is queued behind the running one when the drain starts. The dispatcher
    starts it once the drained job's execution ended; by then the drain has scaled the group
    in, so its supervisor finds no node InService (the nodes wait in Terminating:Wait under the
    synthesized hook, still running) and waits for the next window's nodes: no Preflight or
    RunTraining of it on the draining nodes, no attempt counted, no retry spent."""
    from scripts.rehearsal.supervisor import local_supervisor

    block = synth(**BLOCK)
    cluster_name, template = block.config.cluster_name, block.templates["operations"]
    first, second = unique_job_id("drained"), unique_job_id("queued")
    args = train_args(sample_data, "--max-steps", "5000", "--checkpoint-every", "1000",
                      "--eval-every", "5000", "--log-every", "5")  # fmt: skip
    hook = termination_hook(block.templates["compute"])
    with (
        stand_in(
            tmp_path, cluster_name=cluster_name, node_settings=HOLD_AT_5, termination_hook=hook
        ) as cloud,
        local_supervisor(cloud, template) as supervisor,
    ):
        for job in (first, second):
            train = Cli(cloud, "train", "--job-id", job, "--max-retries", "2", "--retry-delay",
                        "1", "--check-every", "1", "--detach", "--", *args)  # fmt: skip
            train.run()
            assert train.code == 0, capfd.readouterr()
        held(tmp_path, first, 5, 400, capfd.readouterr)
        sfn = cloud.client("stepfunctions")

        def execution_of(job: str) -> list[dict[str, Any]]:
            return [
                e for e in sfn.list_executions(stateMachineArn=supervisor)["executions"]
                if job_of(e["name"]) == job
            ]  # fmt: skip

        def attempt_commands() -> list[tuple[str, str]]:
            return [
                (c.command_id, c.document)
                for c in cloud.commands.values()
                if c.document.endswith(("-Preflight", "-RunTraining"))
            ]

        assert execution_of(second) == []  # queued: the first job holds the slot
        before = attempt_commands()
        assert [d for _, d in before if d.endswith("-RunTraining")] != []
        drain = sfn.start_execution(
            stateMachineArn=cloud.stack_outputs()["DrainStateMachineArn"],
            name="drain-time",
            input="{}",
        )["executionArn"]
        wait_for(
            "the drain's end",
            lambda: sfn.describe_execution(executionArn=drain)["status"] != "RUNNING",
            600,
            capfd.readouterr,
        )
        assert sfn.describe_execution(executionArn=drain)["status"] == "SUCCEEDED"
        assert checkpoints(tmp_path / "jobs" / first) == [5]

        # The queued job started once the drained one ended, and waits for nodes. While it
        # waits it may hand itself over to a new execution (after MAX_NODE_WAITS polls, 100 s at
        # PollSeconds 1, which a drain waiting for a slow save can outlast): one execution runs,
        # in WaitForNodes, and each earlier one ended SUCCEEDED naming its successor.
        runs: list[dict[str, Any]] = []

        def waiting() -> bool:
            runs[:] = execution_of(second)
            running = [e for e in runs if e["status"] == "RUNNING"]
            return len(running) == 1 and "WaitForNodes" in entered(sfn, running[0]["executionArn"])

        wait_for("the queued job waiting for nodes", waiting, 120, capfd.readouterr)
        (queued,) = [e for e in runs if e["status"] == "RUNNING"]
        for run in runs:
            states = entered(sfn, run["executionArn"])
            assert "CountAttempt" not in states and "CountRetry" not in states, states
            if run is not queued:
                described = sfn.describe_execution(executionArn=run["executionArn"])
                assert described["status"] == "SUCCEEDED", described
                assert "ContinuedAs" in json.loads(described["output"]), described
        # No Preflight or RunTraining since the drain started: the drained job's one attempt.
        assert attempt_commands() == before, attempt_commands()
        # The nodes it would have met are still running, out of service, under the hook.
        assert in_service(cloud) == [] and len(cloud.running()) == 2
        assert [e["status"] for e in execution_of(first)] == ["ABORTED"]
        sfn.stop_execution(executionArn=queued["executionArn"])


def test_the_drains_sdk_tasks_name_their_parameters_as_step_functions_takes_them() -> None:
    """Checked against botocore's input shapes with Step Functions' naming rule (developer
    guide, "supported-services-awssdk"), as the supervisor's and the dispatcher's are."""
    from tests.test_sdk_parameters import definition, definition_problems, sdk_tasks

    parsed = definition(alternative(), "CapacityDrain")
    called = {t["Resource"].split("aws-sdk:")[1] for _, t in sdk_tasks(parsed["States"])}
    assert called == {
        "dynamodb:getItem", "sfn:listExecutions", "sfn:describeExecution", "sfn:stopExecution",
        "ssm:sendCommand",
        "ssm:listCommands", "autoscaling:describeAutoScalingGroups",
        "autoscaling:updateAutoScalingGroup",
    }  # fmt: skip
    assert definition_problems(parsed) == []


def test_the_drains_role_allows_what_its_definition_calls_and_no_more() -> None:
    """An AWS SDK integration's IAM action is the service's prefix and the action in
    PascalCase; every one is granted (tests/test_iam_actions.py checks each grant's resources
    against the Service Authorization Reference), and nothing else but Step Functions' own
    logs and tracing actions."""
    from tests.test_sdk_parameters import definition, sdk_tasks

    block = alternative()
    template = block.templates["operations"]
    prefixes = {"dynamodb": "dynamodb", "sfn": "states", "ssm": "ssm", "autoscaling": "autoscaling"}
    called = set()
    for _, state in sdk_tasks(definition(block, "CapacityDrain")["States"]):
        service, action = state["Resource"].rsplit(":", 2)[-2:]
        called.add(f"{prefixes[service]}:{action[0].upper()}{action[1:]}")
    roles = resources(template, "AWS::IAM::Role")
    (role_id,) = [k for k in roles if k.startswith("CapacityDrainRole")]
    granted: dict[str, list[Any]] = {}
    for policy in resources(template, "AWS::IAM::Policy").values():
        if policy["Properties"]["Roles"] != [{"Ref": role_id}]:
            continue
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            actions = statement["Action"]
            for action in [actions] if isinstance(actions, str) else actions:
                granted.setdefault(action, []).append(statement)
    service = {a for a in granted if a.startswith(("logs:", "xray:"))}
    assert set(granted) - service == called
    # SendCommand: the document, and only the instances that carry this cluster's tag.
    (instances,) = [s for s in granted["ssm:SendCommand"] if "Condition" in s]
    assert instances["Condition"] == {
        "StringEquals": {"ssm:resourceTag/trainium-cluster:name": block.config.cluster_name}
    }
    (group,) = granted["autoscaling:UpdateAutoScalingGroup"]
    assert json.dumps(group["Resource"]).endswith(
        f':autoScalingGroup:*:autoScalingGroupName/{block.config.auto_scaling_group_name}"]]}}'
    )


def test_the_drain_stops_only_the_slots_jobs_executions_not_the_next_ones() -> None:
    """The synthesized drain's stop rounds (JobOfSlot to the second StopEach, the scale-in
    passed over) in moto's interpreter: of two running supervisor executions, the slot's job's
    is stopped, the next job's (the queue's dispatcher starts it once the first ended) keeps
    waiting for nodes."""
    import boto3
    from moto import mock_aws
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_aws_sdk as aws_sdk,
    )

    from scripts.rehearsal.supervisor import (
        SfnAsSdkIntegration,
        definition,
        step_functions_as_on_aws,
    )
    from tests.test_stacks_queue import placeholder_refs

    block = alternative()
    template = block.templates["operations"]
    refs = placeholder_refs(template)
    original = aws_sdk.boto_client_for
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
    ):
        session = boto3.Session(
            region_name="us-east-1", aws_access_key_id="testing", aws_secret_access_key="testing"
        )

        @one_at_a_time
        def client_for(region: str, service: str, state_credentials: Any = None) -> Any:
            # Step Functions through moto's own client (as the rehearsal's supervisor does).
            if service == "stepfunctions":
                return SfnAsSdkIntegration(original(region, service, state_credentials))
            return session.client(service, region_name=region)

        aws_sdk.boto_client_for = client_for
        try:
            sfn = session.client("stepfunctions")
            role = "arn:aws:iam::123456789012:role/test"
            wait = {"Type": "Wait", "Seconds": 3600, "End": True}
            hold = {"StartAt": "Hold", "States": {"Hold": wait}}
            supervisor = sfn.create_state_machine(
                name="research-jobs", definition=json.dumps(hold), roleArn=role
            )["stateMachineArn"]
            supervisor_id = next(
                k for k in resources(template, "AWS::StepFunctions::StateMachine")
                if k.startswith("JobSupervisorStateMachine")
            )  # fmt: skip
            states = definition(
                template, {**refs, supervisor_id: supervisor}, construct="CapacityDrain"
            )["States"]
            states["SendStopTraining"] = {"Type": "Succeed"}  # the rest runs on the nodes
            # The scale-in comes first (the group is the rehearsal's, below); then the stops.
            states["ScaleIn"] = {"Type": "Pass", "Next": states["ScaleIn"]["Next"]}
            drain = sfn.create_state_machine(
                name="research-drain",
                definition=json.dumps({"StartAt": "JobOfSlot", "States": states}),
                roleArn=role,
            )["stateMachineArn"]
            runs = {
                job: sfn.start_execution(
                    stateMachineArn=supervisor, name=name, input=json.dumps({"JobId": job})
                )["executionArn"]
                for job, name in (
                    ("bert-1", "bert-1-20261208-0900"),
                    ("next", "next-20261208-0950"),
                )
            }
            slot = {"Slot": {"Item": {"JobId": {"S": "bert-1"}}}}
            ran = sfn.start_execution(stateMachineArn=drain, input=json.dumps(slot))["executionArn"]
            deadline = time.monotonic() + 60
            while sfn.describe_execution(executionArn=ran)["status"] == "RUNNING":
                assert time.monotonic() < deadline, "the drain still runs after 60 s"
                time.sleep(0.1)
            assert sfn.describe_execution(executionArn=ran)["status"] == "SUCCEEDED"
            status = {
                job: sfn.describe_execution(executionArn=arn)["status"] for job, arn in runs.items()
            }
            assert status == {"bert-1": "ABORTED", "next": "RUNNING"}
            for arn in runs.values():
                with contextlib.suppress(Exception):
                    sfn.stop_execution(executionArn=arn)
        finally:
            aws_sdk.boto_client_for = original


def test_the_rehearsals_termination_hook_is_the_synthesized_one() -> None:
    """The stand-in keeps a terminating node as long as the deployed hook says (its heartbeat,
    then its default result), which leaves the trainers their whole stop grace."""
    from scripts.rehearsal.lifecycle_hooks import TerminationHook
    from stacks.compute import TERMINATION_TIMEOUT

    block = alternative()
    hook = termination_hook(block.templates["compute"])
    assert hook == TerminationHook(
        f"{block.config.cluster_name}-terminating",
        int(TERMINATION_TIMEOUT.to_seconds()),
        "CONTINUE",
    )
    assert hook.heartbeat_seconds > STOP_GRACE_SECONDS


def test_a_node_in_terminating_wait_goes_when_its_hooks_heartbeat_times_out() -> None:
    """Auto Scaling user guide, "How lifecycle hooks work": a node stays in Terminating:Wait
    until the action is completed or the time-out ends, then it is terminated."""
    import threading

    from scripts.rehearsal.lifecycle_hooks import TerminatingNodes, TerminationHook

    ended: list[str] = []
    gone_now = threading.Event()

    def terminate(instance_id: str) -> None:
        ended.append(instance_id)
        gone_now.set()

    nodes = TerminatingNodes(TerminationHook("h", 1, "CONTINUE"), terminate, threading.Lock())
    nodes.wait("i-1")
    assert "i-1" in nodes and ended == []
    assert gone_now.wait(30), "the node outlived its hook's heartbeat"
    assert ended == ["i-1"] and "i-1" not in nodes
    assert not nodes.complete("i-1")  # nothing left to complete
    nodes.wait("i-2")
    assert nodes.complete("i-2") and ended == ["i-1", "i-2"]
    nodes.close()
