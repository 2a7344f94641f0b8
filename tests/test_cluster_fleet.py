"""Rolling the fleet onto the group's current launch template without interrupting a job, and
exporting FSx to S3 before a destroy (contract C6)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from scripts.cluster_lib import ClusterError
from tests.cluster_support import (
    INPUTS,
    OUTPUTS,
    TRAIN_ARGS,
    FakeAws,
    capture,
)

GROUP = OUTPUTS["AutoScalingGroupName"]
REFRESH = "08b91cf7-8fa6-48af-b6a6-d227f40f1b9b"
PREFERENCES = {"SkipMatching": True, "MinHealthyPercentage": 0, "MaxHealthyPercentage": 100}


# ---------------------------------------------------------------------------- roll
def start_refresh(aws: FakeAws) -> None:
    aws.stubs["autoscaling"].add_response(
        "start_instance_refresh",
        {"InstanceRefreshId": REFRESH},
        {"AutoScalingGroupName": GROUP, "Strategy": "Rolling", "Preferences": PREFERENCES},
    )


def refresh_state(aws: FakeAws, status: str, percent: int, reason: str = "") -> None:
    refresh: dict[str, Any] = {
        "InstanceRefreshId": REFRESH, "AutoScalingGroupName": GROUP, "Status": status,
        "PercentageComplete": percent,
    }  # fmt: skip
    if reason:
        refresh["StatusReason"] = reason
    aws.stubs["autoscaling"].add_response(
        "describe_instance_refreshes",
        {"InstanceRefreshes": [refresh]},
        {"AutoScalingGroupName": GROUP, "InstanceRefreshIds": [REFRESH]},
    )


def test_roll_is_refused_while_a_job_runs(aws: FakeAws) -> None:
    aws.stack()
    job = "00000000-0000-4000-8000-000000000001"
    aws.running_commands(
        [{"CommandId": job, "Status": "InProgress", "Parameters": {"JobId": ["bert-1"]}}], []
    )
    with pytest.raises(ClusterError) as error:
        aws.cluster().roll()
    assert str(error.value) == (
        f"not rolling the fleet while RunTraining of job bert-1 (command {job}) runs: it would "
        "lose its nodes; wait for it to end, stop it with `cluster.py stop --job-id ID`, or "
        "pass --force"
    )
    aws.verify()  # and no instance refresh was started


def test_roll_replaces_the_nodes_that_do_not_match_and_follows_the_refresh(aws: FakeAws) -> None:
    aws.stack()
    aws.running_commands(
        [{"CommandId": "00000000-0000-4000-8000-000000000001", "Status": "Success",
          "Parameters": {"JobId": ["bert-1"]}}],
        [],
    )  # fmt: skip
    start_refresh(aws)
    refresh_state(aws, "Pending", 0)
    refresh_state(aws, "InProgress", 50)
    refresh_state(aws, "InProgress", 50)
    refresh_state(aws, "Successful", 100)
    assert aws.cluster().roll(wait=True) == REFRESH
    aws.verify()
    assert aws.lines == [
        f"instance refresh {REFRESH} of group {GROUP} started",
        f"instance refresh {REFRESH}: Pending, 0% done",
        f"instance refresh {REFRESH}: InProgress, 50% done",
        f"instance refresh {REFRESH}: Successful, 100% done",
    ]


def test_roll_force_interrupts_a_job_only_when_asked(aws: FakeAws) -> None:
    aws.stack()
    aws.running_commands(
        [], [{"CommandId": "00000000-0000-4000-8000-000000000001", "Status": "InProgress",
              "Parameters": {"JobId": ["bert-1"]}}],
    )  # fmt: skip
    start_refresh(aws)
    assert aws.cluster().roll(force=True) == REFRESH
    aws.verify()
    assert aws.lines[0] == "--force: rolling the fleet although 1 commands still run"


def test_roll_while_a_refresh_runs_and_a_failed_refresh_get_one_line(aws: FakeAws) -> None:
    aws.stack()
    aws.running_commands([], [])
    aws.stubs["autoscaling"].add_client_error(
        "start_instance_refresh", service_error_code="InstanceRefreshInProgress",
        service_message="An Instance Refresh is already in progress", http_status_code=400,
    )  # fmt: skip
    cluster = aws.cluster()
    with pytest.raises(ClusterError, match=rf"^an instance refresh of {GROUP} is already running"):
        cluster.roll()
    aws.running_commands([], [])
    start_refresh(aws)
    refresh_state(aws, "Failed", 10, "Launching a new instance failed: capacity")
    with pytest.raises(ClusterError) as error:
        cluster.roll(wait=True)
    assert str(error.value) == (
        f"instance refresh {REFRESH} ended Failed: Launching a new instance failed: capacity"
    )
    aws.verify()


def test_wait_for_refresh_waits_while_an_instance_refresh_replaces_nodes(aws: FakeAws) -> None:
    aws.stack()
    aws.no_refresh(
        [{"InstanceRefreshId": REFRESH, "Status": "InProgress", "PercentageComplete": 50}]
    )
    aws.no_refresh([{"InstanceRefreshId": REFRESH, "Status": "Successful"}])

    aws.cluster().wait_for_refresh()

    aws.verify()
    assert aws.lines == [
        f"waiting: instance refresh {REFRESH} of group {GROUP} is replacing nodes (InProgress, "
        "50% done): wait for it (`cluster.py roll --wait`)"
    ]
    assert aws.time.slept == [5]


def test_a_job_starts_only_after_an_instance_refresh_and_with_its_settings(aws: FakeAws) -> None:
    """`train` waits for a refresh (`roll`) before it queues the job, looks for the job ID
    among the queued and running jobs, gives the queued execution the job's settings and starts
    the job queue's dispatcher."""
    import json

    from botocore.stub import ANY, Stubber

    from scripts.cluster_lib.executions import EXECUTION_NAME
    from scripts.cluster_lib.jobs import Jobs

    machine = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-jobs"
    dispatcher = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-dispatcher"
    keys = [{"AttributeName": "Pk", "KeyType": "HASH"}, {"AttributeName": "Sk", "KeyType": "RANGE"}]
    aws.clients.dynamodb.create_table(
        TableName="queue", KeySchema=keys, BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[{"AttributeName": k, "AttributeType": "S"} for k in ("Pk", "Sk")],
    )  # fmt: skip
    aws.stack({**OUTPUTS, "JobStateMachineArn": machine, "JobQueueTableName": "queue",
               "JobDispatcherArn": dispatcher})  # fmt: skip
    aws.no_refresh([{"InstanceRefreshId": REFRESH, "Status": "InProgress"}])
    aws.no_refresh([])
    sfn = Stubber(aws.clients.stepfunctions)
    sfn.add_response(
        "list_executions",
        {"executions": []},
        {"stateMachineArn": machine, "statusFilter": "RUNNING"},
    )
    sfn.add_response(
        "start_execution",
        {"executionArn": f"{dispatcher}:x", "startDate": datetime(2026, 1, 1, tzinfo=UTC)},
        {"stateMachineArn": dispatcher, "name": ANY, "input": "{}"},
    )
    with sfn:
        jobs = Jobs(aws.cluster())
        arn = jobs.start(
            "bert-1", TRAIN_ARGS, INPUTS, max_retries=3, retry_delay=30, options={"PollSeconds": 60}
        )
        (queued,) = jobs.queue.queued()
    sfn.assert_no_pending_responses()
    aws.verify()
    name = queued.execution_name
    assert arn == f"{machine.replace(':stateMachine:', ':execution:')}:{name}"
    assert aws.lines[0].startswith(f"waiting: instance refresh {REFRESH}")
    match = EXECUTION_NAME.match(name)
    assert match and match["job"] == "bert-1" and len(name) <= 80
    item = aws.clients.dynamodb.get_item(
        TableName="queue", Key={"Pk": {"S": "queue"}, "Sk": {"S": queued.key}}
    )["Item"]
    assert json.loads(item["Input"]["S"]) == {
        "JobId": "bert-1", "MasterPort": "29500", "NprocPerNode": "auto",
        "CodeSnapshot": INPUTS.code, "EntryPoint": "-m workload.train",
        "DataPath": "/fsx/data/imdb",
        "TrainArgs": " ".join(TRAIN_ARGS), "MaxRetries": 3, "RetryDelaySeconds": 30,
        "PollSeconds": 60,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("nodes", "requested", "expected"),
    [("2", None, 300), ("2", 194, 194), ("64", 201, 201), ("1024", None, 300)],
)
def test_the_check_interval_fits_one_attempt_in_an_execution_history(
    aws: FakeAws, nodes: str, requested: int | None, expected: int
) -> None:
    """A 48-hour attempt polled every PollSeconds by each batch of 50 nodes, 22 events a poll
    (the wait on the wake queue, then the poll reads the command and checks that the batch's
    instances still run), up to 40 wakes and, in RunTraining's first batch, 13 more events
    every 10 minutes (it reads the job's progress: stacks/supervisor_progress.py) in the
    batch's own child execution, stays within what the rest of the batch leaves of the 25,000
    events a standard execution keeps (Step Functions quotas): 194 s on 2 nodes, 201 s from 50
    nodes up, 1,024 included."""
    from scripts.cluster_lib.jobs import Jobs

    aws.stack({**OUTPUTS, "NodeCount": nodes})
    assert Jobs(aws.cluster()).poll_seconds(requested) == expected


