"""The operator CLI against a simulated AWS (tests/cluster_support.py): moto for EC2,
botocore Stubbers for CloudFormation, SSM, CloudWatch Logs, Auto Scaling and FSx."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from botocore.stub import ANY

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.jobs import Jobs
from tests.cluster_support import (
    INPUTS,
    OUTPUTS,
    REGION,
    SOFTWARE,
    FakeAws,
    capture,
    hosts,
    printed_logs,
    run_training,
    train_parameters,
)

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_preflight_then_the_job_on_all_nodes_in_address_order(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    aws.preflight_passes(nodes)
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.poll(job, nodes, ["InProgress", "InProgress"])
    aws.all_succeed(job, nodes)
    cluster = aws.cluster()

    assert cluster.preflight().ok
    result = run_training(cluster)

    assert result.ok
    aws.verify()
    assert [inv.node.address for inv in result.invocations] == [
        n["PrivateIpAddress"] for n in nodes
    ]
    assert f"preflight on 2 nodes, master {nodes[0]['PrivateIpAddress']}" in aws.lines
    assert f"RunTraining: command {job} sent to 2 nodes" in aws.lines


def test_run_streams_the_master_nodes_output(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.all_succeed(job, nodes)
    # The job's output is in the node's job-log stream (the CloudWatch agent's), from the
    # command's time on; the command's own output holds only launch.sh's lines.
    stream = f"{nodes[0]['InstanceId']}/jobs"
    expected = {"logGroupName": OUTPUTS["TrainingLogGroupName"], "logStreamName": stream,
                "startTime": ANY, "startFromHead": True}  # fmt: skip
    for token, message, after in (("t1", "step 10 loss 0.69", {}),
                                  ("t2", "step 20 loss 0.41", {"nextToken": "t1"})):  # fmt: skip
        aws.stubs["logs"].add_response(
            "get_log_events",
            {"events": [{"timestamp": 0, "message": message}], "nextForwardToken": token},
            {**expected, **after},
        )

    assert run_training(aws.cluster(), stream_rank=0).ok

    aws.verify()
    assert "  | step 10 loss 0.69" in aws.lines
    assert "  | step 20 loss 0.41" in aws.lines


def test_a_failing_node_is_reported_with_the_tail_of_its_output_and_the_rest_cancelled(
    aws: FakeAws,
) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.poll(job, nodes, ["InProgress", ("Failed", 1)])
    # The survivor keeps running through the 30 s grace period (5 s polls), then is cancelled.
    for _ in range(6):
        aws.poll(job, nodes, ["InProgress", ("Failed", 1)])
    aws.stubs["ssm"].add_response(
        "cancel_command", {}, {"CommandId": job, "InstanceIds": [nodes[0]["InstanceId"]]}
    )
    aws.poll(job, nodes, [("Cancelled", -1), ("Failed", 1)])
    aws.log_tail(job, nodes[1], ["step 40 loss 0.52", "RuntimeError: Connection reset by peer"])

    result = run_training(aws.cluster())

    assert not result.ok
    message = result.summary()
    first_line = message.splitlines()[0]
    assert first_line.startswith(
        f"RunTraining failed on node 1 ({nodes[1]['PrivateIpAddress']}, "
        f"{nodes[1]['InstanceId']}): Failed (exit status 1)"
    )
    assert "also ended on node 0" in first_line
    assert message.splitlines()[-1] == "RuntimeError: Connection reset by peer"
    aws.verify()


def test_stack_not_deployed(aws: FakeAws) -> None:
    aws.stubs["cloudformation"].add_client_error(
        "describe_stacks", service_error_code="ValidationError",
        service_message="Stack with id trainium-operations does not exist", http_status_code=400,
    )  # fmt: skip
    with pytest.raises(
        ClusterError, match=r"^stack trainium-operations is not deployed .*cdk deploy"
    ):
        aws.cluster().outputs()


def test_stack_still_deploying_or_missing_outputs(aws: FakeAws) -> None:
    aws.stack(status="CREATE_IN_PROGRESS")
    with pytest.raises(ClusterError, match="is in state CREATE_IN_PROGRESS"):
        aws.cluster().outputs()
    aws.stack(outputs={k: v for k, v in OUTPUTS.items() if k != "RunTrainingDocumentName"})
    with pytest.raises(ClusterError, match="lacks the outputs RunTrainingDocumentName"):
        aws.cluster().outputs()


def test_expired_credentials_get_one_line(aws: FakeAws) -> None:
    aws.stubs["cloudformation"].add_client_error(
        "describe_stacks", service_error_code="ExpiredToken",
        service_message="The security token included in the request is expired",
    )  # fmt: skip
    with pytest.raises(ClusterError, match=r"^AWS rejected the credentials \(ExpiredToken"):
        aws.cluster().outputs()


def test_fewer_nodes_than_expected(aws: FakeAws) -> None:
    nodes = aws.launch(1)
    aws.stack()
    # Polled every 5 s for the 60 s wait timeout.
    for _ in range(13):
        aws.online(nodes)
    with pytest.raises(ClusterError) as error:
        aws.cluster().wait_for_nodes()
    assert str(error.value) == (
        "only 1 of 2 nodes are running: check the activity of Auto Scaling group "
        "trainium-workers (capacity, quotas)"
    )
    aws.verify()
    assert aws.lines == [f"waiting: {error.value}"]


def test_stopped_instances_do_not_count(aws: FakeAws) -> None:
    aws.launch(1)
    aws.launch(1, state="stopped")
    aws.stack()
    nodes, starting = aws.cluster().running_nodes()
    assert len(nodes) == 1
    assert starting == 0


def test_a_node_not_managed_by_ssm(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    for _ in range(13):
        aws.online(nodes, {nodes[1]["InstanceId"]: "absent"})
    with pytest.raises(ClusterError) as error:
        aws.cluster().wait_for_nodes()
    assert str(error.value) == (
        f"node {nodes[1]['InstanceId']} ({nodes[1]['PrivateIpAddress']}) is not managed by SSM "
        "(ping status: not registered): check the SSM agent and the instance profile"
    )


def test_nodes_are_awaited_until_ssm_reports_them_online(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes, {nodes[0]["InstanceId"]: "ConnectionLost"})
    aws.online(nodes)
    found = aws.cluster().wait_for_nodes()
    assert [n.instance_id for n in found] == [i["InstanceId"] for i in nodes]
    assert aws.time.slept == [5]


@pytest.mark.parametrize(
    ("job_id", "args", "message"),
    [
        ("bert 1", [], r"--job-id 'bert 1' is not allowed"),
        ("bert-1", ["--data", "/fsx/data;reboot"], r"train arguments .* is not allowed"),
        ("bert-1", ["--data", "$(reboot)"], r"train arguments .* is not allowed"),
        ("bert-1", ["--name", "a b"], r"train argument 'a b' is empty or contains whitespace"),
    ],
)
def test_bad_parameters_are_refused_before_any_aws_call(
    aws: FakeAws, job_id: str, args: list[str], message: str
) -> None:
    with pytest.raises(ClusterError, match=message):
        Jobs(aws.cluster()).start(job_id, args, INPUTS)
    aws.verify()


def test_stop_runs_on_the_online_nodes(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes, {nodes[1]["InstanceId"]: "ConnectionLost"})
    command = aws.send("StopTraining", nodes[:1], {"JobId": "bert-1"})
    aws.all_succeed(command, nodes[:1])
    aws.running_commands([], [])
    assert aws.cluster().stop("bert-1").ok
    aws.verify()


def test_precompile_sends_steps_and_train_args(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    parameters = {
        "Hosts": hosts(nodes), "JobId": "bert-1", "MasterPort": "29500", "NprocPerNode": "auto",
        "Steps": "5", **INPUTS.parameters(), "TrainArgs": "--model tiny",
    }  # fmt: skip
    aws.all_succeed(aws.send("Precompile", nodes, parameters), nodes)
    assert aws.cluster().precompile("bert-1", ["--model", "tiny"], INPUTS, steps="5").ok
    aws.verify()


def test_warm_spares_are_awaited_with_the_nodes_and_precompile_traces_the_jobs_world(
    aws: FakeAws,
) -> None:
    """With spare_nodes=1 the group runs node_count + 1 nodes: the CLI waits for all 3 (not
    "3 nodes are running but the cluster has 2"), and Precompile traces on node_count of them,
    the world size of the job the supervisor runs on them (JoinHosts)."""
    nodes = aws.launch(3)
    aws.stack({**OUTPUTS, "SpareNodes": "1"})
    aws.online(nodes)
    cluster = aws.cluster()
    found = cluster.wait_for_nodes()
    assert [n.instance_id for n in found] == [i["InstanceId"] for i in nodes]
    aws.online(nodes)
    parameters = {
        "Hosts": hosts(nodes[:2]), "JobId": "bert-1", "MasterPort": "29500",
        "NprocPerNode": "auto", "Steps": "5", **INPUTS.parameters(), "TrainArgs": "--model tiny",
    }  # fmt: skip
    aws.all_succeed(aws.send("Precompile", nodes[:2], parameters), nodes[:2])
    assert cluster.precompile("bert-1", ["--model", "tiny"], INPUTS, steps="5").ok
    aws.verify()
    assert aws.time.slept == []


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "cluster.py"), *args],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip


def no_credentials_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
        AWS_EC2_METADATA_DISABLED="true",
    )  # fmt: skip
    return env


def test_cli_without_credentials_prints_one_line(tmp_path: Path) -> None:
    result = run_cli("status", "--region", REGION, env=no_credentials_env(tmp_path))
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        "error: no AWS credentials found: run `aws configure`, pass --profile, or set "
        "AWS_PROFILE / AWS_ACCESS_KEY_ID\n"
    )


def test_cli_without_region_and_with_unknown_profile(tmp_path: Path) -> None:
    env = no_credentials_env(tmp_path)
    result = run_cli("train", "--job-id", "x", "--", "--model", "tiny", env=env)
    assert (result.returncode, result.stderr) == (
        1,
        "error: no AWS region configured: pass --region or set AWS_REGION\n",
    )
    result = run_cli("--profile", "nope", "status", env=env)
    assert (result.returncode, result.stderr) == (
        1,
        "error: AWS profile 'nope' not found in the AWS config\n",
    )


def test_cli_rejects_train_args_for_commands_that_take_none() -> None:
    result = run_cli("status", "--", "--lr", "1")
    assert result.returncode == 2
    assert "status takes no train.py arguments after --" in result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--check-every", "0"], "--check-every 0 is not allowed: use 1 to 3600"),
        (["train", "--check-every", "3601"], "--check-every 3601 is not allowed: use 1 to 3600"),
        (["train", "--failure-grace", "-1"], "--failure-grace -1 is not allowed: use 0 to 86400"),
        (
            ["train", "--hang-minutes", "0"],
            "--hang-minutes 0 is not allowed: use 1 to 2880 (a leg lasts 48 hours)",
        ),
        (
            ["train", "--compile-hang-minutes", "2881"],
            "--compile-hang-minutes 2881 is not allowed: use 1 to 2880 (a leg lasts 48 hours)",
        ),
        (["jobs", "--limit", "0"], "--limit 0 is not allowed: use 1 to 1000"),
    ],
)
def test_the_supervisors_settings_out_of_range_are_refused_before_any_aws_call(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from scripts import cluster as cli

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("the CLI reached AWS")

    monkeypatch.setattr(cli, "make_cluster", refuse)
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"error: {message}\n")


def test_status_lists_nodes_with_their_ami_and_template_version_and_recent_commands(
    aws: FakeAws,
) -> None:
    from scripts import cluster as cli

    template = aws.clients.ec2.create_launch_template(
        LaunchTemplateName="trainium-nodes", LaunchTemplateData={"ImageId": "ami-12c6146b"}
    )["LaunchTemplate"]
    for _ in range(2):
        aws.clients.ec2.create_launch_template_version(
            LaunchTemplateId=template["LaunchTemplateId"],
            LaunchTemplateData={"ImageId": "ami-0fedcba9876543210"},
        )
    old = aws.launch(1, version="2")
    new = aws.launch(1, version="3")
    nodes = sorted(old + new, key=lambda i: tuple(map(int, i["PrivateIpAddress"].split("."))))
    aws.stack()
    aws.stubs["autoscaling"].add_response(
        "describe_auto_scaling_groups",
        {"AutoScalingGroups": [{
            "AutoScalingGroupName": "trainium-workers", "MinSize": 2, "MaxSize": 2,
            "DesiredCapacity": 2, "DefaultCooldown": 300, "AvailabilityZones": ["us-east-1a"],
            "HealthCheckType": "EC2", "CreatedTime": datetime(2026, 1, 1, tzinfo=UTC),
            "LaunchTemplate": {"LaunchTemplateId": template["LaunchTemplateId"], "Version": "3"},
        }]},
        {"AutoScalingGroupNames": ["trainium-workers"]},
    )  # fmt: skip
    aws.online(nodes, {nodes[1]["InstanceId"]: "ConnectionLost"})
    # The latest preflight's output names node 0's software; node 1 was not in it.
    check = "00000000-0000-4000-8000-000000000009"
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [{"CommandId": check, "Comment": "trainium preflight",
                       "RequestedDateTime": datetime(2026, 5, 1, 12, 0, tzinfo=UTC)}]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["PreflightDocumentName"]}],
         "MaxResults": 10},
    )  # fmt: skip
    aws.stubs["ssm"].add_response(
        "list_command_invocations",
        {"CommandInvocations": [{
            "CommandId": check, "InstanceId": nodes[0]["InstanceId"], "Status": "Success",
            "CommandPlugins": [{"Name": "Preflight", "Output": "ok\n" + SOFTWARE + "\n"}],
        }]},
        {"CommandId": check, "Details": True},
    )  # fmt: skip
    aws.no_refresh()
    when = datetime(2026, 5, 1, 12, 30, tzinfo=UTC)
    for name in ("RunTraining", "Preflight", "Precompile", "StopTraining"):
        commands = []
        if name == "RunTraining":
            commands = [{"CommandId": "0" * 8 + "-0000-4000-8000-000000000001",
                         "RequestedDateTime": when, "Status": "InProgress",
                         "Parameters": {"JobId": ["bert-1"]}}]  # fmt: skip
        aws.stubs["ssm"].add_response(
            "list_commands", {"Commands": commands},
            {"Filters": [{"key": "DocumentName", "value": OUTPUTS[f"{name}DocumentName"]}],
             "MaxResults": 8},
        )  # fmt: skip
    printed, restore = capture(cli)
    try:
        assert cli.cmd_status(aws.cluster()) == 0
    finally:
        restore()
    aws.verify()
    assert printed[0] == "cluster trainium (stack trainium-operations): 2 x trn1.32xlarge"
    assert printed[1] == (
        f"launch template {template['LaunchTemplateId']}: current version 3, "
        "AMI ami-0fedcba9876543210"
    )
    assert printed[2] == "nodes: 2 running of 2, 0 starting"
    rows = {row.split()[1]: row for row in printed[3:5]}
    assert "ssm Online" in rows[nodes[0]["InstanceId"]]
    assert "ssm ConnectionLost" in rows[nodes[1]["InstanceId"]]
    for node in nodes:
        assert "ami-12c6146b" in rows[node["InstanceId"]]
    # Both nodes run the old AMI; the first also an old template version.
    assert "template v2" in rows[old[0]["InstanceId"]]
    assert "template v3" in rows[new[0]["InstanceId"]]
    assert all(row.endswith("(older launch template)") for row in rows.values())
    assert "software 0123456789abcdef" in rows[nodes[0]["InstanceId"]]
    assert "software ?" in rows[nodes[1]["InstanceId"]]
    assert printed[5] == (
        "2 of 2 nodes do not run launch template version 3: roll the fleet with "
        "`cluster.py roll` when no job runs"
    )
    assert printed[6] == "recent commands:"
    assert printed[7].split() == [
        "2026-05-01", "12:30", "RunTraining", "bert-1", "InProgress",
        "00000000-0000-4000-8000-000000000001",
    ]  # fmt: skip


def test_logs_print_the_latest_run_of_a_job(aws: FakeAws) -> None:
    """A job's output is its node's job-log stream (`<instance-id>/jobs`, the CloudWatch
    agent's, from launch.sh's files), over the time of the job's latest command: from its
    RequestedDateTime up to the next job's command on the cluster."""

    nodes = aws.launch(2)
    aws.stack()
    latest = "00000000-0000-4000-8000-000000000007"
    ids = [n["InstanceId"] for n in nodes]
    sent, after = datetime(2026, 5, 1, 12, 0, tzinfo=UTC), datetime(2026, 5, 1, 13, 0, tzinfo=UTC)
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [
            {"CommandId": latest[:-1] + "8", "Parameters": {"JobId": ["other"]},
             "RequestedDateTime": after, "InstanceIds": ids},
            {"CommandId": latest, "Parameters": {"JobId": ["bert-1"]},
             "RequestedDateTime": sent, "InstanceIds": ids},
        ]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]}]},
    )  # fmt: skip
    aws.stubs["logs"].add_response(
        "get_log_events",
        {"events": [{"timestamp": 1777638600000, "message": "step 10 loss 0.5\nstep 20 loss 0.4"}],
         "nextForwardToken": "f/1"},
        {"logGroupName": OUTPUTS["TrainingLogGroupName"], "logStreamName": f"{ids[1]}/jobs",
         "startTime": int(sent.timestamp() * 1000), "endTime": int(after.timestamp() * 1000),
         "startFromHead": False, "limit": 2},
    )  # fmt: skip
    printed = printed_logs(
        aws.cluster(),
        job_id="bert-1", command_id=None, node="1", lines=2, follow=False, poll_interval=1,
    )  # fmt: skip
    aws.verify()
    assert printed == [
        f"{nodes[1]['InstanceId']} 12:30:00 step 10 loss 0.5",
        f"{nodes[1]['InstanceId']} 12:30:00 step 20 loss 0.4",
    ]


