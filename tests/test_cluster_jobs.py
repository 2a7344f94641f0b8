"""Commands on the cluster's nodes: batches of at most 50 nodes per SendCommand, following
them and cancelling the rest after a failure, nodes that run different software (contract C3),
the end of `logs --follow`, and `stop` leaving no command of the job running. (Retries and legs
that end at their time limit, contract C4, are the job supervisor's: tests/test_supervisor.py.)"""

from __future__ import annotations

import re
from typing import Any

import pytest

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.queue import JobQueue
from tests.cluster_support import (
    OUTPUTS,
    SOFTWARE,
    FakeAws,
    Instance,
    printed_logs,
    run_training,
    train_parameters,
)


def cancel(aws: FakeAws, command_id: str, instances: list[Instance]) -> None:
    aws.stubs["ssm"].add_response(
        "cancel_command",
        {},
        {"CommandId": command_id, "InstanceIds": [i["InstanceId"] for i in instances]},
    )


# ------------------------------------------------------------- 64 nodes, 2 commands
def sixty_four(aws: FakeAws) -> list[Instance]:
    nodes = aws.launch(64)
    aws.stack({**OUTPUTS, "NodeCount": "64"})
    aws.online(nodes)
    return nodes


def test_64_nodes_get_two_commands_of_at_most_50_with_the_whole_host_list(aws: FakeAws) -> None:
    nodes = sixty_four(aws)
    parameters = train_parameters(nodes)
    assert parameters["Hosts"].count(",") == 63
    first = aws.send("RunTraining", nodes[:50], parameters)
    second = aws.send("RunTraining", nodes[50:], parameters)
    aws.poll(first, nodes[:50], ["InProgress"] * 50)
    aws.poll(second, nodes[50:], ["InProgress"] * 14)
    aws.all_succeed(first, nodes[:50])
    aws.all_succeed(second, nodes[50:])
    comments: list[str] = []
    aws.clients.ssm.meta.events.register(
        "before-parameter-build.ssm.SendCommand",
        lambda params, **_: comments.append(params["Comment"]),
    )

    result = run_training(aws.cluster())

    assert result.ok
    assert result.command_ids == [first, second]
    # Every node keeps its rank from the one host list, whichever command it is in.
    assert [inv.rank for inv in result.invocations] == list(range(64))
    assert {inv.command_id for inv in result.invocations[50:]} == {second}
    assert f"RunTraining: commands {first}, {second} sent to 64 nodes" in aws.lines
    # One comment for the attempt, with a token of its own, then the part.
    assert re.fullmatch(r"bert-1 attempt 1 #[0-9a-f]{6} part 1/2", comments[0])
    assert comments[1] == comments[0].replace("part 1/2", "part 2/2")
    aws.verify()


def test_a_failure_in_one_batch_cancels_the_running_nodes_of_every_batch(aws: FakeAws) -> None:
    nodes = sixty_four(aws)
    parameters = train_parameters(nodes)
    first = aws.send("RunTraining", nodes[:50], parameters)
    second = aws.send("RunTraining", nodes[50:], parameters)
    # Node 60 (in the second command) fails; everything else runs on past the 30 s grace.
    failed = ["InProgress"] * 10 + [("Failed", 1)] + ["InProgress"] * 3
    for _ in range(7):
        aws.poll(first, nodes[:50], ["InProgress"] * 50)
        aws.poll(second, nodes[50:], failed)
    cancel(aws, first, nodes[:50])
    cancel(aws, second, nodes[50:60] + nodes[61:])
    aws.poll(first, nodes[:50], [("Cancelled", -1)] * 50)
    aws.poll(
        second, nodes[50:], [("Cancelled", -1)] * 10 + [("Failed", 1)] + [("Cancelled", -1)] * 3
    )
    aws.log_tail(second, nodes[60], ["RuntimeError: EFA endpoint closed"])

    result = run_training(aws.cluster())

    assert not result.ok
    first_line = result.summary().splitlines()[0]
    assert first_line.startswith(
        f"RunTraining failed on node 60 ({nodes[60]['PrivateIpAddress']}, "
        f"{nodes[60]['InstanceId']}): Failed (exit status 1), command {second}; also ended on "
    )
    assert first_line.endswith(" and 55 more")
    assert result.summary().splitlines()[-1] == "RuntimeError: EFA endpoint closed"
    aws.verify()