def test_a_check_interval_too_short_for_the_history_is_refused_in_one_line(aws: FakeAws) -> None:
    from scripts.cluster_lib.jobs import Jobs

    aws.stack({**OUTPUTS, "NodeCount": "64"})
    with pytest.raises(ClusterError) as raised:
        Jobs(aws.cluster()).poll_seconds(100)
    assert str(raised.value) == (
        "--check-every 100 is too short for 64 nodes: an attempt of up to 48 hours checked "
        "that often would outgrow the 25,000 history events a supervisor execution keeps; use "
        "at least 201"
    )


def sns_event(event_id: int, message: str) -> dict[str, Any]:
    """A history event of the workflow publishing `message` to the cluster's topic."""
    import json

    return {
        "id": event_id, "type": "TaskScheduled", "timestamp": datetime(2026, 1, 1, tzinfo=UTC),
        "taskScheduledEventDetails": {
            "resourceType": "aws-sdk:sns", "resource": "publish", "region": "us-east-1",
            "parameters": json.dumps({"TopicArn": "arn:aws:sns:us-east-1:1:t", "Message": message}),
        },
    }  # fmt: skip


@pytest.mark.parametrize(
    ("error", "cause", "message"),
    [
        (
            "JobFailed",
            "the job's last attempt failed",
            'job bert-1 failed: Job bert-1 failed after 2 retries (commands ["c3"]). Read the '
            "output with `cluster.py logs --job-id bert-1`",
        ),
        (
            "NodesRunDifferentSoftware",
            "the nodes run different software: roll the fleet (trainium-cluster roll --wait), "
            "then resume the job with trainium-cluster train --resume <job ID>",
            "job bert-1 cannot run: the nodes run different software: roll the fleet "
            "(trainium-cluster roll --wait), then resume the job with trainium-cluster train "
            "--resume <job ID> "
            "(`cluster.py status` shows who runs what)",
        ),
    ],
)
def test_following_a_job_reads_the_history_once_more_after_its_end(
    aws: FakeAws, error: str, cause: str, message: str
) -> None:
    """The execution ended between the follower's last history read and its DescribeExecution:
    the events in between (the final notification) are read before the one line is written,
    and each way the supervisor ends a job gets its own line."""
    from botocore.stub import Stubber

    from scripts.cluster_lib.jobs import Jobs

    arn = "arn:aws:states:us-east-1:123456789012:execution:trainium-jobs:bert-1-x"
    history = {"executionArn": arn, "reverseOrder": True, "maxResults": 100}
    retry = sns_event(3, 'Job bert-1: attempt failed (commands ["c2"]); retry 2 of 2 ...')
    sfn = Stubber(aws.clients.stepfunctions)
    sfn.add_response("get_execution_history", {"events": [retry]}, history)
    ended = {
        "executionArn": arn, "stateMachineArn": arn.rsplit(":", 1)[0], "status": "FAILED",
        "startDate": datetime(2026, 1, 1, tzinfo=UTC), "name": "bert-1-x", "error": error,
        "cause": cause,
    }  # fmt: skip
    sfn.add_response("describe_execution", ended, {"executionArn": arn})
    # NotifyFailure's message (stacks/supervisor.py); a mixed fleet ends without it.
    failure = (
        'Job bert-1 failed after 2 retries (commands ["c3"]). Read the output with '
        "`cluster.py logs --job-id bert-1`."
    )
    final = [sns_event(5, failure)] if error == "JobFailed" else []
    sfn.add_response("get_execution_history", {"events": [*final, retry]}, history)
    with sfn, pytest.raises(ClusterError) as raised:
        Jobs(aws.cluster()).follow(arn, "bert-1", stream=False)
    sfn.assert_no_pending_responses()
    assert str(raised.value) == message


