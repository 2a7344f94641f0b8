"""A simulated AWS for the operator CLI's tests: moto for EC2 (instances, tags, launch
templates), botocore Stubbers for CloudFormation, SSM, CloudWatch Logs, Auto Scaling and FSx
(whose responses the tests script, failures included)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import boto3
import botocore.session
import pytest
from botocore.stub import ANY, Stubber

from scripts.cluster_lib.clients import Clients
from scripts.cluster_lib.cluster import Cluster
from scripts.cluster_lib.commands import CommandResult
from scripts.cluster_lib.documents import join_train_args
from scripts.cluster_lib.job_inputs import JobInputs

REGION = "us-east-1"
OUTPUTS = {
    "ClusterName": "trainium",
    "ClusterTagKey": "trainium-cluster:name",
    "NodeCount": "2",
    "InstanceType": "trn1.32xlarge",
    "AutoScalingGroupName": "trainium-workers",
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
    "FileSystemId": "fs-0123456789abcdef0",
    "ExportPaths": "/jobs",
    "AlarmTopicArn": "arn:aws:sns:us-east-1:123456789012:alarms",
    "DashboardName": "trainium",
}
SOFTWARE = "node-software: version=0123456789abcdef launch-template-version=3 ami=ami-12c6146b"
TRAIN_ARGS = ["--data", "/fsx/data/imdb", "--model", "tiny", "--max-steps", "100"]
#: A job's code and data parameters at the longest the documents allow (CodeSnapshot 64,
#: EntryPoint's maxChars 259, DataPath's 1024), for the supervisor's payload arithmetic.
LONGEST_CODE = {
    "CodeSnapshot": "f" * 64,
    "EntryPoint": "x" * 256 + ".py",
    "DataPath": "/fsx/" + "d" * 1019,
}
#: A job's code and data as `train` sends them (the reference workload's entry point).
INPUTS = JobInputs("0123456789abcdef" * 4, "-m workload.train", "/fsx/data/imdb")
Instance = dict[str, Any]
Status = str | tuple[str, int]


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
    STUBBED = ("cloudformation", "ssm", "logs", "autoscaling", "fsx")

    def __init__(self, session: boto3.Session) -> None:
        self.clients = Clients.from_session(session)
        self.stubs = {name: Stubber(getattr(self.clients, name)) for name in self.STUBBED}
        for stub in self.stubs.values():
            stub.activate()
        self.time = FakeTime()
        self.lines: list[str] = []
        self.commands = 0
        self.ended: set[tuple[str, str]] = set()
        self.sent: list[dict[str, Any]] = []

    def cluster(self, **kwargs: Any) -> Cluster:
        options: dict[str, Any] = {"poll_interval": 5, "wait_timeout": 60, "failure_grace": 30}
        options.update(kwargs)
        return Cluster(
            self.clients, "trainium", out=self.lines.append, sleep=self.time.sleep,
            clock=self.time.clock, **options,
        )  # fmt: skip

    # --------------------------------------------------------------- EC2 (moto)
    def launch(self, count: int, state: str = "running", version: str = "3") -> list[Instance]:
        ec2 = self.clients.ec2
        reservation = ec2.run_instances(
            ImageId="ami-12c6146b", MinCount=count, MaxCount=count, InstanceType="trn1.32xlarge",
            TagSpecifications=[{"ResourceType": "instance", "Tags": [
                {"Key": "trainium-cluster:name", "Value": "trainium"},
                {"Key": "trainium-cluster:role", "Value": "worker"},
                {"Key": "aws:ec2launchtemplate:version", "Value": version},
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

    def online(self, instances: list[Instance], statuses: dict[str, str] | None = None) -> None:
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

    def no_refresh(self, refreshes: list[dict[str, Any]] | None = None) -> None:
        self.stubs["autoscaling"].add_response(
            "describe_instance_refreshes",
            {"InstanceRefreshes": refreshes or []},
            {"AutoScalingGroupName": OUTPUTS["AutoScalingGroupName"]},
        )

    def send(self, document: str, instances: list[Instance], parameters: dict[str, str]) -> str:
        """One SendCommand to at most 50 instances."""
        self.commands += 1
        command_id = f"00000000-0000-4000-8000-{self.commands:012d}"
        expected = {
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
        }
        self.stubs["ssm"].add_response(
            "send_command", {"Command": {"CommandId": command_id}}, expected
        )
        return command_id

    def poll(
        self, command_id: str, instances: list[Instance], statuses: Sequence[Status],
        stdout: str | list[str] = "",
    ) -> None:  # fmt: skip
        """One poll of a command: ListCommandInvocations for all its instances, then
        GetCommandInvocation for each one that has just ended (status, exit status)."""
        pairs = [(s, 0) if isinstance(s, str) else s for s in statuses]
        outputs = stdout if isinstance(stdout, list) else [stdout] * len(instances)
        self.stubs["ssm"].add_response(
            "list_command_invocations",
            {"CommandInvocations": [
                {"CommandId": command_id, "InstanceId": i["InstanceId"], "Status": status}
                for i, (status, _) in zip(instances, pairs, strict=True)
            ]},
            {"CommandId": command_id},
        )  # fmt: skip
        for instance, (status, code), text in zip(instances, pairs, outputs, strict=True):
            key = (command_id, instance["InstanceId"])
            if status in ("Success", "Failed", "Cancelled", "TimedOut") and key not in self.ended:
                self.ended.add(key)
                self.stubs["ssm"].add_response(
                    "get_command_invocation",
                    {"Status": status, "ResponseCode": code, "StandardOutputContent": text,
                     "StandardErrorContent": ""},
                    {"CommandId": command_id, "InstanceId": instance["InstanceId"]},
                )  # fmt: skip

    def all_succeed(self, command_id: str, instances: list[Instance], stdout: str = "") -> None:
        self.poll(command_id, instances, ["Success"] * len(instances), stdout)

    def preflight_passes(
        self, instances: list[Instance], stdout: str | list[str] = SOFTWARE
    ) -> str:
        check = self.send("Preflight", instances, {"Hosts": hosts(instances), "Port": "29600"})
        self.poll(check, instances, ["Success"] * len(instances), stdout)
        return check

    def log_tail(self, command_id: str, instance: Instance, lines: list[str]) -> None:
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

    def running_commands(self, run: list[dict[str, Any]], precompile: list[dict[str, Any]]) -> None:
        """The two ListCommands searches for commands still running (RunTraining, Precompile)."""
        for name, commands in (("RunTraining", run), ("Precompile", precompile)):
            self.stubs["ssm"].add_response(
                "list_commands",
                {"Commands": commands},
                {"Filters": [
                    {"key": "DocumentName", "value": OUTPUTS[f"{name}DocumentName"]},
                    {"key": "InvokedAfter", "value": ANY},
                ]},
            )  # fmt: skip

    def intercept(self, client: str, operation: str, handler: Callable[[], None]) -> None:
        """Runs handler() before every call of one operation, ahead of the Stubber's answer;
        an exception it raises is what the call raises. (Handlers of one event node run in
        registration order, `first` ones first, so it sits on the Stubber's node. The
        Stubber still checks the call's parameters against its next answer first.)"""
        wanted = f"before-call.{client}.{operation}"

        def before_call(event_name: str, **_: Any) -> None:
            if event_name == wanted:
                handler()

        getattr(self.clients, client).meta.events.register_first("before-call.*.*", before_call)

    def verify(self) -> None:
        for stub in self.stubs.values():
            stub.assert_no_pending_responses()


def hosts(instances: list[Instance]) -> str:
    return ",".join(i["PrivateIpAddress"] for i in instances)


def train_parameters(instances: list[Instance], job_id: str = "bert-1") -> dict[str, str]:
    return {
        "JobId": job_id, "MasterPort": "29500", "NprocPerNode": "auto",
        "TrainArgs": "--data /fsx/data/imdb --model tiny --max-steps 100",
        "Hosts": hosts(instances),
    }  # fmt: skip


def run_training(
    cluster: Cluster, job_id: str = "bert-1", train_args: Sequence[str] = TRAIN_ARGS,
    **run_kwargs: Any,
) -> CommandResult:  # fmt: skip
    """One RunTraining attempt on every node, as the job supervisor sends it: the command
    mechanics (batches, following, cancelling) that `Cluster.run` still provides."""
    nodes = cluster.wait_for_nodes()
    parameters = {
        "JobId": job_id, "MasterPort": "29500", "NprocPerNode": "auto",
        "TrainArgs": join_train_args(list(train_args)), "Hosts": cluster.hosts(nodes),
    }  # fmt: skip
    return cluster.run("RunTraining", nodes, parameters, f"{job_id} attempt 1", **run_kwargs)


def fake_aws(monkeypatch: pytest.MonkeyPatch, loader: Any) -> Iterator[FakeAws]:
    from moto import mock_aws

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing", "AWS_DEFAULT_REGION": REGION,
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    with mock_aws():
        core = botocore.session.get_session()
        core.register_component("data_loader", loader)
        yield FakeAws(boto3.Session(botocore_session=core, region_name=REGION))


def shared_loader() -> Any:
    """One botocore data loader: it caches the parsed service models across tests."""
    return botocore.session.get_session().get_component("data_loader")


def capture(module: Any) -> tuple[list[str], Callable[[], None]]:
    """Collects what a CLI module prints through its `out`; call the second value to undo."""
    printed: list[str] = []
    original = module.out
    module.out = printed.append

    def restore() -> None:
        module.out = original

    return printed, restore


def printed_logs(cluster: Cluster, **options: Any) -> list[str]:
    """What `cluster.py logs` prints with these options (every one of its parser's: job_id,
    command_id, node, lines, follow, poll_interval), after it returned 0."""
    import argparse

    from scripts import cluster as cli

    printed, restore = capture(cli)
    try:
        assert cli.cmd_logs(cluster, argparse.Namespace(**options)) == 0
    finally:
        restore()
    return printed
