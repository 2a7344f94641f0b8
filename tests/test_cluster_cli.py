"""The operator CLI against a simulated AWS: moto for EC2 (instances and their tags),
botocore Stubbers for CloudFormation, SSM, CloudWatch Logs and Auto Scaling (whose
responses the tests script, failures included)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import boto3
import botocore.session
import pytest
from botocore.stub import ANY, Stubber

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.aws import Clients, Cluster

REPO_ROOT = Path(__file__).resolve().parent.parent
REGION = "us-east-1"
OUTPUTS = {
    "ClusterName": "trainium",
    "ClusterTagKey": "trainium-cluster:name",
    "NodeCount": "2",
    "InstanceType": "trn1.32xlarge",
    "AutoScalingGroupName": "trainium-compute-Nodes-ABC",
    "RunTrainingDocumentName": "trainium-operations-RunTrainingDocument-1",
    "PreflightDocumentName": "trainium-operations-PreflightDocument-1",
    "PrecompileDocumentName": "trainium-operations-PrecompileDocument-1",
    "StopTrainingDocumentName": "trainium-operations-StopTrainingDocument-1",
    "TrainingLogGroupName": "/trainium/training",
    "DataBucketName": "data-bucket",
    "CheckpointBucketName": "checkpoint-bucket",
    "CompileCacheBucketName": "cache-bucket",
    "FsxMountName": "abcdef",
    "FsxDnsName": "fs-1.fsx.us-east-1.amazonaws.com",
    "AlarmTopicArn": "arn:aws:sns:us-east-1:123456789012:alarms",
    "DashboardName": "trainium",
}


class FakeTime:
    """sleep() advances clock() instantly, so waits and grace periods cost nothing."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