def test_following_a_job_goes_on_in_the_execution_it_was_handed_over_to(aws: FakeAws) -> None:
    """An execution that handed its job over (a new leg, a retry: the history budget) ends
    SUCCEEDED with ContinuedAs in its output; the follower reads its last events, then follows
    the successor from its first event until the job ends."""
    import json

    from botocore.stub import Stubber

    from scripts.cluster_lib.jobs import Jobs

    machine = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-jobs"
    first = machine.replace(":stateMachine:", ":execution:") + ":bert-1-20261123-100000"
    second = machine.replace(":stateMachine:", ":execution:") + ":bert-1-20261124-100000"
    leg = "Job bert-1: leg 1 ended at its time limit and saved a checkpoint; the next leg ..."
    done = "Job bert-1 finished on all 2 nodes after 0 retries and 2 legs."

    def described(arn: str, status: str, output: dict[str, Any] | None = None) -> dict:
        body = {
            "executionArn": arn, "stateMachineArn": machine, "status": status,
            "startDate": datetime(2026, 1, 1, tzinfo=UTC), "name": arn.rsplit(":", 1)[-1],
        }  # fmt: skip
        return {**body, "output": json.dumps(output)} if output else body

    def history(arn: str) -> dict[str, Any]:
        return {"executionArn": arn, "reverseOrder": True, "maxResults": 100}

    sfn = Stubber(aws.clients.stepfunctions)
    sfn.add_response("get_execution_history", {"events": []}, history(first))
    handed = {"JobId": "bert-1", "ContinuedAs": second.rsplit(":", 1)[-1], "Counters": {}}
    sfn.add_response(
        "describe_execution", described(first, "SUCCEEDED", handed), {"executionArn": first}
    )
    sfn.add_response("get_execution_history", {"events": [sns_event(7, leg)]}, history(first))
    sfn.add_response("get_execution_history", {"events": [sns_event(3, done)]}, history(second))
    sfn.add_response("describe_execution", described(second, "SUCCEEDED"), {"executionArn": second})
    sfn.add_response("get_execution_history", {"events": [sns_event(3, done)]}, history(second))
    with sfn:
        Jobs(aws.cluster()).follow(first, "bert-1", stream=False)
    sfn.assert_no_pending_responses()
    assert aws.lines == [
        f"job bert-1: {leg}",
        "job bert-1: continues in execution bert-1-20261124-100000",
        f"job bert-1: {done}",
        "job bert-1 finished (execution bert-1-20261124-100000)",
    ]