def test_logs_of_a_preflight_command_are_the_agents_output(aws: FakeAws) -> None:
    """Commands but RunTraining and Precompile keep their output in the SSM agent's streams."""
    nodes = aws.launch(1)
    aws.stack({**OUTPUTS, "NodeCount": "1"})
    check = "00000000-0000-4000-8000-000000000009"
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [{"CommandId": check, "DocumentName": OUTPUTS["PreflightDocumentName"],
                       "RequestedDateTime": datetime(2026, 5, 1, 12, tzinfo=UTC)}]},
        {"CommandId": check},
    )  # fmt: skip
    stream = f"{check}/{nodes[0]['InstanceId']}/Preflight/stdout"
    aws.stubs["logs"].add_response(
        "describe_log_streams", {"logStreams": [{"logStreamName": stream}]},
        {"logGroupName": OUTPUTS["TrainingLogGroupName"], "logStreamNamePrefix": f"{check}/"},
    )  # fmt: skip
    aws.stubs["logs"].add_response(
        "get_log_events",
        {"events": [{"timestamp": 1777638600000, "message": "[preflight] checks passed"}],
         "nextForwardToken": "f/1"},
        {"logGroupName": OUTPUTS["TrainingLogGroupName"], "logStreamName": stream,
         "startFromHead": False, "limit": 5},
    )  # fmt: skip
    printed = printed_logs(
        aws.cluster(),
        job_id=None, command_id=check, node=None, lines=5, follow=False, poll_interval=1,
    )  # fmt: skip
    aws.verify()
    assert printed == [f"{nodes[0]['InstanceId']} 12:30:00 [preflight] checks passed"]