class FakeAws:
    def __init__(self, session: boto3.Session) -> None:
        self.clients = Clients.from_session(session)
        self.stubs = {
            name: Stubber(getattr(self.clients, name))
            for name in ("cloudformation", "ssm", "logs", "autoscaling")
        }
        for stub in self.stubs.values():
            stub.activate()
        self.time = FakeTime()
        self.lines: list[str] = []
        self.commands = 0

    def cluster(self, **kwargs: Any) -> Cluster:
        options: dict[str, Any] = {"poll_interval": 5, "wait_timeout": 60, "failure_grace": 30}
        options.update(kwargs)
        return Cluster(
            self.clients, "trainium", out=self.lines.append, sleep=self.time.sleep,
            clock=self.time.clock, **options,
        )  # fmt: skip

    # --------------------------------------------------------------- EC2 (moto)
    def launch(self, count: int, state: str = "running") -> list[dict[str, Any]]:
        ec2 = self.clients.ec2
        reservation = ec2.run_instances(
            ImageId="ami-12c6146b", MinCount=count, MaxCount=count, InstanceType="trn1.32xlarge",
            TagSpecifications=[{"ResourceType": "instance", "Tags": [
                {"Key": "trainium-cluster:name", "Value": "trainium"},
                {"Key": "trainium-cluster:role", "Value": "worker"},
            ]}],
        )  # fmt: skip
        if state == "stopped":
            ec2.stop_instances(InstanceIds=[i["InstanceId"] for i in reservation["Instances"]])
        return sorted(
            reservation["Instances"],
            key=lambda i: tuple(int(part) for part in i["PrivateIpAddress"].split(".")),
        )

    # ---------------------------------------------------------- stubbed services
    def stack(self, outputs: dict[str, str] | None = None, status: str = "CREATE_COMPLETE") -> None:
        outputs = OUTPUTS if outputs is None else outputs
        self.stubs["cloudformation"].add_response(
            "describe_stacks",
            {"Stacks": [{
                "StackName": "trainium-operations", "StackStatus": status,
                "CreationTime": datetime(2026, 1, 1, tzinfo=UTC),
                "Outputs": [{"OutputKey": k, "OutputValue": v} for k, v in outputs.items()],
            }]},
            {"StackName": "trainium-operations"},
        )  # fmt: skip

    def online(
        self, instances: list[dict[str, Any]], statuses: dict[str, str] | None = None
    ) -> None:
        statuses = statuses or {}
        ids = [i["InstanceId"] for i in instances]
        self.stubs["ssm"].add_response(
            "describe_instance_information",
            {"InstanceInformationList": [
                {"InstanceId": iid, "PingStatus": statuses.get(iid, "Online")}
                for iid in ids if statuses.get(iid) != "absent"
            ]},
            {"Filters": [{"Key": "InstanceIds", "Values": ids}]},
        )  # fmt: skip

    def send(
        self, document: str, instances: list[dict[str, Any]], parameters: dict[str, str]
    ) -> str:
        self.commands += 1
        command_id = f"00000000-0000-4000-8000-{self.commands:012d}"
        self.stubs["ssm"].add_response(
            "send_command",
            {"Command": {"CommandId": command_id}},
            {
                "DocumentName": OUTPUTS[f"{document}DocumentName"],
                "InstanceIds": [i["InstanceId"] for i in instances],
                "Parameters": {k: [v] for k, v in parameters.items()},
                "Comment": ANY,
                "TimeoutSeconds": 600,
                "MaxConcurrency": str(len(instances)),
                "MaxErrors": str(len(instances)),
                "CloudWatchOutputConfig": {
                    "CloudWatchLogGroupName": OUTPUTS["TrainingLogGroupName"],
                    "CloudWatchOutputEnabled": True,
                },
            },
        )
        return command_id

    def invocation(self, command_id: str, instance: dict[str, Any], status: str, code: int = 0,
                   stdout: str = "") -> None:  # fmt: skip
        self.stubs["ssm"].add_response(
            "get_command_invocation",
            {"Status": status, "ResponseCode": code, "StandardOutputContent": stdout,
             "StandardErrorContent": ""},
            {"CommandId": command_id, "InstanceId": instance["InstanceId"]},
        )  # fmt: skip

    def all_succeed(self, command_id: str, instances: list[dict[str, Any]]) -> None:
        for instance in instances:
            self.invocation(command_id, instance, "Success")

    def log_tail(self, command_id: str, instance: dict[str, Any], lines: list[str]) -> None:
        stream = f"{command_id}/{instance['InstanceId']}/RunTraining/stdout"
        self.stubs["logs"].add_response(
            "describe_log_streams",
            {"logStreams": [{"logStreamName": stream}]},
            {"logGroupName": OUTPUTS["TrainingLogGroupName"],
             "logStreamNamePrefix": f"{command_id}/{instance['InstanceId']}/"},
        )  # fmt: skip
        self.stubs["logs"].add_response(
            "get_log_events",
            {"events": [{"timestamp": 0, "message": "\n".join(lines)}]},
            {"logGroupName": OUTPUTS["TrainingLogGroupName"], "logStreamName": stream,
             "startFromHead": False, "limit": 40},
        )  # fmt: skip

    def stop_commands(self, commands: list[dict[str, Any]]) -> None:
        self.stubs["ssm"].add_response(
            "list_commands",
            {"Commands": commands},
            {"Filters": [
                {"key": "DocumentName", "value": OUTPUTS["StopTrainingDocumentName"]},
                {"key": "InvokedAfter", "value": ANY},
            ]},
        )  # fmt: skip

    def verify(self) -> None:
        for stub in self.stubs.values():
            stub.assert_no_pending_responses()


@pytest.fixture(scope="module")
def loader() -> Any:
    """One botocore data loader for the module: it caches the parsed service models."""
    return botocore.session.get_session().get_component("data_loader")


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch, loader: Any) -> Iterator[FakeAws]:
    from moto import mock_aws

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with mock_aws():
        core = botocore.session.get_session()
        core.register_component("data_loader", loader)
        fake = FakeAws(boto3.Session(botocore_session=core, region_name=REGION))
        yield fake


def hosts(instances: list[dict[str, Any]]) -> str:
    return ",".join(i["PrivateIpAddress"] for i in instances)


def train_parameters(instances: list[dict[str, Any]], job_id: str = "bert-1") -> dict[str, str]:
    return {
        "JobId": job_id, "MasterPort": "29500", "NprocPerNode": "auto",
        "TrainArgs": "--data /fsx/data/imdb --model tiny --max-steps 100",
        "Hosts": hosts(instances),
    }  # fmt: skip


