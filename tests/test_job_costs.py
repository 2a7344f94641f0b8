"""What `jobs` shows of the nodes' cost (scripts/cluster_lib/costs.py): per job, per attempt,
what the retries cost, the idle time between jobs, and the warning for nodes up with no job.

The CLI runs against its stand-ins (tests/cluster_support.py): EC2 in moto, CloudFormation and
SSM stubbed, and Step Functions stubbed here, every answer checked by botocore's Stubber against
the service's output shape. The price is the stack's output NodeUsdPerHour (the setting
node_usd_per_hour, else the on-demand price of stacks/instance_types.py).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from botocore.stub import Stubber

from scripts.cluster_lib.costs import Price, attempt_lines, attempts, idle_line
from stacks.config import ClusterConfig, ConfigError
from stacks.instance_types import INSTANCE_TYPES
from tests.cluster_support import OUTPUTS, FakeAws

MACHINE = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-jobs"
PRICED = {**OUTPUTS, "JobStateMachineArn": MACHINE, "NodeUsdPerHour": "21.5",
          "IdleWarningMinutes": "60"}  # fmt: skip
T0 = datetime(2026, 11, 22, 3, 0, tzinfo=UTC)


def run_training(command_id: str, job: str, at: datetime, nodes: int, comment: str) -> dict:
    """A RunTraining command as SSM ListCommands lists it (the Stubber checks the shape)."""
    return {
        "CommandId": f"{command_id:0>8}-0000-4000-8000-000000000000",
        "DocumentName": OUTPUTS["RunTrainingDocumentName"],
        "Comment": comment,
        "Parameters": {"JobId": [job], "Hosts": ["10.9.9.9"]},
        "RequestedDateTime": at,
        "Status": "Failed",
        "TargetCount": nodes,
    }


def test_attempts_span_from_each_runtraining_to_the_next_on_the_nodes_their_batches_targeted() -> (
    None
):
    """64 nodes: the first attempt is two batches (50 + 14, one comment but for `part i/k`);
    it counts until the retry's RunTraining, the retry until the job's end."""
    first = T0 + timedelta(minutes=30)
    retry = first + timedelta(hours=4)
    commands = [
        run_training("c1", "big", first, 50, "big attempt 1 #ab12 part 1/2"),
        run_training("c2", "big", first + timedelta(seconds=2), 14, "big attempt 1 #ab12 part 2/2"),
        run_training("c3", "big", retry, 50, "big attempt 2 #cd34 part 1/2"),
        run_training("c4", "big", retry, 14, "big attempt 2 #cd34 part 2/2"),
    ]
    found = attempts(commands, retry + timedelta(hours=2))
    assert [(a.started, a.nodes, a.node_hours) for a in found] == [
        (first, 64, 256.0),
        (retry, 64, 128.0),
    ]
    lines = attempt_lines(found, Price(21.5))
    assert lines == [
        "attempt 1: 2026-11-22 03:30  4h00m on 64 nodes = 256.0 node-hours, $5,504.00",
        "attempt 2: 2026-11-22 07:30  2h00m on 64 nodes = 128.0 node-hours, $2,752.00",
        "retries: 1, 256.0 node-hours, $5,504.00 of the job's cost",
    ]
    # No price known (an instance type without one, no setting): node-hours only.
    assert attempt_lines(found[:1], Price(None)) == [
        "attempt 1: 2026-11-22 03:30  4h00m on 64 nodes = 256.0 node-hours, -"
    ]


def _executions(aws: FakeAws) -> Stubber:
    """Step Functions stubbed with two ended jobs, newest first: `second` (one attempt) and
    `first` (retried once), 2 hours apart."""
    stub = Stubber(aws.clients.stepfunctions)
    listed = [
        ("second-20261122-150000", T0 + timedelta(hours=12), T0 + timedelta(hours=13)),
        ("first-20261122-030000", T0, T0 + timedelta(hours=10)),
    ]
    stub.add_response(
        "list_executions",
        {"executions": [
            {"executionArn": f"{MACHINE.replace('stateMachine', 'execution')}:{name}",
             "stateMachineArn": MACHINE, "name": name, "status": "SUCCEEDED",
             "startDate": start, "stopDate": stop}
            for name, start, stop in listed
        ]},
        {"stateMachineArn": MACHINE},
    )  # fmt: skip
    for name, start, stop in listed:
        arn = f"{MACHINE.replace('stateMachine', 'execution')}:{name}"
        stub.add_response(
            "describe_execution",
            {"executionArn": arn, "stateMachineArn": MACHINE, "name": name,
             "status": "SUCCEEDED", "startDate": start, "stopDate": stop,
             "input": json.dumps({"JobId": name.split("-")[0]}), "output": "{}"},
            {"executionArn": arn},
        )  # fmt: skip
    for name, start, _ in listed:
        arn = f"{MACHINE.replace('stateMachine', 'execution')}:{name}"
        stub.add_response(
            "get_execution_history",
            {"events": [{"timestamp": start, "type": "ExecutionStarted", "id": 1}]},
            {"executionArn": arn, "reverseOrder": True, "maxResults": 100},
        )
    stub.activate()
    return stub


def test_jobs_shows_each_jobs_cost_its_attempts_its_retries_and_the_idle_time_before_it(
    aws: FakeAws,
) -> None:
    """first: 10 h on 2 nodes at $21.50 = $430.00, retried once (its first attempt from 03:30
    to 07:30: 8 node-hours, $172.00); 2 h idle, then second: 1 h, $43.00."""
    from scripts.cluster_lib.jobs import Jobs, rows_text

    aws.stack(PRICED)
    stub = _executions(aws)
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [
            run_training("c3", "second", T0 + timedelta(hours=12, minutes=10), 2,
                         "second attempt 1"),
            run_training("c2", "first", T0 + timedelta(hours=4, minutes=30), 2, "first attempt 2"),
            run_training("c1", "first", T0 + timedelta(minutes=30), 2, "first attempt 1"),
        ]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]}]},
    )  # fmt: skip
    jobs = Jobs(aws.cluster())
    rows = jobs.rows()
    stub.assert_no_pending_responses()
    assert [(r.job_id, r.cost) for r in rows] == [("second", "$43.00"), ("first", "$430.00")]
    lines = list(rows_text(rows))
    assert "COST" in lines[0].split()
    assert lines[1].split()[0] == "second" and "$43.00" in lines[1].split()
    assert lines[2:] == [
        "    idle before it: 2h00m with no job, up to 4.0 node-hours ($86.00) with the group's 2 "
        "nodes up",
        "    attempt 1: 2026-11-22 15:10  50m00s on 2 nodes = 1.7 node-hours, $35.83",
        lines[4],
        "    attempt 1: 2026-11-22 03:30  4h00m on 2 nodes = 8.0 node-hours, $172.00",
        "    attempt 2: 2026-11-22 07:30  5h30m on 2 nodes = 11.0 node-hours, $236.50",
        "    retries: 1, 8.0 node-hours, $172.00 of the job's cost",
    ]
    assert lines[4].split()[0] == "first" and "$430.00" in lines[4].split()


def test_nodes_up_with_no_job_past_the_setting_get_a_warning_with_what_they_cost(
    aws: FakeAws,
) -> None:
    """Two nodes launched (moto) after the last job ended and no job since: no warning within
    the 60 minutes, a warning with the node-hours and their cost after them."""
    from scripts.cluster_lib.jobs import JobRow, Jobs

    aws.stack(PRICED)
    nodes = aws.launch(2)
    launched = nodes[0]["LaunchTime"]
    ended = [JobRow("first", "SUCCEEDED", T0, "10h00m", ended=T0 + timedelta(hours=10))]
    jobs = Jobs(aws.cluster())
    assert jobs.idle_warning(ended, now=launched + timedelta(minutes=59)) is None
    warning = jobs.idle_warning(ended, now=launched + timedelta(hours=3))
    assert warning == (
        "warning: 2 nodes up with no job for 3h00m (6.0 node-hours, $129.00 so far; the warning "
        "comes after 60 minutes, setting idle_warning_minutes): queue a job, or destroy the "
        "compute stack to stop paying for the nodes"
    )
    # A job that runs (or waits in the queue: no end) means the nodes are not idle.
    running = [JobRow("next", "RUNNING", T0, "1h00m")]
    assert jobs.idle_warning(running, now=launched + timedelta(hours=3)) is None


def test_the_idle_warning_is_off_at_0_and_counts_from_the_later_of_end_and_launch() -> None:
    now = T0 + timedelta(hours=5)
    assert idle_line(nodes_up=2, since=T0, now=now, price=Price(21.5, 0)) is None
    assert idle_line(nodes_up=0, since=T0, now=now, price=Price(21.5, 60)) is None
    line = idle_line(nodes_up=4, since=T0, now=now, price=Price(None, 60))
    assert line is not None and "(20.0 node-hours, - so far;" in line


def test_the_price_is_the_setting_else_the_on_demand_price_of_the_instance_type() -> None:
    assert ClusterConfig().node_price == INSTANCE_TYPES["trn1.32xlarge"].on_demand_usd_per_hour
    assert ClusterConfig(node_usd_per_hour="12.34").node_price == 12.34
    assert Price.of(_outputs({"NodeUsdPerHour": "12.34", "IdleWarningMinutes": "0"})) == Price(
        12.34, 0
    )
    assert Price.of(_outputs({"NodeUsdPerHour": "unknown"})).usd_per_node_hour is None
    # A stack deployed before these outputs: the on-demand price, the default threshold.
    assert Price.of(_outputs({})) == Price(21.5, 60)


def _outputs(extra: dict[str, str]) -> Any:
    from scripts.cluster_lib.outputs import StackOutputs

    return StackOutputs("trainium-operations", {**OUTPUTS, **extra})


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"node_usd_per_hour": "cheap"}, "node_usd_per_hour='cheap' is not a price; allowed: "),
        ({"node_usd_per_hour": "0"}, "node_usd_per_hour='0' is not a price; allowed: "),
        ({"idle_warning_minutes": -1}, "idle_warning_minutes=-1 is out of range; allowed: 0 "),
    ],
)
def test_bad_cost_settings_are_refused_in_one_line(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ClusterConfig(**settings)
    assert str(caught.value).startswith(message), caught.value
    assert "\n" not in str(caught.value)


def test_the_operations_stack_outputs_the_price_and_the_threshold() -> None:
    """The default cluster's template (tests/__snapshots__ holds it): the on-demand price of
    trn1.32xlarge and the default threshold, as the CLI reads them."""
    from tests.cdk_support import synth

    outputs = synth().templates["operations"]["Outputs"]
    assert outputs["NodeUsdPerHour"] == {"Value": "21.5"}
    assert outputs["IdleWarningMinutes"] == {"Value": "60"}


def test_status_warns_from_the_queue_and_the_newest_execution_alone(aws: FakeAws) -> None:
    """`status` reads one execution (ListExecutions, maxResults 1) and the queue: nodes up 2
    hours after the last job ended and nothing queued get the warning; a queued job ends it."""
    from scripts.cluster_lib.jobs import Jobs
    from scripts.cluster_lib.queue import QUEUE_TABLE_OUTPUT

    aws.clients.dynamodb.create_table(
        TableName="trainium-queue",
        KeySchema=[{"AttributeName": "Pk", "KeyType": "HASH"},
                   {"AttributeName": "Sk", "KeyType": "RANGE"}],
        AttributeDefinitions=[{"AttributeName": "Pk", "AttributeType": "S"},
                              {"AttributeName": "Sk", "AttributeType": "S"}],
        BillingMode="PAY_PER_REQUEST",
    )  # fmt: skip
    aws.stack({**PRICED, QUEUE_TABLE_OUTPUT: "trainium-queue"})
    nodes = aws.launch(2)
    launched = nodes[0]["LaunchTime"]
    stub = Stubber(aws.clients.stepfunctions)
    name = "first-20261122-030000"
    for _ in range(2):
        stub.add_response(
            "list_executions",
            {"executions": [{
                "executionArn": f"{MACHINE.replace('stateMachine', 'execution')}:{name}",
                "stateMachineArn": MACHINE, "name": name, "status": "SUCCEEDED",
                "startDate": launched - timedelta(hours=3),
                "stopDate": launched - timedelta(hours=1)}]},
            {"stateMachineArn": MACHINE, "maxResults": 1},
        )  # fmt: skip
    stub.activate()
    jobs = Jobs(aws.cluster())
    warning = jobs.idle_warning_now(now=launched + timedelta(hours=2))
    assert warning is not None and warning.startswith("warning: 2 nodes up with no job for 2h00m")
    aws.clients.dynamodb.put_item(
        TableName="trainium-queue",
        Item={"Pk": {"S": "queue"}, "Sk": {"S": "2026-11-22T05:00:00.000000Z#next"},
              "JobId": {"S": "next"}, "ExecutionName": {"S": "next-20261122-050000"},
              "Input": {"S": "{}"}, "SubmittedAt": {"S": "2026-11-22T05:00:00.000000Z"}},
    )  # fmt: skip
    assert jobs.idle_warning_now(now=launched + timedelta(hours=2)) is None
    stub.assert_no_pending_responses()