def test_stop_also_stops_the_successor_an_execution_started_while_being_stopped(
    aws: FakeAws,
) -> None:
    """The execution was handing the job over (a new leg) when `stop` listed it: its successor
    shows up in the next listing and is stopped too; an execution of another job is left."""
    from botocore.stub import Stubber

    from scripts.cluster_lib.jobs import HANDOVER_SECONDS, Jobs

    machine = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-jobs"
    aws.stack({**OUTPUTS, "JobStateMachineArn": machine})

    def execution(name: str) -> dict[str, Any]:
        return {
            "executionArn": f"{machine.replace(':stateMachine:', ':execution:')}:{name}",
            "stateMachineArn": machine, "name": name, "status": "RUNNING",
            "startDate": datetime(2026, 1, 1, tzinfo=UTC),
        }  # fmt: skip

    old, successor = execution("bert-1-20261123-100000"), execution("bert-1-20261125-100000")
    other = execution("other-20261123-090000")
    listing = {"stateMachineArn": machine, "statusFilter": "RUNNING"}
    sfn = Stubber(aws.clients.stepfunctions)
    for running in ([old, other], [successor, old, other], [other]):
        sfn.add_response("list_executions", {"executions": running}, listing)
        for stopped in [e for e in running if e in (old, successor)][:1]:
            sfn.add_response(
                "stop_execution",
                {"stopDate": datetime(2026, 1, 1, tzinfo=UTC)},
                {"executionArn": stopped["executionArn"], "error": "StoppedByOperator",
                 "cause": "cluster.py stop --job-id bert-1"},
            )  # fmt: skip
    with sfn:
        names = Jobs(aws.cluster()).stop("bert-1")
    sfn.assert_no_pending_responses()
    assert names == [old["name"], successor["name"]]
    assert aws.time.slept == [HANDOVER_SECONDS, HANDOVER_SECONDS]