@pytest.mark.parametrize(
    "error",
    [
        "EndpointConnectionError",
        "ReadTimeoutError",
        "ConnectTimeoutError",
        "UnauthorizedSSOTokenError",
        "TokenRetrievalError",
        "ThrottlingException",
    ],
)
def test_following_rides_out_transient_errors(aws: FakeAws, error: str) -> None:
    """Throttling beyond botocore's retries, time-outs and an expired SSO session (renewed
    with `aws sso login` while the CLI waits) do not end the follow."""
    from botocore import exceptions

    nodes = aws.launch(1)
    aws.stack({**OUTPUTS, "NodeCount": "1"})
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.poll(job, nodes, ["InProgress"])
    if error == "ThrottlingException":
        aws.stubs["ssm"].add_client_error(
            "list_command_invocations", service_error_code=error, http_status_code=400
        )
    else:
        url = "https://ssm.us-east-1.amazonaws.com"
        exception = {
            "EndpointConnectionError": lambda: exceptions.EndpointConnectionError(endpoint_url=url),
            "ReadTimeoutError": lambda: exceptions.ReadTimeoutError(endpoint_url=url),
            "ConnectTimeoutError": lambda: exceptions.ConnectTimeoutError(endpoint_url=url),
            "UnauthorizedSSOTokenError": exceptions.UnauthorizedSSOTokenError,
            "TokenRetrievalError": lambda: exceptions.TokenRetrievalError(
                provider="sso", error_msg="Token has expired and refresh failed"
            ),
        }[error]()
        # The first poll answers InProgress, the second raises, the third answers again.
        calls: list[int] = []

        def handler() -> None:
            calls.append(1)
            if len(calls) == 2:
                raise exception

        aws.intercept("ssm", "ListCommandInvocations", handler)
    aws.all_succeed(job, nodes)

    assert run_training(aws.cluster()).ok
    aws.verify()
    trouble = [line for line in aws.lines if "trying again for up to 1800 s" in line]
    assert len(trouble) == 1
    if "SSO" in error or "Token" in error:
        assert "run `aws sso login`" in trouble[0]
    assert "AWS answers again" in aws.lines


