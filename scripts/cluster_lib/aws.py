"""The AWS side of the operator CLI: stack outputs, nodes, SSM commands, logs.

Everything goes through boto3 clients handed in by the caller (`Clients.from_session`), so
the tests can put botocore Stubbers or moto behind them. Time goes through `sleep` and
`clock` for the same reason.
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
)

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.documents import join_train_args, load

#: Stack outputs the CLI reads (the operations stack's CfnOutput keys).
REQUIRED_OUTPUTS = (
    "ClusterName",
    "ClusterTagKey",
    "NodeCount",
    "InstanceType",
    "AutoScalingGroupName",
    "RunTrainingDocumentName",
    "PreflightDocumentName",
    "PrecompileDocumentName",
    "StopTrainingDocumentName",
    "TrainingLogGroupName",
)
ROLE_TAG = "trainium-cluster:role"
TERMINAL = {"Success", "Failed", "Cancelled", "TimedOut"}
USABLE_STACK_STATES = {"CREATE_COMPLETE", "UPDATE_COMPLETE", "UPDATE_ROLLBACK_COMPLETE"}
CREDENTIAL_ERRORS = {
    "ExpiredToken",
    "ExpiredTokenException",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
    "AuthFailure",
    "SignatureDoesNotMatch",
    "InvalidSignatureException",
}
#: Consecutive unreachable polls tolerated while following a command.
MAX_CONNECTION_FAILURES = 30
#: preflight.sh exits with this status when a node has a Neuron hardware fault.
REPLACE_NODE_STATUS = 3


@contextlib.contextmanager
def aws_errors(action: str) -> Iterator[None]:
    """Turns boto3 exceptions into one-line ClusterErrors that say what to do."""
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError):
        raise ClusterError(
            "no AWS credentials found: run `aws configure`, pass --profile, or set "
            "AWS_PROFILE / AWS_ACCESS_KEY_ID"
        ) from None
    except NoRegionError:
        raise ClusterError("no AWS region configured: pass --region or set AWS_REGION") from None
    except EndpointConnectionError as error:
        raise ClusterError(f"cannot reach AWS while {action}: {error}") from None
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "")
        message = error.response.get("Error", {}).get("Message", str(error))
        if code in CREDENTIAL_ERRORS:
            raise ClusterError(
                f"AWS rejected the credentials ({code}: {message}): refresh them"
            ) from None
        if "AccessDenied" in code:
            raise ClusterError(f"access denied while {action}: {message}") from None
        raise ClusterError(f"{action} failed: {code}: {message}") from None
    except BotoCoreError as error:
        raise ClusterError(f"{action} failed: {error}") from None


@dataclass(frozen=True)
class Clients:
    cloudformation: Any
    ec2: Any
    ssm: Any
    logs: Any
    autoscaling: Any

    @classmethod
    def from_session(cls, session: Any) -> Clients:
        with aws_errors("creating AWS clients"):
            return cls(
                cloudformation=session.client("cloudformation"),
                ec2=session.client("ec2"),
                ssm=session.client("ssm"),
                logs=session.client("logs"),
                autoscaling=session.client("autoscaling"),
            )


@dataclass(frozen=True)
class StackOutputs:
    stack_name: str
    values: dict[str, str]

    def __getitem__(self, key: str) -> str:
        return self.values[key]

    @property
    def node_count(self) -> int:
        return int(self.values["NodeCount"])

    def document(self, name: str) -> str:
        return self.values[f"{name}DocumentName"]


@dataclass(frozen=True)
class Node:
    instance_id: str
    address: str
    zone: str
    state: str
    launch_time: datetime | None = None

    @property
    def sort_key(self) -> tuple[int, str]:
        return int(ipaddress.IPv4Address(self.address)), self.instance_id


@dataclass
class Invocation:
    rank: int
    node: Node
    status: str = "Pending"
    response_code: int = -1
    stdout: str = ""
    stderr: str = ""
    finished_at: float | None = None

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self.node.address}, {self.node.instance_id})"


@dataclass
class CommandResult:
    document: str
    command_id: str
    invocations: list[Invocation]
    tails: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(inv.status == "Success" for inv in self.invocations)

    @property
    def failed(self) -> list[Invocation]:
        """The failed invocations, the first to fail first (it is usually the cause)."""
        bad = [inv for inv in self.invocations if inv.status != "Success"]
        return sorted(bad, key=lambda inv: (inv.finished_at is None, inv.finished_at or 0.0))

    def summary(self) -> str:
        first = self.failed[0]
        others = [inv.label for inv in self.failed[1:]]
        text = (
            f"{self.document} failed on {first.label}: {first.status}"
            f" (exit status {first.response_code}), command {self.command_id}"
        )
        if others:
            text += f"; also ended on {', '.join(others)}"
        tail = self.tails.get(first.node.instance_id, "").strip()
        if tail:
            text += "\n--- last output of " + first.label + " ---\n" + tail
        return text


class Cluster:
    """One deployed cluster, found through its operations stack."""

    def __init__(
        self,
        clients: Clients,
        cluster_name: str,
        *,
        out: Callable[[str], None] = print,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        poll_interval: float = 10.0,
        wait_timeout: float = 900.0,
        failure_grace: float = 120.0,
        tail_lines: int = 40,
    ) -> None:
        self.clients = clients
        self.cluster_name = cluster_name
        self.out = out
        self.sleep = sleep
        self.clock = clock
        self.poll_interval = poll_interval
        self.wait_timeout = wait_timeout
        self.failure_grace = failure_grace
        self.tail_lines = tail_lines
        self._outputs: StackOutputs | None = None
        self._connection_failures = 0

    # ----------------------------------------------------------------- discovery
    @property
    def stack_name(self) -> str:
        return f"{self.cluster_name}-operations"

    def outputs(self) -> StackOutputs:
        if self._outputs is not None:
            return self._outputs
        try:
            with aws_errors(f"reading stack {self.stack_name}"):
                stacks = self.clients.cloudformation.describe_stacks(StackName=self.stack_name)
        except ClusterError as error:
            if "does not exist" in str(error):
                raise ClusterError(
                    f"stack {self.stack_name} is not deployed in this account and region: "
                    "deploy the cluster with `npx cdk deploy --all`, or pass --cluster-name / "
                    "--region"
                ) from None
            raise
        stack = stacks["Stacks"][0]
        status = stack.get("StackStatus", "")
        if status not in USABLE_STACK_STATES:
            raise ClusterError(
                f"stack {self.stack_name} is in state {status}: wait for the deployment to finish"
            )
        values = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
        missing = [key for key in REQUIRED_OUTPUTS if key not in values]
        if missing:
            raise ClusterError(
                f"stack {self.stack_name} lacks the outputs {', '.join(missing)}: "
                "redeploy it from this version of the project"
            )
        self._outputs = StackOutputs(self.stack_name, values)
        return self._outputs

    def running_nodes(self) -> tuple[list[Node], int]:
        """Returns (running nodes in rank order, nodes still starting)."""
        outputs = self.outputs()
        filters = [
            {"Name": f"tag:{outputs['ClusterTagKey']}", "Values": [outputs["ClusterName"]]},
            {"Name": f"tag:{ROLE_TAG}", "Values": ["worker"]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
        nodes, pending = [], 0
        with aws_errors("listing the cluster's instances"):
            for page in self.clients.ec2.get_paginator("describe_instances").paginate(
                Filters=filters
            ):
                for reservation in page["Reservations"]:
                    for instance in reservation["Instances"]:
                        state = instance["State"]["Name"]
                        if state != "running" or not instance.get("PrivateIpAddress"):
                            pending += 1
                            continue
                        nodes.append(
                            Node(
                                instance_id=instance["InstanceId"],
                                address=instance["PrivateIpAddress"],
                                zone=instance.get("Placement", {}).get("AvailabilityZone", ""),
                                state=state,
                                launch_time=instance.get("LaunchTime"),
                            )
                        )
        return sorted(nodes, key=lambda n: n.sort_key), pending

    def ssm_status(self, nodes: list[Node]) -> dict[str, str]:
        """Maps instance ID to its SSM ping status (absent: not registered with SSM)."""
        if not nodes:
            return {}
        status: dict[str, str] = {}
        with aws_errors("reading the nodes' SSM status"):
            paginator = self.clients.ssm.get_paginator("describe_instance_information")
            for page in paginator.paginate(
                Filters=[{"Key": "InstanceIds", "Values": [n.instance_id for n in nodes]}]
            ):
                for info in page["InstanceInformationList"]:
                    status[info["InstanceId"]] = info.get("PingStatus", "Unknown")
        return status

    def wait_for_nodes(self, *, require_all: bool = True) -> list[Node]:
        """Waits until NodeCount nodes run and are online in SSM; returns them in rank order.

        The first node is the master. With require_all=False returns whatever nodes are
        running and online (for stop).
        """
        outputs = self.outputs()
        expected = outputs.node_count
        deadline = self.clock() + self.wait_timeout
        last = ""
        while True:
            nodes, starting = self.running_nodes()
            status = self.ssm_status(nodes)
            offline = [n for n in nodes if status.get(n.instance_id) != "Online"]
            if not require_all:
                online = [n for n in nodes if n not in offline]
                if online:
                    return online
                problem = "no node of the cluster is running and online in SSM"
            elif len(nodes) == expected and not offline:
                return nodes
            elif len(nodes) < expected:
                problem = (
                    f"only {len(nodes)} of {expected} nodes are running"
                    f"{f' ({starting} starting)' if starting else ''}: check the activity of "
                    f"Auto Scaling group {outputs['AutoScalingGroupName']} (capacity, quotas)"
                )
            elif len(nodes) > expected:
                problem = (
                    f"{len(nodes)} nodes are running but the cluster has {expected} "
                    f"(NodeCount): Auto Scaling group {outputs['AutoScalingGroupName']} is "
                    "replacing nodes; wait for it to settle"
                )
            else:
                node = offline[0]
                ping = status.get(node.instance_id, "not registered")
                problem = (
                    f"node {node.instance_id} ({node.address}) is not managed by SSM "
                    f"(ping status: {ping}): check the SSM agent and the instance profile"
                )
            if self.clock() >= deadline:
                raise ClusterError(problem)
            if problem != last:
                self.out(f"waiting: {problem}")
                last = problem
            self.sleep(self.poll_interval)

    # ------------------------------------------------------------------ commands
    def send(self, name: str, nodes: list[Node], parameters: dict[str, str], comment: str) -> str:
        document = load(name)
        document.check(parameters)
        outputs = self.outputs()
        with aws_errors(f"sending {name}"):
            response = self.clients.ssm.send_command(
                DocumentName=outputs.document(name),
                InstanceIds=[n.instance_id for n in nodes],
                Parameters={key: [value] for key, value in parameters.items()},
                Comment=comment[:100],
                TimeoutSeconds=600,
                MaxConcurrency=str(len(nodes)),
                MaxErrors=str(len(nodes)),
                CloudWatchOutputConfig={
                    "CloudWatchLogGroupName": outputs["TrainingLogGroupName"],
                    "CloudWatchOutputEnabled": True,
                },
            )
        command_id: str = response["Command"]["CommandId"]
        self.out(f"{name}: command {command_id} sent to {len(nodes)} nodes")
        return command_id

    def follow(
        self, name: str, command_id: str, nodes: list[Node], *, stream_rank: int | None = None
    ) -> CommandResult:
        """Polls every node's invocation until all have ended.

        When one node fails, the others get failure_grace seconds to end on their own
        (torchrun on the survivors normally fails too), then the command is cancelled on
        them, so that a broken job never keeps the cluster busy.
        """
        result = CommandResult(
            name, command_id, [Invocation(rank, node) for rank, node in enumerate(nodes)]
        )
        stream = (
            _LogFollower(self, command_id, nodes[stream_rank]) if stream_rank is not None else None
        )
        first_failure: float | None = None
        cancelled = False
        while True:
            for inv in result.invocations:
                if inv.status in TERMINAL:
                    continue
                previous = inv.status
                self._poll(command_id, inv)
                if inv.status != previous:
                    code = f" (exit status {inv.response_code})" if inv.status in TERMINAL else ""
                    self.out(f"{name}: {inv.label}: {inv.status}{code}")
                if inv.status in TERMINAL:
                    inv.finished_at = self.clock()
                    if inv.status != "Success" and first_failure is None:
                        first_failure = inv.finished_at
            if stream is not None:
                stream.poll()
            running = [inv for inv in result.invocations if inv.status not in TERMINAL]
            if not running:
                break
            if (
                first_failure is not None
                and not cancelled
                and self.clock() - first_failure >= self.failure_grace
            ):
                self.out(
                    f"{name}: cancelling the command on {len(running)} nodes still running "
                    f"{self.failure_grace:.0f} s after the first failure"
                )
                with aws_errors("cancelling the command"):
                    self.clients.ssm.cancel_command(
                        CommandId=command_id, InstanceIds=[i.node.instance_id for i in running]
                    )
                cancelled = True
            self.sleep(self.poll_interval)
        if stream is not None:
            stream.poll()
        for inv in result.failed:
            result.tails[inv.node.instance_id] = self.output_tail(command_id, inv)
        return result

    def _poll(self, command_id: str, inv: Invocation) -> None:
        with aws_errors("reading the command's progress"):
            try:
                response = self.clients.ssm.get_command_invocation(
                    CommandId=command_id, InstanceId=inv.node.instance_id
                )
            except ClientError as error:
                if error.response.get("Error", {}).get("Code") == "InvocationDoesNotExist":
                    return  # not registered yet right after send_command
                raise
            except EndpointConnectionError:
                # A multi-day job outlives many network blips on the operator's side.
                self._connection_failures += 1
                if self._connection_failures > MAX_CONNECTION_FAILURES:
                    raise
                self.out(f"cannot reach AWS ({self._connection_failures}); trying again")
                return
        self._connection_failures = 0
        inv.status = response.get("Status", inv.status)
        inv.response_code = int(response.get("ResponseCode", -1))
        inv.stdout = response.get("StandardOutputContent", "")
        inv.stderr = response.get("StandardErrorContent", "")

    def output_tail(self, command_id: str, inv: Invocation) -> str:
        """The last lines a node wrote: from CloudWatch Logs (the whole output), else from
        the invocation (SSM keeps only its first 24,000 characters)."""
        lines: list[str] = []
        log_group = self.outputs()["TrainingLogGroupName"]
        try:
            streams = self.clients.logs.describe_log_streams(
                logGroupName=log_group,
                logStreamNamePrefix=f"{command_id}/{inv.node.instance_id}/",
            )["logStreams"]
            for stream in sorted(streams, key=lambda s: s["logStreamName"], reverse=True):
                events = self.clients.logs.get_log_events(
                    logGroupName=log_group,
                    logStreamName=stream["logStreamName"],
                    startFromHead=False,
                    limit=self.tail_lines,
                )["events"]
                for event in events:
                    lines.extend(event["message"].rstrip("\n").splitlines())
        except (ClientError, BotoCoreError):
            lines = []
        if not lines:
            lines = (inv.stdout.rstrip("\n") + "\n" + inv.stderr.rstrip("\n")).strip().splitlines()
        return "\n".join(lines[-self.tail_lines :])

    def run(
        self,
        name: str,
        nodes: list[Node],
        parameters: dict[str, str],
        comment: str,
        *,
        stream_rank: int | None = None,
    ) -> CommandResult:
        command_id = self.send(name, nodes, parameters, comment)
        try:
            return self.follow(name, command_id, nodes, stream_rank=stream_rank)
        except KeyboardInterrupt:
            raise ClusterError(
                f"stopped following command {command_id}; it keeps running on the nodes "
                "(see `cluster.py status`, `cluster.py logs`, `cluster.py stop`)"
            ) from None

    # --------------------------------------------------------------- operations
    @staticmethod
    def hosts(nodes: list[Node]) -> str:
        return ",".join(n.address for n in nodes)

    def preflight(self, nodes: list[Node] | None = None, *, port: str = "29600") -> CommandResult:
        nodes = nodes or self.wait_for_nodes()
        self.out(f"preflight on {len(nodes)} nodes, master {nodes[0].address}")
        return self.run(
            "Preflight",
            nodes,
            {"Hosts": self.hosts(nodes), "Port": port},
            f"{self.cluster_name} preflight",
        )

    def train(
        self,
        job_id: str,
        train_args: list[str],
        *,
        master_port: str = "29500",
        nproc_per_node: str = "auto",
        max_retries: int = 0,
        retry_delay: float = 60.0,
        skip_preflight: bool = False,
        replace_unhealthy: bool = False,
        detach: bool = False,
        stream: bool = True,
    ) -> CommandResult | str:
        """Runs a job to the end, retrying transient failures: each retry waits for a full
        set of nodes, re-runs preflight and relaunches the same job ID, which resumes from
        its latest checkpoint."""
        parameters = {
            "JobId": job_id,
            "MasterPort": master_port,
            "NprocPerNode": nproc_per_node,
            "TrainArgs": join_train_args(train_args),
        }
        load("RunTraining").check(
            parameters,
            {
                "JobId": "--job-id",
                "MasterPort": "--master-port",
                "NprocPerNode": "--nproc-per-node",
                "TrainArgs": "train arguments",
            },
        )
        attempts = max_retries + 1
        for attempt in range(1, attempts + 1):
            started = datetime.now(UTC)
            nodes = self.wait_for_nodes()
            failure: CommandResult | None = None
            if not skip_preflight:
                check = self.preflight(nodes)
                if not check.ok:
                    failure = check
                    self._handle_unhealthy(check, replace_unhealthy)
            if failure is None:
                parameters["Hosts"] = self.hosts(nodes)
                comment = f"{self.cluster_name} train {job_id} attempt {attempt}"
                self.out(
                    f"job {job_id}: attempt {attempt} of {attempts} on {len(nodes)} nodes, "
                    f"master {nodes[0].address}"
                )
                if detach:
                    return self.send("RunTraining", nodes, parameters, comment)
                result = self.run(
                    "RunTraining", nodes, parameters, comment, stream_rank=0 if stream else None
                )
                if result.ok:
                    self.out(f"job {job_id} finished on all {len(nodes)} nodes")
                    return result
                failure = result
            stopper = self.stop_requested(job_id, started)
            if stopper:
                raise ClusterError(
                    f"job {job_id} was stopped (StopTraining command {stopper}); not retrying. "
                    f"{failure.summary()}"
                )
            if attempt == attempts:
                retries = f" after {max_retries} retries" if max_retries else ""
                raise ClusterError(f"job {job_id} failed{retries}: {failure.summary()}")
            self.out(failure.summary())
            self.out(
                f"job {job_id}: attempt {attempt} failed; retrying in {retry_delay:.0f} s "
                "(preflight, then the same job ID, which resumes from its latest checkpoint)"
            )
            self.sleep(retry_delay)
        raise AssertionError("unreachable")

    def _handle_unhealthy(self, check: CommandResult, replace: bool) -> None:
        for inv in check.failed:
            if inv.response_code != REPLACE_NODE_STATUS:
                continue
            if not replace:
                self.out(
                    f"{inv.label} reports a Neuron hardware error: replace it (terminate the "
                    "instance, or pass --replace-unhealthy)"
                )
                continue
            self.out(f"marking {inv.label} unhealthy: the Auto Scaling group replaces it")
            with aws_errors("marking the node unhealthy"):
                self.clients.autoscaling.set_instance_health(
                    InstanceId=inv.node.instance_id,
                    HealthStatus="Unhealthy",
                    ShouldRespectGracePeriod=False,
                )

    def stop_requested(self, job_id: str, since: datetime) -> str | None:
        """The ID of a StopTraining command for job_id sent after `since`, if any."""
        with aws_errors("listing StopTraining commands"):
            commands = self.clients.ssm.list_commands(
                Filters=[
                    {"key": "DocumentName", "value": self.outputs().document("StopTraining")},
                    {"key": "InvokedAfter", "value": since.strftime("%Y-%m-%dT%H:%M:%SZ")},
                ]
            )["Commands"]
        for command in commands:
            if command.get("Parameters", {}).get("JobId") == [job_id]:
                found: str = command["CommandId"]
                return found
        return None

    def precompile(
        self,
        job_id: str,
        train_args: list[str],
        *,
        steps: str = "10",
        master_port: str = "29500",
        nproc_per_node: str = "auto",
    ) -> CommandResult:
        nodes = self.wait_for_nodes()
        parameters = {
            "Hosts": self.hosts(nodes),
            "JobId": job_id,
            "MasterPort": master_port,
            "NprocPerNode": nproc_per_node,
            "Steps": steps,
            "TrainArgs": join_train_args(train_args),
        }
        load("Precompile").check(
            parameters,
            {
                "JobId": "--job-id",
                "MasterPort": "--master-port",
                "NprocPerNode": "--nproc-per-node",
                "Steps": "--steps",
                "TrainArgs": "train arguments",
            },
        )
        return self.run("Precompile", nodes, parameters, f"{self.cluster_name} precompile {job_id}")

    def stop(self, job_id: str) -> CommandResult:
        load("StopTraining").check({"JobId": job_id}, {"JobId": "--job-id"})
        nodes = self.wait_for_nodes(require_all=False)
        return self.run(
            "StopTraining", nodes, {"JobId": job_id}, f"{self.cluster_name} stop {job_id}"
        )

    # ------------------------------------------------------------- inspection
    def recent_commands(self, limit: int = 8) -> list[dict[str, Any]]:
        outputs = self.outputs()
        commands: list[dict[str, Any]] = []
        with aws_errors("listing recent commands"):
            for name in ("RunTraining", "Preflight", "Precompile", "StopTraining"):
                response = self.clients.ssm.list_commands(
                    Filters=[{"key": "DocumentName", "value": outputs.document(name)}],
                    MaxResults=limit,
                )
                for command in response["Commands"]:
                    commands.append({**command, "Document": name})
        commands.sort(
            key=lambda c: c.get("RequestedDateTime") or datetime.min.replace(tzinfo=UTC),
            reverse=True,
        )
        return commands[:limit]

    def latest_command(self, job_id: str, document: str = "RunTraining") -> dict[str, Any]:
        with aws_errors("listing commands"):
            paginator = self.clients.ssm.get_paginator("list_commands")
            for page in paginator.paginate(
                Filters=[{"key": "DocumentName", "value": self.outputs().document(document)}]
            ):
                for command in page["Commands"]:
                    if command.get("Parameters", {}).get("JobId") == [job_id]:
                        return dict(command)
        raise ClusterError(f"no {document} command found for job {job_id}")


class _LogFollower:
    """Prints a node's new command output from CloudWatch Logs while a command runs."""

    def __init__(self, cluster: Cluster, command_id: str, node: Node) -> None:
        self.cluster = cluster
        self.prefix = f"{command_id}/{node.instance_id}/"
        self.tokens: dict[str, str] = {}
        self.log_group = cluster.outputs()["TrainingLogGroupName"]

    def poll(self) -> None:
        logs = self.cluster.clients.logs
        try:
            streams = logs.describe_log_streams(
                logGroupName=self.log_group, logStreamNamePrefix=self.prefix
            )["logStreams"]
            for stream in streams:
                name = stream["logStreamName"]
                kwargs: dict[str, Any] = {
                    "logGroupName": self.log_group,
                    "logStreamName": name,
                    "startFromHead": True,
                }
                if name in self.tokens:
                    kwargs["nextToken"] = self.tokens[name]
                response = logs.get_log_events(**kwargs)
                for event in response["events"]:
                    for line in event["message"].rstrip("\n").splitlines():
                        self.cluster.out(f"  | {line}")
                self.tokens[name] = response["nextForwardToken"]
        except (ClientError, BotoCoreError):
            return  # the log stream appears only once the node has written something
