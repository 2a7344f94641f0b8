"""The job queue through the operator CLI (`cluster.py train`, `jobs`, `stop`, its own main
and clients): the synthesized dispatcher and the supervisor's synthesized start run in moto's
ASL interpreter against moto's DynamoDB, EventBridge's rule emulated from the template
(tests/test_stacks_queue.py builds them). The CloudFormation outputs and the instance refreshes
the CLI reads first are answered here, checked against botocore's output shapes.

A job whose train arguments hold `--hold` runs until its execution is stopped; any other
finishes at once (where the real supervisor would wait for nodes). Two queued jobs through the
real supervisor on two rehearsal nodes: tests/test_job_flow.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import scripts.cluster as cli
from scripts.cluster_lib.queue import DISPATCHER_OUTPUT, QUEUE_TABLE_OUTPUT
from scripts.rehearsal.aws_stand_in import validate_answer
from tests.cdk_support import Synth, synth
from tests.cluster_support import OUTPUTS, capture
from tests.test_stacks_queue import Cluster, queue_cluster


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


@pytest.fixture
def cluster(default: Synth) -> Iterator[Cluster]:
    with queue_cluster(default) as found:
        outputs = {
            **OUTPUTS,
            "JobStateMachineArn": found.supervisor,
            QUEUE_TABLE_OUTPUT: found.local.table,
            DISPATCHER_OUTPUT: found.local.dispatcher,
        }
        answers = {
            "DescribeStacks": {
                "Stacks": [{
                    "StackName": "trainium-operations", "StackStatus": "CREATE_COMPLETE",
                    "CreationTime": "2026-11-26T00:00:00Z",
                    "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()],
                }]
            },
            "DescribeInstanceRefreshes": {"InstanceRefreshes": []},
        }  # fmt: skip

        def answer(model: Any, **_: Any) -> Any:
            if model.name not in answers:
                return None  # moto's
            from botocore.awsrequest import AWSResponse

            body = {**answers[model.name]}
            validate_answer(model, body)
            body["ResponseMetadata"] = {"HTTPStatusCode": 200, "HTTPHeaders": {}}
            return AWSResponse("https://test.local", 200, {}, None), body

        # The cluster's data bucket, where `train` uploads the job's code snapshot (code.py).
        s3 = found.session.client("s3")
        region = s3.meta.region_name
        s3.create_bucket(
            Bucket=outputs["DataBucketName"],
            **({} if region == "us-east-1" else {
                "CreateBucketConfiguration": {"LocationConstraint": region}}),
        )  # fmt: skip
        found.session.events.register("before-call.cloudformation.*", answer)
        found.session.events.register("before-call.autoscaling.*", answer)
        yield found


def run(cluster: Cluster, *argv: str) -> tuple[int, list[str]]:
    """`cluster.py <argv>` against the cluster; its exit status and what it printed."""
    printed, restore = capture(cli)
    try:
        command, *rest = argv
        code = cli.main(
            [command, "--cluster-name", "trainium", "--poll-interval", "0.2", *rest],
            session=cluster.session,
        )
    finally:
        restore()
    return code, printed


def train(cluster: Cluster, job_id: str, *args: str, detach: bool = True) -> tuple[int, list[str]]:
    options = ["--detach"] if detach else []
    return run(cluster, "train", "--job-id", job_id, *options, "--", "--max-steps", "5", *args)


def test_jobs_submitted_back_to_back_run_one_after_the_other_without_the_terminal(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two `train --detach` in a row both return at once; the second is queued behind the
    first, `jobs` shows it with its position above the running one, and when the first ends
    (its supervisor stopped: ABORTED) the second starts and finishes with no CLI running."""
    code, printed = train(cluster, "t1-first", "--hold")
    assert code == 0, capsys.readouterr()
    code, printed = train(cluster, "t1-second")
    assert code == 0, capsys.readouterr()
    cluster.settled()
    assert cluster.started() == ["t1-first"]

    code, printed = run(cluster, "jobs")
    assert code == 0
    rows = [line.split() for line in printed[1:] if not line.startswith(" ")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("t1-second", "QUEUED", "1"),
        ("t1-first", "RUNNING", rows[1][2]),
    ], printed

    cluster.stop("t1-first")
    cluster.settled()
    assert cluster.started() == ["t1-first", "t1-second"]
    assert cluster.execution("t1-second")["status"] == "SUCCEEDED"
    assert cluster.queue.queued() == []


def test_a_job_id_queued_or_running_already_is_refused_in_one_line(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train(cluster, "t2-first", "--hold")[0] == 0
    assert train(cluster, "t2-second")[0] == 0
    cluster.settled()
    capsys.readouterr()
    assert train(cluster, "t2-second")[0] == 1
    assert capsys.readouterr().err == (
        "error: job t2-second is queued already (position 1): follow it with `cluster.py "
        "jobs`, or take it off with `cluster.py stop --job-id t2-second`\n"
    )
    assert train(cluster, "t2-first")[0] == 1
    error = capsys.readouterr().err
    assert error.startswith("error: job t2-first runs already (execution t2-first-"), error
    assert error.count("\n") == 1
    assert [q.job_id for q in cluster.queue.queued()] == ["t2-second"]


def test_stop_takes_a_queued_job_off_the_queue_and_it_never_runs(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert train(cluster, "t3-first", "--hold")[0] == 0
    assert train(cluster, "t3-second")[0] == 0
    assert train(cluster, "t3-third")[0] == 0
    cluster.settled()
    code, printed = run(cluster, "stop", "--job-id", "t3-second")
    assert code == 0, capsys.readouterr()
    assert printed == ["job t3-second: taken off the queue; it never ran"]
    cluster.stop("t3-first")
    cluster.settled()
    assert cluster.started() == ["t3-first", "t3-third"]


def test_train_says_the_position_while_its_job_waits_then_follows_it(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    """`train` without --detach prints the job's position while it waits, follows it once it
    starts and exits 0 when it finished."""
    assert train(cluster, "t4-first", "--hold")[0] == 0
    cluster.settled()
    result: list[tuple[int, list[str]]] = []
    follower = threading.Thread(
        target=lambda: result.append(train(cluster, "t4-second", detach=False)), daemon=True
    )
    follower.start()
    # The job is queued once it is listed; the follower prints its position from then on.
    cluster.local.rule.settled()
    while not cluster.queue.queued():
        follower.join(0.1)
    cluster.stop("t4-first")
    follower.join(120)
    assert not follower.is_alive()
    ((code, printed),) = result
    assert code == 0, (printed, capsys.readouterr())
    assert "job t4-second: queued at position 1" in printed
    assert "job t4-second finished (execution t4-second-" in printed[-1], printed
