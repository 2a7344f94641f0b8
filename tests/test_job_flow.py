"""The job flow of an engineer's day, end to end on the rehearsal's two nodes: two jobs queued
back to back with `train --detach`, the first the reference workload, the second a code
directory of its own. The first is killed on one node (the agent's cancel: SIGKILL to its
process group) and resumes from its checkpoint on the same nodes; the second then starts from
the queue, with nobody's terminal attached, and runs its own snapshot on both hosts. No node
is replaced between them: the cluster keeps its instances and the code travels with the job.
It is also the job queue's test on real nodes: the second job starts only once the first's last
execution has ended (the dispatcher, through EventBridge's rule), not at its hand-over.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.code import snapshot
from scripts.cluster_lib.executions import job_of
from tests.test_job_code import write_code
from tests.test_rehearsal import (
    HOLD_AT_5,
    Cli,
    execution_status,
    held,
    job_metrics,
    operations,
    sample_data,
    short_legs,
    stand_in,
    train_args,
    wait_for,
)

__all__ = ["operations", "sample_data", "short_legs"]  # fixtures of test_rehearsal, shared here


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_two_queued_jobs_the_first_resumed_after_a_kill_the_second_with_its_own_code(
    tmp_path: Path,
    sample_data: Path,
    operations: tuple[str, dict[str, Any]],
    capfd: pytest.CaptureFixture[str],
) -> None:
    from scripts.rehearsal.supervisor import local_supervisor

    cluster_name, template = operations
    tag = secrets.token_hex(3)  # job IDs of this test alone (processes are found by job ID)
    first, second = f"flow-ref-{tag}", f"flow-own-{tag}"
    code = write_code(tmp_path / "my-job")
    own = snapshot(code)
    output = tmp_path / "cluster"
    args = train_args(sample_data, "--max-steps", "20", "--checkpoint-every", "5",
                      "--eval-every", "20", "--log-every", "5")  # fmt: skip
    with (
        stand_in(output, cluster_name=cluster_name, node_settings=HOLD_AT_5) as cloud,
        local_supervisor(cloud, template),
    ):
        cloud.client("s3").put_object(
            Bucket=cloud.data_bucket, Key="lines/lines.txt", Body=b"one\ntwo\n"
        )
        instances = sorted(i.instance_id for i in cloud.running())
        common = ("--check-every", "1", "--retry-delay", "1", "--failure-grace", "5", "--detach")
        queued = [
            Cli(cloud, "train", "--job-id", first, "--max-retries", "1", *common, "--", *args),
            Cli(cloud, "train", "--job-id", second, "--code", str(code), "--entry",
                "allreduce.py", "--data", f"s3://{cloud.data_bucket}/lines", "--max-retries",
                "0", *common, "--", "--flag", "1"),
        ]  # fmt: skip
        for train in queued:
            train.run()
            assert train.code == 0, capfd.readouterr()

        # The first job trains and holds after step 5 (its checkpoint written); the second
        # waits in the queue meanwhile.
        held(output, first, 5, 600, capfd.readouterr)
        listing = Cli(cloud, "jobs")
        listing.run()
        rows = capfd.readouterr().out
        assert any(line.split()[:3] == [second, "QUEUED", "1"] for line in rows.splitlines()), rows
        assert execution_status(cloud, second) == []

        # Killed on one node: the agent's cancel of that node's invocation.
        (command,) = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        victim = cloud.running()[1]
        cloud.cancel(command.command_id, victim.instance_id)

        wait_for(
            "the second job's end",
            lambda: execution_status(cloud, second) not in ([], ["RUNNING"]),
            900,
            capfd.readouterr,
        )
        captured = capfd.readouterr()
        context = captured.out + captured.err
        client = cloud.client("stepfunctions")
        machine = cloud.stack_outputs()["JobStateMachineArn"]
        listed = sorted(
            client.list_executions(stateMachineArn=machine)["executions"],
            key=lambda e: e["startDate"],
        )
        # The first job: its first execution handed the retry over to a second one (the
        # history budget), which finished; then the second job, once.
        assert [(job_of(e["name"]), e["status"]) for e in listed] == [
            (first, "SUCCEEDED"),
            (first, "SUCCEEDED"),
            (second, "SUCCEEDED"),
        ], context
        assert listed[2]["startDate"] >= listed[1]["stopDate"]
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert [c.parameters["JobId"] for c in legs] == [[first], [first], [second]]
        assert legs[0].invocations[victim.instance_id].status()["status"] == "Cancelled"
        # The first resumed from its step-5 checkpoint on the same nodes and finished.
        assert [r["step"] for r in job_metrics(output, first, "resume")] == [5]
        assert max(r["step"] for r in job_metrics(output, first, "train")) == 20
        # The second ran its own snapshot on both hosts, across them.
        assert legs[2].parameters["CodeSnapshot"] == [own.sha256]
        assert legs[0].parameters["CodeSnapshot"] != [own.sha256]
        for rank in (0, 1):
            result = json.loads((output / "jobs" / second / f"rank-{rank}.json").read_text())
            assert (result["sum"], result["snapshot"]) == (3.0, own.sha256), result
        # No node was replaced between (or during) the jobs.
        assert sorted(i.instance_id for i in cloud.running()) == instances
        assert cloud.health_reports == []