def test_following_gives_up_after_a_bounded_outage_with_a_clear_message(aws: FakeAws) -> None:
    from botocore.exceptions import UnauthorizedSSOTokenError

    nodes = aws.launch(1)
    aws.stack({**OUTPUTS, "NodeCount": "1"})
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    # The Stubber checks each call's parameters against its next answer before the
    # interception raises, so one answer waits there, never taken.
    aws.poll(job, nodes, ["InProgress"])

    def expired() -> None:
        raise UnauthorizedSSOTokenError()

    aws.intercept("ssm", "ListCommandInvocations", expired)
    with pytest.raises(ClusterError) as error:
        run_training(aws.cluster(give_up_after=60))
    assert str(error.value) == (
        "gave up following the command after 60 s of AWS errors (last: the AWS SSO session has "
        f"expired: run `aws sso login` to renew it); command {job} keeps running on the nodes: "
        "see `cluster.py status`"
    )
    # Polled every 5 s until the 60 s were up.
    assert aws.time.now == 60


def test_an_error_that_will_not_pass_ends_the_follow_at_once(aws: FakeAws) -> None:
    nodes = aws.launch(1)
    aws.stack({**OUTPUTS, "NodeCount": "1"})
    aws.online(nodes)
    aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.stubs["ssm"].add_client_error(
        "list_command_invocations", service_error_code="AccessDeniedException",
        service_message="not allowed", http_status_code=400,
    )  # fmt: skip
    with pytest.raises(ClusterError, match=r"^access denied while following the command"):
        run_training(aws.cluster())
    assert aws.time.now == 0