@pytest.mark.parametrize("limit", [1, 2])
def test_jobs_puts_the_executions_of_a_handed_over_job_together(aws: FakeAws, limit: int) -> None:
    """bert-1 ran in three executions (two hand-overs), with another job's in between: one
    chain, newest first, then the other job; with --limit 1 the listing goes on past the
    other job's execution until bert-1's chain is whole."""
    import json

    from botocore.stub import Stubber

    from scripts.cluster_lib.jobs import Jobs

    machine = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-jobs"
    aws.stack({**OUTPUTS, "JobStateMachineArn": machine})
    prefix = machine.replace(":stateMachine:", ":execution:")

    def execution(name: str, status: str, after: str = "", to: str = "") -> dict[str, Any]:
        listed = {
            "executionArn": f"{prefix}:{name}", "stateMachineArn": machine, "name": name,
            "status": status, "startDate": datetime(2026, 1, 1, tzinfo=UTC),
        }  # fmt: skip
        described = {**listed, "input": json.dumps({"JobId": "x", "ContinuedFrom": after})}
        if to:
            described["output"] = json.dumps({"ContinuedAs": to})
        return {"listed": listed, "described": described}

    a = execution("bert-1-20261120-100000", "SUCCEEDED", to="bert-1-20261121-100000")
    b = execution("bert-1-20261121-100000", "SUCCEEDED", f"{prefix}:{a['listed']['name']}",
                  to="bert-1-20261122-100000")  # fmt: skip
    other = execution("other-20261121-120000", "FAILED")
    c = execution("bert-1-20261122-100000", "RUNNING", f"{prefix}:{b['listed']['name']}")
    newest_first = [c, other, b, a]
    sfn = Stubber(aws.clients.stepfunctions)
    sfn.add_response(
        "list_executions",
        {"executions": [e["listed"] for e in newest_first]},
        {"stateMachineArn": machine},
    )
    for e in newest_first:
        sfn.add_response(
            "describe_execution", e["described"], {"executionArn": e["listed"]["executionArn"]}
        )
    with sfn:
        chains = Jobs(aws.cluster()).chains(limit)
    sfn.assert_no_pending_responses()
    names = [[listed["name"] for listed, _ in chain] for chain in chains]
    expected = [[c["listed"]["name"], b["listed"]["name"], a["listed"]["name"]]]
    assert names == (expected if limit == 1 else [*expected, [other["listed"]["name"]]])


# -------------------------------------------------------------------------- export
TASK = "task-0123456789abcdef0"
FS = OUTPUTS["FileSystemId"]


def create_task(aws: FakeAws, paths: list[str] | None = None) -> None:
    expected: dict[str, Any] = {
        "Type": "EXPORT_TO_REPOSITORY", "FileSystemId": FS, "Report": {"Enabled": False},
    }  # fmt: skip
    if paths is not None:
        expected["Paths"] = paths
    aws.stubs["fsx"].add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task_body("PENDING")},
        expected,
    )


def task_body(lifecycle: str, done: int = 0, total: int = 0, failed: int = 0) -> dict[str, Any]:
    return {
        "TaskId": TASK, "Lifecycle": lifecycle, "Type": "EXPORT_TO_REPOSITORY",
        "CreationTime": datetime(2026, 5, 1, tzinfo=UTC), "FileSystemId": FS,
        "Status": {"TotalCount": total, "SucceededCount": done, "FailedCount": failed},
    }  # fmt: skip


