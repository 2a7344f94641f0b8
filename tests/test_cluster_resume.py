"""`train --resume JOB` resumes a job; `train --job-id JOB` is a new job, refused in one line
when JOB ran on this cluster before (its executions: ListExecutions, answered through a
botocore Stubber, which checks the answer against botocore's Step Functions model)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

import pytest
from botocore.stub import Stubber

from scripts import cluster as cli
from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.jobs import Jobs
from tests.cluster_support import OUTPUTS

MACHINE = "arn:aws:states:us-east-1:123456789012:stateMachine:trainium-jobs"


def executions(*names: str) -> dict[str, Any]:
    return {
        "executions": [
            {
                "executionArn": f"{MACHINE.replace('stateMachine', 'execution')}:{name}",
                "stateMachineArn": MACHINE,
                "name": name,
                "status": "SUCCEEDED",
                "startDate": datetime(2026, 11, 20, 10, 10, tzinfo=UTC),
            }
            for name in names
        ]
    }


def train_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["train", *argv])


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `train` would start the supervisor's execution with (Jobs.start's arguments)."""
    seen: dict[str, Any] = {}

    def start(self: Jobs, job_id: str, *_: Any, **kwargs: Any) -> str:
        seen.update(kwargs, job_id=job_id)
        return "arn"

    monkeypatch.setattr(Jobs, "poll_seconds", lambda self, requested: 300)
    monkeypatch.setattr(Jobs, "start", start)
    monkeypatch.setattr(Jobs, "run", lambda self, *a, **k: None)
    # The job's code snapshot and data (tests/test_code_snapshot.py) are not what is tested here.
    monkeypatch.setattr(cli, "job_inputs", lambda cluster, args: None)
    return seen


def test_a_new_job_with_a_used_id_is_refused_in_one_line(aws: Any, started: dict) -> None:
    aws.stack({**OUTPUTS, "JobStateMachineArn": MACHINE})
    with Stubber(aws.clients.stepfunctions) as sfn:
        sfn.add_response(
            "list_executions",
            executions("other-20261121-000000", "bert-1-20261120-101010"),
            {"stateMachineArn": MACHINE},
        )
        with pytest.raises(ClusterError) as refused:
            cli.cmd_train(aws.cluster(), train_args("--job-id", "bert-1"), [])
    assert str(refused.value) == (
        "job bert-1 ran on this cluster before (execution bert-1-20261120-101010, started "
        "2026-11-20 10:10 UTC): resume it with `trainium-cluster train --resume bert-1`, or "
        "choose another --job-id"
    )
    assert not started


def test_a_new_job_id_starts_a_new_job(aws: Any, started: dict) -> None:
    aws.stack({**OUTPUTS, "JobStateMachineArn": MACHINE})
    with Stubber(aws.clients.stepfunctions) as sfn:
        sfn.add_response(
            "list_executions", executions("bert-10-20261120-101010"), {"stateMachineArn": MACHINE}
        )
        assert cli.cmd_train(aws.cluster(), train_args("--job-id", "bert-1"), []) == 0
    assert started["job_id"] == "bert-1" and started["options"]["Resume"] == "new"


def test_resume_resumes_the_job_without_looking_for_it(aws: Any, started: dict) -> None:
    """The supervisor's first attempt then passes Resume `resume` to RunTraining
    (tests/test_supervisor_resume.py); launch.sh starts at step 0 and says so when there is no
    checkpoint. No ListExecutions: a Stubber with no answers fails any call."""
    with Stubber(aws.clients.stepfunctions):
        assert cli.cmd_train(aws.cluster(), train_args("--resume", "bert-1"), []) == 0
    assert started["job_id"] == "bert-1" and started["options"]["Resume"] == "resume"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--job-id", "a", "--resume", "a"],
         "give --job-id ID for a new job or --resume ID to resume one, not both"),
        (["--resume", "bad id"], "--resume 'bad id' is not allowed: use 1-64 letters"),
    ],
)  # fmt: skip
def test_bad_resume_input_is_refused_before_any_aws_call(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