def test_a_batch_that_cannot_be_sent_cancels_the_batches_already_sent(aws: FakeAws) -> None:
    nodes = sixty_four(aws)
    first = aws.send("RunTraining", nodes[:50], train_parameters(nodes))
    aws.stubs["ssm"].add_client_error(
        "send_command", service_error_code="InvalidInstanceId",
        service_message="Instances not in a valid state", http_status_code=400,
    )  # fmt: skip
    aws.stubs["ssm"].add_response("cancel_command", {}, {"CommandId": first, "InstanceIds": [
        i["InstanceId"] for i in nodes[:50]
    ]})  # fmt: skip

    with pytest.raises(
        ClusterError, match=r"^sending RunTraining failed: InvalidInstanceId: Instances not in"
    ):
        run_training(aws.cluster())
    aws.verify()
    assert any(line.startswith(f"cancelling command {first} on 50 nodes") for line in aws.lines)


# ------------------------------------------------------------ node software (C3)
def test_preflight_reports_the_software_every_node_runs(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    aws.preflight_passes(nodes, ["checks passed\n" + SOFTWARE + "\n", SOFTWARE])
    assert aws.cluster().preflight().ok
    aws.verify()
    assert (
        "software: version=0123456789abcdef launch-template-version=3 ami=ami-12c6146b on all "
        "2 nodes"
    ) in aws.lines


def test_nodes_that_run_different_software_are_refused_in_one_line(aws: FakeAws) -> None:
    nodes = aws.launch(3)
    aws.stack({**OUTPUTS, "NodeCount": "3"})
    aws.online(nodes)
    newer = SOFTWARE.replace("version=0123456789abcdef", "version=fedcba9876543210").replace(
        "launch-template-version=3", "launch-template-version=4"
    )
    aws.preflight_passes(nodes, [SOFTWARE, newer, SOFTWARE])

    with pytest.raises(ClusterError) as error:
        aws.cluster().preflight()

    message = str(error.value)
    assert "\n" not in message
    assert message == (
        "the nodes run different software: 2 nodes run version=0123456789abcdef "
        "launch-template-version=3 ami=ami-12c6146b; "
        f"node 1 ({nodes[1]['PrivateIpAddress']}, {nodes[1]['InstanceId']}) runs "
        "version=fedcba9876543210 launch-template-version=4 ami=ami-12c6146b: roll the fleet so "
        "that every node runs the group's current launch template (`cluster.py roll`, see the "
        "README)"
    )
    aws.verify()


def test_a_node_without_the_software_line_is_looked_up_in_its_log_and_named(
    aws: FakeAws,
) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    check = aws.preflight_passes(nodes, [SOFTWARE, "checks passed"])
    aws.stubs["logs"].add_response(
        "filter_log_events",
        {"events": []},
        {"logGroupName": OUTPUTS["TrainingLogGroupName"],
         "logStreamNamePrefix": f"{check}/{nodes[1]['InstanceId']}/",
         "filterPattern": '"node-software:"'},
    )  # fmt: skip
    with pytest.raises(ClusterError, match=r"node 1 \(.*\) runs no node-software line: roll"):
        aws.cluster().preflight()
    aws.verify()


# ------------------------------------------------------------------ logs --follow
def test_logs_follow_ends_when_the_command_ends(aws: FakeAws) -> None:
    nodes = aws.launch(1)
    aws.stack({**OUTPUTS, "NodeCount": "1"})
    from datetime import UTC, datetime

    command = "00000000-0000-4000-8000-000000000042"
    iid = nodes[0]["InstanceId"]
    sent = datetime(2026, 5, 1, 12, tzinfo=UTC)
    view = {
        "CommandId": command,
        "DocumentName": OUTPUTS["RunTrainingDocumentName"],
        "RequestedDateTime": sent,
        "InstanceIds": [iid],
        "Parameters": {"JobId": ["j"]},
    }
    # The command, then its document's commands (none later: the window stays open).
    aws.stubs["ssm"].add_response("list_commands", {"Commands": [view]}, {"CommandId": command})
    aws.stubs["ssm"].add_response(
        "list_commands", {"Commands": [view]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]}]},
    )  # fmt: skip
    stream = f"{iid}/jobs"  # the job's output: the node's job-log stream
    group = OUTPUTS["TrainingLogGroupName"]
    since = int(sent.timestamp() * 1000)

    def events(message: str, token: str, **expected: Any) -> None:
        aws.stubs["logs"].add_response(
            "get_log_events",
            {"events": [{"timestamp": 0, "message": message}] if message else [],
             "nextForwardToken": token},
            {"logGroupName": group, "logStreamName": stream, "startTime": since, **expected},
        )  # fmt: skip

    def status(value: str) -> None:
        aws.stubs["ssm"].add_response(
            "list_commands", {"Commands": [{"CommandId": command, "Status": value}]},
            {"CommandId": command},
        )  # fmt: skip

    events("step 10", "t1", startFromHead=False, limit=100)
    status("InProgress")
    events("step 20", "t2", startFromHead=True, nextToken="t1")
    status("Success")
    events("summary", "t3", startFromHead=True, nextToken="t2")
    printed = printed_logs(
        aws.cluster(),
        job_id=None, command_id=command, node=None, lines=100, follow=True, poll_interval=5,
    )  # fmt: skip
    aws.verify()
    assert printed == [
        f"{iid} 00:00:00 step 10",
        f"{iid} 00:00:00 step 20",
        f"{iid} 00:00:00 summary",
        f"command ended: {command} Success",
    ]