TRAIN_ARGS = ["--data", "/fsx/data/imdb", "--model", "tiny", "--max-steps", "100"]


def test_train_happy_path_runs_preflight_then_the_job_on_all_nodes_in_address_order(
    aws: FakeAws,
) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    check = aws.send("Preflight", nodes, {"Hosts": hosts(nodes), "Port": "29600"})
    aws.all_succeed(check, nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.invocation(job, nodes[0], "InProgress")
    aws.invocation(job, nodes[1], "InProgress")
    aws.all_succeed(job, nodes)

    result = aws.cluster().train("bert-1", TRAIN_ARGS, stream=False)

    assert not isinstance(result, str)
    assert result.ok
    aws.verify()
    assert (
        f"job bert-1: attempt 1 of 1 on 2 nodes, master {nodes[0]['PrivateIpAddress']}" in aws.lines
    )
    assert "job bert-1 finished on all 2 nodes" in aws.lines


def test_train_streams_the_master_nodes_output(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.all_succeed(job, nodes)
    stream = f"{job}/{nodes[0]['InstanceId']}/RunTraining/stdout"
    for token, message in (("t1", "step 10 loss 0.69"), ("t2", "step 20 loss 0.41")):
        aws.stubs["logs"].add_response(
            "describe_log_streams", {"logStreams": [{"logStreamName": stream}]}
        )
        aws.stubs["logs"].add_response(
            "get_log_events",
            {"events": [{"timestamp": 0, "message": message}], "nextForwardToken": token},
        )

    aws.cluster().train("bert-1", TRAIN_ARGS, skip_preflight=True)

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
    aws.invocation(job, nodes[0], "InProgress")
    aws.invocation(job, nodes[1], "Failed", code=1)
    # The survivor keeps running through the 30 s grace period (5 s polls), then is cancelled.
    for _ in range(6):
        aws.invocation(job, nodes[0], "InProgress")
    aws.stubs["ssm"].add_response(
        "cancel_command", {}, {"CommandId": job, "InstanceIds": [nodes[0]["InstanceId"]]}
    )
    aws.invocation(job, nodes[0], "Cancelled", code=-1)
    aws.log_tail(job, nodes[1], ["step 40 loss 0.52", "RuntimeError: Connection reset by peer"])
    aws.log_tail(job, nodes[0], ["step 40 loss 0.52"])
    aws.stop_commands([])

    with pytest.raises(ClusterError) as error:
        aws.cluster().train("bert-1", TRAIN_ARGS, skip_preflight=True, stream=False)

    message = str(error.value)
    first_line = message.splitlines()[0]
    assert first_line.startswith(
        f"job bert-1 failed: RunTraining failed on node 1 ({nodes[1]['PrivateIpAddress']}, "
        f"{nodes[1]['InstanceId']}): Failed (exit status 1)"
    )
    assert "also ended on node 0" in first_line
    assert message.splitlines()[-1] == "RuntimeError: Connection reset by peer"
    aws.verify()


def test_retries_rerun_preflight_and_relaunch_the_same_job_id(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    # Attempt 1: preflight passes, the job fails on both nodes.
    aws.online(nodes)
    aws.all_succeed(aws.send("Preflight", nodes, {"Hosts": hosts(nodes), "Port": "29600"}), nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.invocation(job, nodes[0], "Failed", code=1)
    aws.invocation(job, nodes[1], "Failed", code=1)
    aws.log_tail(job, nodes[0], ["NEURON_RT error: collective timeout"])
    aws.log_tail(job, nodes[1], ["killed"])
    aws.stop_commands([])
    # Attempt 2: nodes checked again, preflight again, the same job ID again.
    aws.online(nodes)
    aws.all_succeed(aws.send("Preflight", nodes, {"Hosts": hosts(nodes), "Port": "29600"}), nodes)
    aws.all_succeed(aws.send("RunTraining", nodes, train_parameters(nodes)), nodes)

    result = aws.cluster().train("bert-1", TRAIN_ARGS, max_retries=2, retry_delay=45, stream=False)

    assert not isinstance(result, str)
    assert result.ok
    aws.verify()
    assert 45 in aws.time.slept
    assert any("attempt 1 failed; retrying in 45 s" in line for line in aws.lines)
    assert (
        "job bert-1: attempt 2 of 3 on 2 nodes, master " + nodes[0]["PrivateIpAddress"] in aws.lines
    )


def test_retries_give_up_after_max_retries(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    for _ in range(2):
        aws.online(nodes)
        job = aws.send("RunTraining", nodes, train_parameters(nodes))
        aws.invocation(job, nodes[0], "Failed", code=137)
        aws.invocation(job, nodes[1], "Failed", code=1)
        aws.log_tail(job, nodes[0], ["Killed"])
        aws.log_tail(job, nodes[1], ["peer closed"])
        aws.stop_commands([])

    with pytest.raises(
        ClusterError, match=r"^job bert-1 failed after 1 retries: RunTraining failed on node 0"
    ):
        aws.cluster().train("bert-1", TRAIN_ARGS, max_retries=1, skip_preflight=True, stream=False)
    aws.verify()


def test_a_stopped_job_is_not_retried(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    job = aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.invocation(job, nodes[0], "Failed", code=143)
    aws.invocation(job, nodes[1], "Failed", code=143)
    aws.log_tail(job, nodes[0], ["stopped"])
    aws.log_tail(job, nodes[1], ["stopped"])
    other, stop = "00000000-0000-4000-8000-00000000aaaa", "00000000-0000-4000-8000-00000000bbbb"
    aws.stop_commands([
        {"CommandId": other, "Parameters": {"JobId": ["another-job"]}},
        {"CommandId": stop, "Parameters": {"JobId": ["bert-1"]}},
    ])  # fmt: skip

    with pytest.raises(
        ClusterError,
        match=rf"job bert-1 was stopped \(StopTraining command {stop}\); not retrying",
    ):
        aws.cluster().train("bert-1", TRAIN_ARGS, max_retries=3, skip_preflight=True, stream=False)
    aws.verify()


def test_preflight_hardware_fault_marks_the_node_unhealthy_when_asked(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    check = aws.send("Preflight", nodes, {"Hosts": hosts(nodes), "Port": "29600"})
    aws.invocation(check, nodes[0], "Success")
    aws.invocation(check, nodes[1], "Failed", code=3)
    aws.log_tail(
        check, nodes[1], ["FAIL neuron-hardware: NEURON_HW_ERR=DMA_ERROR action=TERMINATE_INSTANCE"]
    )
    aws.stubs["autoscaling"].add_response(
        "set_instance_health", {},
        {"InstanceId": nodes[1]["InstanceId"], "HealthStatus": "Unhealthy",
         "ShouldRespectGracePeriod": False},
    )  # fmt: skip
    aws.stop_commands([])

    with pytest.raises(ClusterError, match=r"Preflight failed on node 1 .*exit status 3"):
        aws.cluster().train("bert-1", TRAIN_ARGS, replace_unhealthy=True, stream=False)
    aws.verify()
    assert any("marking node 1" in line and "unhealthy" in line for line in aws.lines)


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
        "trainium-compute-Nodes-ABC (capacity, quotas)"
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
        aws.cluster().train(job_id, args)
    aws.verify()


def test_stop_runs_on_the_online_nodes(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes, {nodes[1]["InstanceId"]: "ConnectionLost"})
    command = aws.send("StopTraining", nodes[:1], {"JobId": "bert-1"})
    aws.invocation(command, nodes[0], "Success")
    assert aws.cluster().stop("bert-1").ok
    aws.verify()


def test_precompile_sends_steps_and_train_args(aws: FakeAws) -> None:
    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes)
    parameters = {
        "Hosts": hosts(nodes), "JobId": "bert-1", "MasterPort": "29500", "NprocPerNode": "auto",
        "Steps": "5", "TrainArgs": "--model tiny",
    }  # fmt: skip
    aws.all_succeed(aws.send("Precompile", nodes, parameters), nodes)
    assert aws.cluster().precompile("bert-1", ["--model", "tiny"], steps="5").ok
    aws.verify()


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


def test_status_lists_nodes_and_recent_commands(aws: FakeAws) -> None:
    from scripts import cluster as cli

    nodes = aws.launch(2)
    aws.stack()
    aws.online(nodes, {nodes[1]["InstanceId"]: "ConnectionLost"})
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
    printed: list[str] = []
    original = cli.out
    cli.out = printed.append
    try:
        assert cli.cmd_status(aws.cluster()) == 0
    finally:
        cli.out = original
    aws.verify()
    assert printed[0] == "cluster trainium (stack trainium-operations): 2 x trn1.32xlarge"
    assert printed[1] == "nodes: 2 running of 2, 0 starting"
    assert nodes[0]["InstanceId"] in printed[2] and "ssm Online" in printed[2]
    assert nodes[1]["InstanceId"] in printed[3] and "ssm ConnectionLost" in printed[3]
    assert printed[4] == "recent commands:"
    assert printed[5].split() == [
        "2026-05-01", "12:30", "RunTraining", "bert-1", "InProgress",
        "00000000-0000-4000-8000-000000000001",
    ]  # fmt: skip


def test_logs_print_the_latest_run_of_a_job(aws: FakeAws) -> None:
    import argparse

    from scripts import cluster as cli

    nodes = aws.launch(2)
    aws.stack()
    latest = "00000000-0000-4000-8000-000000000007"
    aws.stubs["ssm"].add_response(
        "list_commands",
        {"Commands": [
            {"CommandId": latest[:-1] + "8", "Parameters": {"JobId": ["other"]}},
            {"CommandId": latest, "Parameters": {"JobId": ["bert-1"]}},
        ]},
        {"Filters": [{"key": "DocumentName", "value": OUTPUTS["RunTrainingDocumentName"]}]},
    )  # fmt: skip
    stream = f"{latest}/{nodes[1]['InstanceId']}/RunTraining/stdout"
    aws.stubs["logs"].add_response(
        "describe_log_streams", {"logStreams": [{"logStreamName": stream}]},
        {"logGroupName": OUTPUTS["TrainingLogGroupName"],
         "logStreamNamePrefix": f"{latest}/{nodes[1]['InstanceId']}/"},
    )  # fmt: skip
    aws.stubs["logs"].add_response(
        "get_log_events",
        {"events": [{"timestamp": 1777638600000, "message": "step 10 loss 0.5\nstep 20 loss 0.4"}],
         "nextForwardToken": "f/1"},
        {"logGroupName": OUTPUTS["TrainingLogGroupName"], "logStreamName": stream,
         "startFromHead": False, "limit": 2},
    )  # fmt: skip
    args = argparse.Namespace(
        job_id="bert-1", command_id=None, node="1", lines=2, follow=False, poll_interval=1
    )
    printed: list[str] = []
    original = cli.out
    cli.out = printed.append
    try:
        assert cli.cmd_logs(aws.cluster(), args) == 0
    finally:
        cli.out = original
    aws.verify()
    assert printed == [
        f"{nodes[1]['InstanceId']} 12:30:00 step 10 loss 0.5",
        f"{nodes[1]['InstanceId']} 12:30:00 step 20 loss 0.4",
    ]


def test_following_survives_a_network_blip(aws: FakeAws) -> None:
    from botocore.exceptions import EndpointConnectionError

    nodes = aws.launch(1)
    aws.stack({**OUTPUTS, "NodeCount": "1"})
    aws.online(nodes)
    aws.send("RunTraining", nodes, train_parameters(nodes))
    aws.invocation(f"00000000-0000-4000-8000-{1:012d}", nodes[0], "Success")
    real = aws.clients.ssm.get_command_invocation
    calls: list[dict[str, Any]] = []

    def flaky(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) == 1:
            raise EndpointConnectionError(endpoint_url="https://ssm.us-east-1.amazonaws.com")
        return real(**kwargs)

    aws.clients.ssm.get_command_invocation = flaky  # type: ignore[method-assign]
    result = aws.cluster().train("bert-1", TRAIN_ARGS, skip_preflight=True, stream=False)
    assert not isinstance(result, str)
    assert result.ok
    assert len(calls) == 2
    assert "cannot reach AWS (1); trying again" in aws.lines
    aws.verify()