def test_waiting_for_nodes_rides_out_throttling(aws: FakeAws) -> None:
    """A spell of throttling while the CLI lists the nodes does not end its wait."""
    from botocore.exceptions import ClientError

    nodes = aws.launch(2)
    aws.stack()
    calls: list[int] = []

    def throttled_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise ClientError(
                {"Error": {"Code": "RequestLimitExceeded", "Message": "Request limit exceeded."}},
                "DescribeInstances",
            )

    aws.intercept("ec2", "DescribeInstances", throttled_once)
    aws.online(nodes)

    found = aws.cluster().wait_for_nodes()

    assert [n.instance_id for n in found] == [i["InstanceId"] for i in nodes]
    aws.verify()
    assert len(calls) == 2
    assert [line for line in aws.lines if "trying again" in line] == [
        "AWS is throttling or unavailable (RequestLimitExceeded) while listing the nodes; "
        "trying again for up to 1800 s",
    ]


def test_logs_of_many_nodes_read_their_streams_in_turn_within_the_logs_rate(
    aws: FakeAws,
) -> None:
    """CloudWatch Logs allows about 10 GetLogEvents a second (stacks/api_rates.py): a poll
    reads at most half of what --poll-interval allows (5 streams a second here), the streams
    in turn, and a one-shot `logs` goes on until every node's stream was read once. On 1,024
    nodes a poll used to read all 1,024 streams, ten times the rate every 10 s."""

    nodes = aws.launch(12)
    aws.stack({**OUTPUTS, "NodeCount": "12"})
    ids = [n["InstanceId"] for n in nodes]
    command = "00000000-0000-4000-8000-000000000007"
    sent = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [{"CommandId": command, "Parameters": {"JobId": ["bert-1"]},
                       "RequestedDateTime": sent, "InstanceIds": ids}]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]}]},
    )  # fmt: skip
    for instance_id in ids:
        aws.stubs["logs"].add_response(
            "get_log_events",
            {"events": [{"timestamp": 1777638600000, "message": f"on {instance_id}"}],
             "nextForwardToken": "f/1"},
            {"logGroupName": OUTPUTS["TrainingLogGroupName"],
             "logStreamName": f"{instance_id}/jobs", "startTime": int(sent.timestamp() * 1000),
             "startFromHead": False, "limit": 1},
        )  # fmt: skip
    slept: list[float] = []
    cluster = aws.cluster()
    cluster.patience.sleep = slept.append  # type: ignore[method-assign]
    printed = printed_logs(
        cluster,
        job_id="bert-1", command_id=None, node=None, lines=1, follow=False, poll_interval=1,
    )  # fmt: skip
    aws.verify()
    assert printed.pop(5) == (
        "reading the output of more streams than 5: 5 every 1 s (CloudWatch Logs' GetLogEvents "
        "rate)"
    )
    assert [line.split()[-1] for line in printed] == ids
    assert slept == [1, 1]