def test_logs_of_a_job_cover_every_batch_of_its_latest_attempt(aws: FakeAws) -> None:
    aws.stack()
    first, second, older = (f"00000000-0000-4000-8000-00000000000{n}" for n in (1, 2, 3))
    from datetime import UTC, datetime

    # The older command is a batch of an earlier `train` of the same job: same attempt number,
    # another token.
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [
            {"CommandId": older, "Comment": "bert-1 attempt 2 #0a1b2c part 1/2",
             "RequestedDateTime": datetime(2026, 5, 1, tzinfo=UTC),
             "Parameters": {"JobId": ["bert-1"]}},
            {"CommandId": first, "Comment": "bert-1 attempt 2 #3d4e5f part 1/2",
             "RequestedDateTime": datetime(2026, 5, 2, tzinfo=UTC),
             "Parameters": {"JobId": ["bert-1"]}},
            {"CommandId": second, "Comment": "bert-1 attempt 2 #3d4e5f part 2/2",
             "RequestedDateTime": datetime(2026, 5, 2, tzinfo=UTC),
             "Parameters": {"JobId": ["bert-1"]}},
        ]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]}]},
    )  # fmt: skip
    assert aws.cluster().latest_commands("bert-1") == [first, second]


# ------------------------------------------------------------------------- stop
def test_stop_cancels_the_jobs_commands_that_ssm_still_runs(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    aws.all_succeed(aws.send("StopTraining", nodes, {"JobId": "bert-1"}), nodes)
    running = "00000000-0000-4000-8000-0000000000aa"
    aws.running_commands(
        [
            {"CommandId": running, "Status": "InProgress", "Parameters": {"JobId": ["bert-1"]}},
            {"CommandId": running[:-1] + "b", "Status": "InProgress",
             "Parameters": {"JobId": ["other"]}},
            {"CommandId": running[:-1] + "c", "Status": "Success",
             "Parameters": {"JobId": ["bert-1"]}},
        ],
        [],
    )  # fmt: skip
    aws.stubs["ssm"].add_response("cancel_command", {}, {"CommandId": running})
    assert aws.cluster().stop("bert-1").ok
    aws.verify()
    assert f"cancelling RunTraining command {running} of job bert-1" in aws.lines


def test_nodes_that_all_lack_the_software_line_pass_with_a_note(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    check = aws.preflight_passes(nodes, "checks passed")
    for node in nodes:
        aws.stubs["logs"].add_response(
            "filter_log_events", {"events": []},
            {"logGroupName": OUTPUTS["TrainingLogGroupName"],
             "logStreamNamePrefix": f"{check}/{node['InstanceId']}/",
             "filterPattern": '"node-software:"'},
        )  # fmt: skip
    assert aws.cluster().preflight().ok
    aws.verify()
    assert "software: no node reports it (node scripts older than this CLI)" in aws.lines


def test_cancelling_the_survivors_rides_out_throttling(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    for _ in range(7):
        aws.poll(job, nodes, ["InProgress", ("Failed", 1)])
    aws.stubs["ssm"].add_client_error(
        "cancel_command", service_error_code="ThrottlingException", http_status_code=400
    )
    cancel(aws, job, nodes[:1])
    aws.poll(job, nodes, [("Cancelled", -1), ("Failed", 1)])
    aws.log_tail(job, nodes[1], ["RuntimeError"])

    result = run_training(aws.cluster())

    assert result.summary().startswith("RunTraining failed on node 1")
    aws.verify()
    assert any("while cancelling the command; trying again" in line for line in aws.lines)


# ------------------------------------------------------------------ what happened
def test_jobs_lists_under_each_job_why_its_supervisor_retried_continued_or_failed() -> None:
    """The morning's `jobs`: under the job's row, oldest first, each hand-over's `Why` (a retry
    with what happened on each node, a new leg) and the cause of the failure that ended it, as
    the supervisor wrote them (stacks/supervisor_outcomes.py: HandedOver, JobFailed)."""
    import json
    from datetime import UTC, datetime

    from scripts.cluster_lib.jobs import JobRow, rows_text, story_of

    def pair(name: str, status: str, day: int, **described: Any) -> tuple[dict, dict]:
        listed = {
            "name": name,
            "status": status,
            "stopDate": datetime(2026, 11, day, 3, 12, tzinfo=UTC),
        }
        return listed, {"name": name, "status": status, **described}

    gone = "i-0abc: node gone (its instance no longer runs); RunTraining never ended"
    retry = (
        f'retry 1 of 2: attempt 1 failed: [["{gone}","i-0def: RunTraining failed with status 1"]]'
    )
    leg = "leg 1 ended at its time limit and saved a checkpoint; leg 2 resumes from it"
    failure = 'attempt 3 failed after 2 retries: [["i-0def: RunTraining failed with status 1"]]'
    chain = [  # newest first, as Executions.chains gives it
        pair("bert-1-20261124-031200", "FAILED", 24, error="JobFailed", cause=failure),
        pair("bert-1-20261123-031200", "SUCCEEDED", 23,
             output=json.dumps({"ContinuedAs": "bert-1-20261124-031200", "Why": leg})),
        pair("bert-1-20261122-031200", "SUCCEEDED", 22,
             output=json.dumps({"ContinuedAs": "bert-1-20261123-031200", "Why": retry})),
    ]  # fmt: skip
    story = story_of(chain)
    assert story == [
        f"2026-11-22 03:12  {retry}",
        f"2026-11-23 03:12  {leg}",
        f"2026-11-24 03:12  failed: {failure}",
    ]
    # A stopped or refused job, or one that finished, adds nothing of its own.
    assert story_of([pair("x", "FAILED", 24, error="JobStopped", cause="stopped")]) == []
    row = JobRow("bert-1", "FAILED", datetime(2026, 11, 22, tzinfo=UTC), "2d03h", story=story)
    lines = list(rows_text([row]))
    assert lines[1].startswith("bert-1 ") and lines[2:] == [f"    {line}" for line in story]


def test_stop_of_a_job_that_neither_runs_nor_is_queued_says_so_and_stops_nothing(
    aws: FakeAws,
) -> None:
    """`stop` of a mistyped job ID: no execution of it runs and SSM runs no command of it.
    StopTraining would find no process of it on any node (stop.sh exits 0 then), so the stop
    used to report success on every node while the real job kept running. The execution of the
    job that does run is left alone; the one line names it."""
    import argparse
    import json

    from scripts.cluster import cmd_stop

    aws.launch(2)
    sfn = aws.clients.stepfunctions
    machine = sfn.create_state_machine(
        name="trainium-jobs",
        definition=json.dumps(
            {"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 9, "End": True}}}
        ),
        roleArn="arn:aws:iam::123456789012:role/trainium-jobs",
    )["stateMachineArn"]
    real = sfn.start_execution(stateMachineArn=machine, name="bert-1-20261126-010203", input="{}")[
        "executionArn"
    ]
    # The job queue (stacks/job_queue.py), with another job queued.
    dynamodb = aws.clients.dynamodb
    keys = [{"AttributeName": "Pk", "KeyType": "HASH"}, {"AttributeName": "Sk", "KeyType": "RANGE"}]
    dynamodb.create_table(
        TableName="queue", KeySchema=keys, BillingMode="PAY_PER_REQUEST",
        AttributeDefinitions=[{"AttributeName": k, "AttributeType": "S"} for k in ("Pk", "Sk")],
    )  # fmt: skip
    aws.stack({**OUTPUTS, "JobStateMachineArn": machine, "JobQueueTableName": "queue"})
    cluster = aws.cluster()
    queue = JobQueue(dynamodb, sfn, cluster.stack)
    queue.enqueue("bert-3", "bert-3-20261126-010204", {"JobId": "bert-3"})
    aws.running_commands(
        [{"CommandId": "00000000-0000-4000-8000-0000000000aa", "Status": "InProgress",
          "Parameters": {"JobId": ["bert-1"]}}],
        [],
    )  # fmt: skip
    # Every SSM call the stop makes (before the Stubber answers it): only the two searches for
    # the job's running commands; before this check it went on to StopTraining on every node.
    calls: list[str] = []
    aws.clients.ssm.meta.events.register_first(
        "before-call.*.*", lambda model, **_: calls.append(model.name)
    )  # the Stubber's node: its answer ends the event (FakeAws.intercept)

    with pytest.raises(ClusterError) as raised:
        cmd_stop(cluster, argparse.Namespace(job_id="bert-2"))

    assert str(raised.value) == "job bert-2 is neither running nor queued (running: bert-1)"
    assert calls == ["ListCommands", "ListCommands"]
    aws.verify()
    assert sfn.describe_execution(executionArn=real)["status"] == "RUNNING"
    assert [q.job_id for q in queue.queued()] == ["bert-3"]
