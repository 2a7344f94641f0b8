"""The job flow of an engineer's day, end to end on the rehearsal's two nodes: two jobs queued
back to back, the first the reference workload (its `train` left with Ctrl-C once the job is
queued), the second a code directory of its own (`train --detach`). The first is killed on one
node (the agent's cancel: SIGKILL to its process group) and resumes from its checkpoint on the
same nodes; the second then starts from the queue, with nobody's terminal attached, and runs its
own snapshot on both hosts. No node is replaced between them: the cluster keeps its instances
and the code travels with the job. It is also the job queue's test on real nodes: the second job
starts only once the first's last execution has ended (the dispatcher, through EventBridge's
rule), not at its hand-over; and the supervisor's retry of a cancelled node: the notifications,
the hand-over's counters and input, and one row for the job in `cluster.py jobs`.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.code import snapshot
from scripts.cluster_lib.documents import join_train_args
from scripts.cluster_lib.executions import EXECUTION_NAME, job_of
from scripts.rehearsal.supervisor import map_run_histories
from tests.test_job_code import write_code
from tests.test_rehearsal import (
    HOLD_AT_5,
    Cli,
    execution_status,
    gone,
    held,
    job_metrics,
    operations,
    sample_data,
    short_legs,
    stand_in,
    train_args,
    wait_for,
)
from tests.test_supervisor import Supervisor

__all__ = ["operations", "sample_data", "short_legs"]  # fixtures of test_rehearsal, shared here


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_two_queued_jobs_the_first_resumed_after_a_kill_the_second_with_its_own_code(
    tmp_path: Path,
    sample_data: Path,
    operations: tuple[str, dict[str, Any]],
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import scripts.cluster as cli
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
        local_supervisor(cloud, template) as arn,
        map_run_histories() as map_runs,
    ):
        supervisor = Supervisor(cloud, arn, map_runs)
        cloud.client("s3").put_object(
            Bucket=cloud.data_bucket, Key="lines/lines.txt", Body=b"one\ntwo\n"
        )
        instances = sorted(i.instance_id for i in cloud.running())
        common = ("--check-every", "1", "--retry-delay", "1", "--failure-grace", "5")
        # The first `train`'s operator presses Ctrl-C as soon as the job is queued: the CLI
        # detaches (exit 0), and nothing on this side follows the job any more.
        printed = cli.out

        def operator(message: str) -> None:
            printed(message)
            if f"job {first}: queued;" in message:
                raise KeyboardInterrupt

        monkeypatch.setattr(cli, "out", operator)
        train = Cli(cloud, "train", "--job-id", first, "--max-retries", "1", *common, "--",
                    *args)  # fmt: skip
        train.run()
        monkeypatch.setattr(cli, "out", printed)
        captured = capfd.readouterr()
        assert train.code == 0, captured.out + captured.err
        assert f"detached from job {first}; it goes on in AWS" in captured.out
        train = Cli(cloud, "train", "--job-id", second, "--code", str(code), "--entry",
                    "allreduce.py", "--data", f"s3://{cloud.data_bucket}/lines", "--max-retries",
                    "0", *common, "--detach", "--", "--flag", "1")  # fmt: skip
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
        # A job started outside the queue meanwhile is refused, and starts nothing queued.
        outside = supervisor.start("outside", queued=False, TrainArgs=join_train_args(args))
        assert supervisor.wait(outside, 300) == "FAILED"
        refusal = supervisor.describe(outside)
        assert refusal["error"] == "JobNotDispatched"
        assert "does not name job outside" in refusal["cause"], refusal["cause"]
        assert execution_status(cloud, second) == []

        # Killed on one node: the agent's cancel of that node's invocation.
        (command,) = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert command.parameters["JobId"] == [first]
        hosts = sorted(i.address for i in cloud.running())
        assert sorted(command.parameters["Hosts"][0].split(",")) == hosts
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
            (
                e
                for e in client.list_executions(stateMachineArn=machine)["executions"]
                if job_of(e["name"]) != "outside"
            ),
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
        invocation = legs[0].invocations[victim.instance_id].status()
        assert (invocation["status"], invocation["code"]) == ("Cancelled", 137)
        preflights = [c for c in cloud.commands.values() if c.document.endswith("Preflight")]
        assert len(preflights) == 3  # the first job's two attempts, the second job's one
        assert all(i.status()["status"] == "Success" for i in preflights[1].invocations.values())
        # The first job's retry went on in a new execution of the state machine (the history
        # budget), named as the CLI names executions, with the job's settings and counters.
        execution = next(e["executionArn"] for e in listed if job_of(e["name"]) == first)
        chain = supervisor.chain(execution)
        assert chain == [e["executionArn"] for e in listed[:2]], chain
        handed = supervisor.describe(chain[0])
        assert json.loads(handed["output"])["Counters"] == {"Retries": 1, "Legs": 1, "Attempts": 1}
        match = EXECUTION_NAME.match(chain[1].rsplit(":", 1)[-1])
        assert match and match["job"] == first, chain[1]
        successor = json.loads(supervisor.describe(chain[1])["input"])
        assert successor["ContinuedFrom"] == chain[0]
        assert (successor["JobId"], successor["MaxRetries"]) == (first, 1)
        assert successor["TrainArgs"] == join_train_args(args)
        entered = supervisor.entered(execution)
        assert entered.count("PreflightBatches") == 2 and entered.count("RunTrainingBatches") == 2
        assert "RunTrainingCancelRest" in entered or "RunTrainingGraceStarts" in entered
        # Told: the first job started, retries (naming the cancelled node and its command),
        # finished; then the second started and finished.
        subjects = [n["Subject"] for n in cloud.notifications]
        assert subjects == [
            *(f"{cluster_name}: job {first} {what}" for what in ("started", "retries", "finished")),
            *(f"{cluster_name}: job {second} {what}" for what in ("started", "finished")),
        ], subjects
        retry = cloud.notifications[1]["Message"]
        assert "retry 1 of 1" in retry and command.command_id in retry, retry
        assert f"{victim.instance_id}: RunTraining ended Cancelled" in retry, retry
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
        assert gone(first) and gone(second), "a process of a job outlived it"

        capfd.readouterr()
        jobs = Cli(cloud, "jobs")
        jobs.run()
        captured = capfd.readouterr()
        assert jobs.code == 0, captured.err
        # One row for the first job, though its retry ran in the execution the first handed it
        # to: job, status, date, time, duration, attempts, retries, legs, step, rate, eta, then
        # the job's metrics (rank 0's metrics file, shipped to <instance-id>/metrics).
        (row,) = [line for line in captured.out.splitlines() if line.startswith(first)]
        fields = row.split()
        assert fields[1] == "SUCCEEDED" and fields[5:9] == ["2", "1", "1", "20/20"], row
        assert fields[10] == "done", row
        assert any(f.startswith("eval_accuracy=") for f in fields[11:]), row