def task_state(aws: FakeAws, lifecycle: str, done: int = 0, total: int = 0, **extra: Any) -> None:
    body = {**task_body(lifecycle, done, total, extra.pop("failed", 0)), **extra}
    aws.stubs["fsx"].add_response(
        "describe_data_repository_tasks", {"DataRepositoryTasks": [body]}, {"TaskIds": [TASK]}
    )


def test_export_runs_a_task_on_the_association_paths_and_waits_for_it(aws: FakeAws) -> None:
    import argparse

    from scripts import cluster as cli

    aws.stack({**OUTPUTS, "ExportPaths": "/jobs,/data"})
    # Relative to the mount point, as CreateDataRepositoryTask wants them.
    create_task(aws, ["jobs", "data"])
    task_state(aws, "EXECUTING", 40, 100)
    task_state(aws, "EXECUTING", 40, 100)
    task_state(aws, "SUCCEEDED", 100, 100)
    printed, restore = capture(cli)
    try:
        assert cli.cmd_export(aws.cluster(), argparse.Namespace(timeout=600)) == 0
    finally:
        restore()
    aws.verify()
    assert aws.lines == [
        f"export task {TASK} started: /jobs, /data of {FS} to S3",
        f"export task {TASK}: EXECUTING, 40 of 100 files exported, 0 failed",
        f"export task {TASK}: SUCCEEDED, 100 of 100 files exported, 0 failed",
    ]
    assert printed == [
        f"export task {TASK} succeeded: the files are in S3; the storage stack can be destroyed"
    ]


def test_export_of_the_root_exports_the_whole_file_system(aws: FakeAws) -> None:
    aws.stack({**OUTPUTS, "ExportPaths": "/"})
    create_task(aws, None)
    task_state(aws, "SUCCEEDED", 3, 3)
    assert aws.cluster().export(timeout=60)["TaskId"] == TASK
    aws.verify()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("failed", f"export task {TASK} FAILED: The S3 bucket policy denies PutObject"),
        ("files", f"export task {TASK} ended with 2 files not exported: check them before"),
        ("busy", f"another data repository task runs on {FS}: wait for it to end"),
        ("outputs", "stack trainium-operations lacks the outputs FileSystemId, ExportPaths: "),
        ("timeout", f"export task {TASK} still runs after 10 s; export task {TASK} goes on: "),
    ],
)
def test_export_failures_get_one_line(aws: FakeAws, setup: str, message: str) -> None:
    outputs = dict(OUTPUTS)
    if setup == "outputs":
        del outputs["FileSystemId"], outputs["ExportPaths"]
    aws.stack(outputs)
    if setup == "busy":
        aws.stubs["fsx"].add_client_error(
            "create_data_repository_task", service_error_code="DataRepositoryTaskExecuting",
            service_message="A data repository task is executing", http_status_code=400,
        )  # fmt: skip
    elif setup != "outputs":
        create_task(aws, ["jobs"])
    if setup == "failed":
        task_state(
            aws, "FAILED", 0, 10,
            FailureDetails={"Message": "The S3 bucket policy denies PutObject"},
        )  # fmt: skip
    if setup == "files":
        task_state(aws, "SUCCEEDED", 8, 10, failed=2)
    if setup == "timeout":
        for _ in range(3):
            task_state(aws, "EXECUTING", 1, 10)
    with pytest.raises(ClusterError) as error:
        aws.cluster().export(timeout=10)
    assert "\n" not in str(error.value)
    assert str(error.value).startswith(message)
    aws.verify()


def test_status_without_the_compute_stack_still_lists_the_rest(aws: FakeAws) -> None:
    from scripts import cluster as cli

    aws.stack()
    aws.stubs["autoscaling"].add_response(
        "describe_auto_scaling_groups", {"AutoScalingGroups": []},
        {"AutoScalingGroupNames": [GROUP]},
    )  # fmt: skip
    for name in ("RunTraining", "Preflight", "Precompile", "StopTraining"):
        aws.stubs["ssm"].add_response(
            "list_commands", {"Commands": []},
            {"Filters": [{"key": "DocumentName", "value": OUTPUTS[f"{name}DocumentName"]}],
             "MaxResults": 8},
        )  # fmt: skip
    printed, restore = capture(cli)
    try:
        assert cli.cmd_status(aws.cluster()) == 0
    finally:
        restore()
    aws.verify()
    assert printed[1:] == [
        f"launch template: unknown (Auto Scaling group {GROUP} does not exist: deploy the "
        "compute stack)",
        "nodes: 0 running of 2, 0 starting",
        "recent commands: none",
    ]


@pytest.mark.parametrize("by", ["LaunchTemplateId", "LaunchTemplateName"])
def test_the_groups_template_is_found_by_id_or_by_name(aws: FakeAws, by: str) -> None:
    template = aws.clients.ec2.create_launch_template(
        LaunchTemplateName="trainium-nodes", LaunchTemplateData={"ImageId": "ami-12c6146b"}
    )["LaunchTemplate"]
    aws.stack()
    aws.stubs["autoscaling"].add_response(
        "describe_auto_scaling_groups",
        {"AutoScalingGroups": [{
            "AutoScalingGroupName": GROUP, "MinSize": 2, "MaxSize": 2, "DesiredCapacity": 2,
            "DefaultCooldown": 300, "AvailabilityZones": ["us-east-1a"], "HealthCheckType": "EC2",
            "CreatedTime": datetime(2026, 1, 1, tzinfo=UTC),
            "LaunchTemplate": {by: template[by], "Version": "$Latest"},
        }]},
        {"AutoScalingGroupNames": [GROUP]},
    )  # fmt: skip
    assert aws.cluster().launch_template() == {
        "id": template["LaunchTemplateId"], "version": "1", "ami": "ami-12c6146b",
    }  # fmt: skip
    aws.verify()


def test_status_names_the_spares_and_the_nodes_that_run_a_job(aws: FakeAws) -> None:
    """A cluster with spare_nodes=1 runs 3 nodes for a 2-node job: status shows which 2 run
    the job (the targets of its RunTraining command still executing: ListCommands'
    ExecutionStage filter, SSM API reference, CommandFilter) and which one is the spare."""
    from scripts import cluster as cli

    nodes = aws.launch(3)
    ids = [n["InstanceId"] for n in nodes]
    aws.stack({**OUTPUTS, "SpareNodes": "1"})
    aws.stubs["autoscaling"].add_response(
        "describe_auto_scaling_groups", {"AutoScalingGroups": []},
        {"AutoScalingGroupNames": [GROUP]},
    )  # fmt: skip
    aws.online(nodes)
    aws.stubs["ssm"].add_response(
        "list_commands", {"Commands": []},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["PreflightDocumentName"]}],
         "MaxResults": 10},
    )  # fmt: skip
    run = "00000000-0000-4000-8000-000000000001"
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [{"CommandId": run, "Parameters": {"JobId": ["bert-1"]}}]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]},
                     {"key": "ExecutionStage", "value": "Executing"}]},
    )  # fmt: skip
    aws.stubs["ssm"].add_response(
        "list_command_invocations",
        {"CommandInvocations": [
            {"CommandId": run, "InstanceId": ids[0], "Status": "InProgress"},
            {"CommandId": run, "InstanceId": ids[2], "Status": "InProgress"},
        ]},
        {"CommandId": run},
    )  # fmt: skip
    for name in ("RunTraining", "Preflight", "Precompile", "StopTraining"):
        aws.stubs["ssm"].add_response(
            "list_commands", {"Commands": []},
            {"Filters": [{"key": "DocumentName", "value": OUTPUTS[f"{name}DocumentName"]}],
             "MaxResults": 8},
        )  # fmt: skip
    printed, restore = capture(cli)
    try:
        assert cli.cmd_status(aws.cluster()) == 0
    finally:
        restore()
    aws.verify()
    assert printed[2] == "nodes: 3 running of 2 + 1 spare, 0 starting"
    rows = {row.split()[1]: row for row in printed[3:6]}
    assert rows[ids[0]].endswith("  job bert-1") and rows[ids[2]].endswith("  job bert-1")
    assert rows[ids[1]].endswith("  spare")
