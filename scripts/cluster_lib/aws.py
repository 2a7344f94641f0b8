"""The AWS side of the operator CLI: stack outputs, nodes, SSM commands, logs, fleet rolls,
FSx exports.

Everything goes through the boto3 clients in `Clients`, built in one place
(`Clients.from_session`), so the tests can put botocore Stubbers or moto behind them and the
local rehearsal can serve the same calls. Only client methods and paginators are used:

- cloudformation: describe_stacks
- ec2: describe_instances (paginated), describe_launch_template_versions
- ssm: describe_instance_information (paginated), send_command, list_command_invocations
  (paginated), get_command_invocation, cancel_command, list_commands (paginated)
- logs: describe_log_streams (paginated), get_log_events, filter_log_events
- autoscaling: set_instance_health, describe_auto_scaling_groups,
  describe_instance_refreshes, start_instance_refresh
- fsx: create_data_repository_task, describe_data_repository_tasks

Time goes through `sleep` and `clock` for the same reason.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    SSOError,
    TokenRetrievalError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.documents import join_train_args, load

T = TypeVar("T")

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
#: Outputs only `cluster.py export` needs (contract C6): the file system, and the file-system
#: paths of its data repository associations, comma separated.
EXPORT_OUTPUTS = ("FileSystemId", "ExportPaths")
ROLE_TAG = "trainium-cluster:role"
#: EC2 tags every instance launched from a launch template with the template's ID and the
#: version it was launched from (EC2 user guide, "Launch an instance from a launch template").
LAUNCH_TEMPLATE_VERSION_TAG = "aws:ec2launchtemplate:version"
TERMINAL = {"Success", "Failed", "Cancelled", "TimedOut"}
#: Command (not invocation) statuses of SSM ListCommands that mean it still runs somewhere.
ACTIVE_COMMAND = {"Pending", "InProgress", "Cancelling"}
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
#: Error codes that mean "slow down" or "try again": botocore's own lists
#: (botocore/retries/standard.py, ThrottlingErrorDetector._THROTTLED_ERROR_CODES and
#: TransientRetryableChecker._TRANSIENT_ERROR_CODES). The adaptive retry mode already retries
#: them a few times per call; a multi-day follow must also outlast a longer spell of them.
TRANSIENT_ERROR_CODES = {
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "TransactionInProgressException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "LimitExceededException",
    "RequestThrottled",
    "SlowDown",
    "PriorRequestNotComplete",
    "EC2ThrottledException",
    "RequestTimeout",
    "RequestTimeoutException",
    "InternalError",
    "InternalServerError",
    "ServiceUnavailable",
}
#: SendCommand's InstanceIds takes at most 50 IDs (SSM API reference, SendCommand; botocore's
#: model: InstanceIds max 50). Larger clusters get one command per batch of 50.
MAX_INSTANCES_PER_COMMAND = 50
#: Every client retries throttling, 5xx and connection errors itself, with client-side rate
#: limiting ("adaptive" mode, botocore's Config retries), and gives up on a hung connection.
RETRIES = {"mode": "adaptive", "max_attempts": 10}
TIMEOUTS = {"connect_timeout": 10, "read_timeout": 60}
#: Seconds of transient AWS errors a command's follower rides out before giving up.
DEFAULT_GIVE_UP_AFTER = 1800.0
#: preflight.sh exits with this status when a node has a Neuron hardware fault.
REPLACE_NODE_STATUS = 3
#: launch.sh exits with this status (EX_TEMPFAIL) when it ended a leg at its time limit and the
#: trainer saved a resumable checkpoint (contract C4); SSM reports the node as Failed with it.
LEG_TIME_LIMIT_STATUS = 75
#: preflight.sh prints one such line per node (contract C3).
SOFTWARE_LINE = re.compile(
    r"^node-software: version=(?P<version>\S*) launch-template-version=(?P<lt>\S*)"
    r" ami=(?P<ami>\S*)\s*$",
    re.MULTILINE,
)
MISSING_SOFTWARE = "no node-software line"
#: Instance refresh statuses (Auto Scaling API reference, InstanceRefresh.Status) during which
#: the group may replace nodes.
ACTIVE_REFRESH = {"Pending", "InProgress", "Cancelling", "RollbackInProgress", "Baking"}
REFRESH_DONE = {"Successful", "Failed", "Cancelled", "RollbackFailed", "RollbackSuccessful"}
EXPORT_DONE = {"SUCCEEDED", "FAILED", "CANCELED"}


def resolve_region(cli_region: str | None, environ: dict[str, str] | Any) -> str | None:
    """--region, else AWS_REGION, else AWS_DEFAULT_REGION; None leaves it to the profile.

    boto3 1.44 reads only AWS_DEFAULT_REGION (botocore's config_chain `region`); the AWS CLI v2
    and the other SDKs read AWS_REGION first (AWS SDKs and Tools reference guide, "AWS
    Region"), so an operator may have set either.
    """
    for value in (cli_region, environ.get("AWS_REGION"), environ.get("AWS_DEFAULT_REGION")):
        if value:
            return str(value)
    return None


def transient_reason(error: BaseException) -> str | None:
    """Why an error may pass if we wait (None when it will not)."""
    if isinstance(error, (SSOError, TokenRetrievalError)):
        return "the AWS SSO session has expired: run `aws sso login` to renew it"
    if isinstance(error, (BotoConnectionError, HTTPClientError)):
        return f"cannot reach AWS ({error})"
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        if code in TRANSIENT_ERROR_CODES or (isinstance(status, int) and status >= 500):
            return f"AWS is throttling or unavailable ({code or status})"
    return None


class TransientAwsError(ClusterError):
    """A ClusterError from an AWS error that may pass if we wait (see transient_reason)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def cluster_error(action: str, error: BaseException) -> ClusterError:  # noqa: PLR0911
    """The one-line ClusterError for a boto3 exception, saying what to do."""
    reason = transient_reason(error)
    if isinstance(error, (NoCredentialsError, PartialCredentialsError)):
        return ClusterError(
            "no AWS credentials found: run `aws configure`, pass --profile, or set "
            "AWS_PROFILE / AWS_ACCESS_KEY_ID"
        )
    if isinstance(error, NoRegionError):
        return ClusterError("no AWS region configured: pass --region or set AWS_REGION")
    if isinstance(error, (SSOError, TokenRetrievalError)):
        return TransientAwsError(
            f"the AWS SSO session has expired while {action}: run `aws sso login` and try again",
            reason or "",
        )
    if isinstance(error, (BotoConnectionError, HTTPClientError)):
        return TransientAwsError(f"cannot reach AWS while {action}: {error}", reason or "")
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "")
        message = error.response.get("Error", {}).get("Message", str(error))
        if code in CREDENTIAL_ERRORS:
            return ClusterError(f"AWS rejected the credentials ({code}: {message}): refresh them")
        if "AccessDenied" in code:
            return ClusterError(f"access denied while {action}: {message}")
        if reason:
            return TransientAwsError(f"{action} failed: {code}: {message}", reason)
        return ClusterError(f"{action} failed: {code}: {message}")
    return ClusterError(f"{action} failed: {error}")


@contextlib.contextmanager
def aws_errors(action: str) -> Iterator[None]:
    """Turns boto3 exceptions into one-line ClusterErrors that say what to do."""
    try:
        yield
    except (ClientError, BotoCoreError) as error:
        raise cluster_error(action, error) from None


def error_code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


CLIENT_SERVICES = ("cloudformation", "ec2", "ssm", "logs", "autoscaling", "fsx", "stepfunctions")


@dataclass(frozen=True)
class Clients:
    cloudformation: Any
    ec2: Any
    ssm: Any
    logs: Any
    autoscaling: Any
    fsx: Any
    stepfunctions: Any

    @classmethod
    def from_session(cls, session: Any) -> Clients:
        """The one place the CLI's clients are built, each with RETRIES and TIMEOUTS."""
        with aws_errors("creating AWS clients"):
            return cls(
                **{
                    # A Config each: botocore rewrites the retries dict of the one it gets.
                    name: session.client(name, config=Config(retries=dict(RETRIES), **TIMEOUTS))
                    for name in CLIENT_SERVICES
                }
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
    image_id: str = ""
    launch_template_version: str = ""

    @property
    def sort_key(self) -> tuple[int, str]:
        return int(ipaddress.IPv4Address(self.address)), self.instance_id


@dataclass(frozen=True)
class Sent:
    """One SendCommand call: a command ID and the nodes (at most 50) it went to."""

    command_id: str
    nodes: tuple[Node, ...]


@dataclass
class Invocation:
    rank: int
    node: Node
    command_id: str = ""
    status: str = "Pending"
    response_code: int = -1
    stdout: str = ""
    stderr: str = ""
    finished_at: float | None = None

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self.node.address}, {self.node.instance_id})"

    @property
    def leg_ended(self) -> bool:
        """The node ended its leg at the time limit after saving (contract C4)."""
        return self.status == "Failed" and self.response_code == LEG_TIME_LIMIT_STATUS


@dataclass
class CommandResult:
    document: str
    command_ids: list[str]
    invocations: list[Invocation]
    tails: dict[str, str] = field(default_factory=dict)

    @property
    def command_id(self) -> str:
        return ", ".join(self.command_ids)

    @property
    def ok(self) -> bool:
        return all(inv.status == "Success" for inv in self.invocations)

    @property
    def leg_ended(self) -> bool:
        """Every node ended with Success or the leg's time-limit status, at least one with the
        latter: the job saved and stopped at its time limit, and the next leg resumes it."""
        return all(inv.status == "Success" or inv.leg_ended for inv in self.invocations) and any(
            inv.leg_ended for inv in self.invocations
        )

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
            f" (exit status {first.response_code}), command {first.command_id}"
        )
        if others:
            shown = others[:8]
            more = f" and {len(others) - len(shown)} more" if len(others) > len(shown) else ""
            text += f"; also ended on {', '.join(shown)}{more}"
        tail = self.tails.get(first.node.instance_id, "").strip()
        if tail:
            text += "\n--- last output of " + first.label + " ---\n" + tail
        return text


def batches(nodes: list[Node], size: int = MAX_INSTANCES_PER_COMMAND) -> list[list[Node]]:
    return [nodes[start : start + size] for start in range(0, len(nodes), size)]


def software_of(text: str) -> str | None:
    """The node-software line's values, as one comparable string (None when absent)."""
    match = SOFTWARE_LINE.search(text)
    if match is None:
        return None
    return f"version={match['version']} launch-template-version={match['lt']} ami={match['ami']}"


def describe_groups(groups: dict[str, list[Invocation]], limit: int = 8) -> str:
    """`62 nodes run A; node 5 (...), node 7 (...) run B`: the largest group is counted,
    every node of the others is named."""
    ordered = sorted(groups.items(), key=lambda item: -len(item[1]))
    parts = []
    for index, (software, invs) in enumerate(ordered):
        if index == 0 and len(invs) > 1:
            who = f"{len(invs)} nodes"
        else:
            labels = [inv.label for inv in invs]
            who = ", ".join(labels[:limit])
            if len(labels) > limit:
                who += f" and {len(labels) - limit} more"
        verb = "runs" if len(invs) == 1 else "run"
        parts.append(f"{who} {verb} {software}")
    return "; ".join(parts)


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
        give_up_after: float = DEFAULT_GIVE_UP_AFTER,
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
        self.give_up_after = give_up_after
        self._outputs: StackOutputs | None = None
        self._trouble_since: float | None = None
        self._trouble_reason = ""

    # ------------------------------------------------------------ transient errors
    def patiently(self, action: str, call: Callable[[], T], *, hint: str = "") -> T | None:
        """Runs call(); a transient error (throttling, a time-out, an expired SSO session)
        returns None so that the caller polls again, until such errors have lasted
        give_up_after seconds without a good answer in between. Anything else raises."""
        try:
            value = call()
        except (ClientError, BotoCoreError, TransientAwsError) as error:
            reason = (
                error.reason if isinstance(error, TransientAwsError) else transient_reason(error)
            )
            if reason is None:
                raise cluster_error(action, error) from None
            now = self.clock()
            if self._trouble_since is None:
                self._trouble_since = now
            waited = now - self._trouble_since
            if waited >= self.give_up_after:
                raise ClusterError(
                    f"gave up {action} after {waited:.0f} s of AWS errors (last: {reason})"
                    f"{'; ' + hint if hint else ''}"
                ) from None
            if reason != self._trouble_reason:
                self.out(
                    f"{reason} while {action}; trying again for up to {self.give_up_after:.0f} s"
                )
                self._trouble_reason = reason
            return None
        if self._trouble_since is not None:
            self.out("AWS answers again")
        self._trouble_since = None
        self._trouble_reason = ""
        return value

    def persist(self, action: str, call: Callable[[], T], *, hint: str = "") -> T:
        """Runs call() until it answers, riding out transient errors as `patiently` does."""
        while True:
            value = self.patiently(action, call, hint=hint)
            if value is not None:
                return value
            self.sleep(self.poll_interval)

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
                        tags = {t["Key"]: t["Value"] for t in instance.get("Tags", [])}
                        nodes.append(
                            Node(
                                instance_id=instance["InstanceId"],
                                address=instance["PrivateIpAddress"],
                                zone=instance.get("Placement", {}).get("AvailabilityZone", ""),
                                state=state,
                                launch_time=instance.get("LaunchTime"),
                                image_id=instance.get("ImageId", ""),
                                launch_template_version=tags.get(LAUNCH_TEMPLATE_VERSION_TAG, ""),
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
            nodes, starting = self.persist("listing the nodes", self.running_nodes)
            status = self.persist(
                "reading the nodes' SSM status", functools.partial(self.ssm_status, nodes)
            )
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
    def send(
        self, name: str, nodes: list[Node], parameters: dict[str, str], comment: str
    ) -> list[Sent]:
        """Sends the document to every node: one SendCommand per batch of at most 50 nodes,
        each with the same parameters (the full host list, so every node finds its rank).

        Batches of explicit instance IDs rather than Targets by tag: a tag also matches a node
        that is starting or being replaced, which is not in the host list the ranks come from.
        If a later batch cannot be sent, the batches already sent are cancelled: half a job
        must not run.
        """
        document = load(name)
        document.check(parameters)
        outputs = self.outputs()
        groups = batches(nodes)
        # The batches of one send share a comment with a token of their own (so `logs` finds
        # them together, and not a later run's batches), then ` part i/k`.
        token = f" #{secrets.token_hex(3)}" if len(groups) > 1 else ""
        sent: list[Sent] = []
        for index, group in enumerate(groups, start=1):
            part = f"{token} part {index}/{len(groups)}" if len(groups) > 1 else ""
            try:
                with aws_errors(f"sending {name}"):
                    response = self.clients.ssm.send_command(
                        DocumentName=outputs.document(name),
                        InstanceIds=[n.instance_id for n in group],
                        Parameters={key: [value] for key, value in parameters.items()},
                        Comment=(comment[: 100 - len(part)] + part),
                        TimeoutSeconds=600,
                        MaxConcurrency=str(len(group)),
                        MaxErrors=str(len(group)),
                        CloudWatchOutputConfig={
                            "CloudWatchLogGroupName": outputs["TrainingLogGroupName"],
                            "CloudWatchOutputEnabled": True,
                        },
                    )
            except ClusterError:
                self.cancel(sent, reason=f"{name} could not be sent to every node")
                raise
            sent.append(Sent(response["Command"]["CommandId"], tuple(group)))
        ids = ", ".join(s.command_id for s in sent)
        self.out(f"{name}: command{'s' if len(sent) > 1 else ''} {ids} sent to {len(nodes)} nodes")
        return sent

    def cancel(self, sent: list[Sent], *, reason: str, running: set[str] | None = None) -> None:
        """Cancels every sent command (on the `running` instance IDs only, when given)."""
        for command in sent:
            ids = [n.instance_id for n in command.nodes]
            if running is not None:
                ids = [i for i in ids if i in running]
                if not ids:
                    continue
            self.out(f"cancelling command {command.command_id} on {len(ids)} nodes: {reason}")
            self.persist(
                "cancelling the command",
                functools.partial(
                    self.clients.ssm.cancel_command, CommandId=command.command_id, InstanceIds=ids
                ),
            )

    def follow(
        self, name: str, sent: list[Sent], nodes: list[Node], *, stream_rank: int | None = None,
        hint: str = "",
    ) -> CommandResult:  # fmt: skip
        """Polls every node's invocation until all have ended.

        When one node fails, the others get failure_grace seconds to end on their own
        (torchrun on the survivors normally fails too), then the command is cancelled on
        them, so that a broken job never keeps the cluster busy. A node that ended its leg
        at the time limit (status 75) is not a failure: the others are saving too.
        """
        command_of = {n.instance_id: s.command_id for s in sent for n in s.nodes}
        result = CommandResult(
            name,
            [s.command_id for s in sent],
            [
                Invocation(rank, node, command_of[node.instance_id])
                for rank, node in enumerate(nodes)
            ],
        )
        stream = (
            _LogFollower(self, command_of[nodes[stream_rank].instance_id], nodes[stream_rank])
            if stream_rank is not None
            else None
        )
        hint = hint or (
            f"command {result.command_id} keeps running on the nodes: see `cluster.py status`"
        )
        first_failure: float | None = None
        cancelled = False
        while True:
            for command in sent:
                statuses = self.patiently(
                    "following the command", functools.partial(self._statuses, command), hint=hint
                )
                if statuses is None:
                    continue
                for inv in result.invocations:
                    if inv.command_id != command.command_id or inv.status in TERMINAL:
                        continue
                    status = statuses.get(inv.node.instance_id, inv.status)
                    if status in TERMINAL and not self._details(inv, hint):
                        continue  # the details come on the next poll
                    if status != inv.status:
                        inv.status = status
                        code = f" (exit status {inv.response_code})" if status in TERMINAL else ""
                        self.out(f"{name}: {inv.label}: {status}{code}")
                    if inv.status in TERMINAL:
                        inv.finished_at = self.clock()
                        bad = inv.status != "Success" and not inv.leg_ended
                        if bad and first_failure is None:
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
                self.cancel(
                    sent,
                    reason=f"still running {self.failure_grace:.0f} s after the first failure",
                    running={inv.node.instance_id for inv in running},
                )
                cancelled = True
            self.sleep(self.poll_interval)
        if stream is not None:
            stream.poll()
        if result.failed and not result.leg_ended:
            # The summary shows the output of the first node to fail (usually the cause).
            first = result.failed[0]
            result.tails[first.node.instance_id] = self.output_tail(first.command_id, first)
        return result

    def _statuses(self, command: Sent) -> dict[str, str]:
        """Every invocation's status of one command: ListCommandInvocations, all pages (an
        invocation not listed yet, right after SendCommand, keeps its status)."""
        statuses: dict[str, str] = {}
        paginator = self.clients.ssm.get_paginator("list_command_invocations")
        for page in paginator.paginate(CommandId=command.command_id):
            for invocation in page["CommandInvocations"]:
                statuses[invocation["InstanceId"]] = invocation.get("Status", "Pending")
        return statuses

    def _details(self, inv: Invocation, hint: str) -> bool:
        """Reads an ended invocation's exit status and output (the first 24,000 characters)."""
        response = self.patiently(
            "reading a node's result",
            lambda: self.clients.ssm.get_command_invocation(
                CommandId=inv.command_id, InstanceId=inv.node.instance_id
            ),
            hint=hint,
        )
        if response is None:
            return False
        inv.response_code = int(response.get("ResponseCode", -1))
        inv.stdout = response.get("StandardOutputContent", "")
        inv.stderr = response.get("StandardErrorContent", "")
        return True

    def log_streams(self, log_group: str, prefix: str) -> list[str]:
        """Names of the log streams under prefix (DescribeLogStreams, all pages)."""
        names: list[str] = []
        paginator = self.clients.logs.get_paginator("describe_log_streams")
        for page in paginator.paginate(logGroupName=log_group, logStreamNamePrefix=prefix):
            names.extend(stream["logStreamName"] for stream in page["logStreams"])
        return sorted(names)

    def output_tail(self, command_id: str, inv: Invocation) -> str:
        """The last lines a node wrote: from CloudWatch Logs (the whole output), else from
        the invocation (SSM keeps only its first 24,000 characters)."""
        lines: list[str] = []
        log_group = self.outputs()["TrainingLogGroupName"]
        try:
            streams = self.log_streams(log_group, f"{command_id}/{inv.node.instance_id}/")
            for stream in reversed(streams):
                events = self.clients.logs.get_log_events(
                    logGroupName=log_group,
                    logStreamName=stream,
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
        hint: str = "",
    ) -> CommandResult:
        sent = self.send(name, nodes, parameters, comment)
        try:
            return self.follow(name, sent, nodes, stream_rank=stream_rank, hint=hint)
        except KeyboardInterrupt:
            ids = ", ".join(s.command_id for s in sent)
            raise ClusterError(
                f"stopped following command {ids}; it keeps running on the nodes "
                "(see `cluster.py status`, `cluster.py logs`, `cluster.py stop`)"
            ) from None

    # --------------------------------------------------------------- operations
    @staticmethod
    def hosts(nodes: list[Node]) -> str:
        return ",".join(n.address for n in nodes)

    def preflight(self, nodes: list[Node] | None = None, *, port: str = "29600") -> CommandResult:
        """Runs Preflight on every node; when it passes, refuses nodes that run different
        software (contract C3)."""
        nodes = nodes or self.wait_for_nodes()
        self.out(f"preflight on {len(nodes)} nodes, master {nodes[0].address}")
        result = self.run(
            "Preflight",
            nodes,
            {"Hosts": self.hosts(nodes), "Port": port},
            f"{self.cluster_name} preflight",
        )
        if result.ok:
            self.check_software(result)
        return result

    def check_software(self, result: CommandResult) -> None:
        """Every node must report the same node-software line (version, launch-template
        version, AMI); a node without one runs node scripts older than the others."""
        groups: dict[str, list[Invocation]] = {}
        for inv in result.invocations:
            software = software_of(inv.stdout) or self._software_from_logs(inv)
            groups.setdefault(software or MISSING_SOFTWARE, []).append(inv)
        if len(groups) == 1:
            (software,) = groups
            if software == MISSING_SOFTWARE:
                self.out("software: no node reports it (node scripts older than this CLI)")
            else:
                self.out(f"software: {software} on all {len(result.invocations)} nodes")
            return
        raise ClusterError(
            f"the nodes run different software: {describe_groups(groups)}: roll the fleet "
            "so that every node runs the group's current launch template "
            "(`cluster.py roll`, see the README)"
        )

    def _software_from_logs(self, inv: Invocation) -> str | None:
        """The node-software line from CloudWatch Logs, when the invocation's output (its
        first 24,000 characters) does not hold it."""
        try:
            response = self.clients.logs.filter_log_events(
                logGroupName=self.outputs()["TrainingLogGroupName"],
                logStreamNamePrefix=f"{inv.command_id}/{inv.node.instance_id}/",
                filterPattern='"node-software:"',
            )
        except (ClientError, BotoCoreError):
            return None
        for event in response.get("events", []):
            found = software_of(event.get("message", ""))
            if found:
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
        parameters = {
            "JobId": job_id,
            "MasterPort": master_port,
            "NprocPerNode": nproc_per_node,
            "Steps": steps,
            "TrainArgs": join_train_args(train_args),
        }
        labels = {
            "JobId": "--job-id",
            "MasterPort": "--master-port",
            "NprocPerNode": "--nproc-per-node",
            "Steps": "--steps",
            "TrainArgs": "train arguments",
        }
        load("Precompile").check(parameters, labels)
        nodes = self.wait_for_nodes()
        parameters["Hosts"] = self.hosts(nodes)
        return self.run("Precompile", nodes, parameters, f"{job_id} precompile")

    def stop(self, job_id: str) -> CommandResult:
        """Runs StopTraining on the online nodes, then cancels whatever command of the job
        SSM still runs (every batch of it), so nothing of the job is left running."""
        load("StopTraining").check({"JobId": job_id}, {"JobId": "--job-id"})
        nodes = self.wait_for_nodes(require_all=False)
        result = self.run("StopTraining", nodes, {"JobId": job_id}, f"{job_id} stop")
        for command in self.active_commands(job_id=job_id):
            self.out(
                f"cancelling {command['Document']} command {command['CommandId']} of job {job_id}"
            )
            with aws_errors("cancelling the job's commands"):
                self.clients.ssm.cancel_command(CommandId=command["CommandId"])
        return result

    def active_commands(
        self,
        *,
        job_id: str | None = None,
        documents: tuple[str, ...] = ("RunTraining", "Precompile"),
    ) -> list[dict[str, Any]]:
        """RunTraining and Precompile commands SSM still runs (of job_id, when given). An
        invocation runs for at most 48 hours, so only the last 49 hours are searched."""
        outputs = self.outputs()
        since = (datetime.now(UTC) - timedelta(hours=49)).strftime("%Y-%m-%dT%H:%M:%SZ")
        found: list[dict[str, Any]] = []
        with aws_errors("listing running commands"):
            paginator = self.clients.ssm.get_paginator("list_commands")
            for name in documents:
                for page in paginator.paginate(
                    Filters=[
                        {"key": "DocumentName", "value": outputs.document(name)},
                        {"key": "InvokedAfter", "value": since},
                    ]
                ):
                    for command in page["Commands"]:
                        if command.get("Status") not in ACTIVE_COMMAND:
                            continue
                        job = command.get("Parameters", {}).get("JobId", [""])[0]
                        if job_id is None or job == job_id:
                            found.append({**command, "Document": name, "JobId": job})
        return found

    # ------------------------------------------------------------- inspection
    def reported_software(self) -> dict[str, str]:
        """Each instance's SOFTWARE_VERSION as the latest Preflight (every batch of it)
        reported it (contract C3), from the first 2,500 characters of its output."""
        with aws_errors("listing Preflight commands"):
            commands = self.clients.ssm.list_commands(
                Filters=[{"key": "DocumentName", "value": self.outputs().document("Preflight")}],
                MaxResults=10,
            )["Commands"]
        if not commands:
            return {}
        oldest = datetime.min.replace(tzinfo=UTC)
        newest = max(commands, key=lambda c: c.get("RequestedDateTime") or oldest)

        def attempt(command: dict[str, Any]) -> str:
            return str(command.get("Comment", "")).rsplit(" part ", 1)[0]

        found: dict[str, str] = {}
        with aws_errors("reading the latest preflight"):
            paginator = self.clients.ssm.get_paginator("list_command_invocations")
            for command in commands:
                if command is not newest and attempt(command) != attempt(newest):
                    continue
                for page in paginator.paginate(CommandId=command["CommandId"], Details=True):
                    for invocation in page["CommandInvocations"]:
                        text = "\n".join(
                            plugin.get("Output", "")
                            for plugin in invocation.get("CommandPlugins", [])
                        )
                        match = SOFTWARE_LINE.search(text)
                        if match:
                            found[invocation["InstanceId"]] = match["version"]
        return found

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

    def _commands(self, document: str) -> list[dict[str, Any]]:
        with aws_errors("listing commands"):
            paginator = self.clients.ssm.get_paginator("list_commands")
            return [
                command
                for page in paginator.paginate(
                    Filters=[{"key": "DocumentName", "value": self.outputs().document(document)}]
                )
                for command in page["Commands"]
            ]

    @staticmethod
    def _latest_attempt(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The newest command and the other batches sent with it (same comment, token
        included, but for the ` part i/k` suffix)."""
        oldest = datetime.min.replace(tzinfo=UTC)
        newest = max(mine, key=lambda c: c.get("RequestedDateTime") or oldest)

        def attempt(command: dict[str, Any]) -> str:
            return str(command.get("Comment", "")).rsplit(" part ", 1)[0]

        if " part " not in str(newest.get("Comment", "")):
            return [newest]
        return [c for c in mine if attempt(c) == attempt(newest)]

    def latest_command_details(
        self, job_id: str, document: str = "RunTraining"
    ) -> list[dict[str, Any]]:
        """The commands (every batch) of the job's latest attempt, as ListCommands gives them."""
        mine = [
            c for c in self._commands(document) if c.get("Parameters", {}).get("JobId") == [job_id]
        ]
        if not mine:
            raise ClusterError(f"no {document} command found for job {job_id}")
        return self._latest_attempt(mine)

    def latest_commands(self, job_id: str, document: str = "RunTraining") -> list[str]:
        """The command IDs of the job's latest attempt (every batch of it)."""
        return [c["CommandId"] for c in self.latest_command_details(job_id, document)]

    def latest_commands_by_job(self, document: str = "RunTraining") -> dict[str, dict[str, Any]]:
        """Each job's newest command (the first batch of its latest attempt)."""
        by_job: dict[str, list[dict[str, Any]]] = {}
        for command in self._commands(document):
            job = command.get("Parameters", {}).get("JobId", [""])[0]
            by_job.setdefault(job, []).append(command)
        return {job: self._latest_attempt(mine)[0] for job, mine in by_job.items() if job}

    def commands_ended(self, command_ids: list[str]) -> dict[str, str] | None:
        """Each command's status when all have ended, else None (also on a transient error)."""
        statuses: dict[str, str] = {}
        for command_id in command_ids:
            response = self.patiently(
                "reading the command's status",
                functools.partial(self.clients.ssm.list_commands, CommandId=command_id),
            )
            if response is None or not response["Commands"]:
                return None
            statuses[command_id] = response["Commands"][0].get("Status", "")
        if all(status not in ACTIVE_COMMAND for status in statuses.values()):
            return statuses
        return None

    # ------------------------------------------------------------- fleet roll
    def launch_template(self) -> dict[str, str]:
        """The group's current launch template: ID, version number and AMI."""
        group_name = self.outputs()["AutoScalingGroupName"]
        with aws_errors(f"reading Auto Scaling group {group_name}"):
            groups = self.clients.autoscaling.describe_auto_scaling_groups(
                AutoScalingGroupNames=[group_name]
            )["AutoScalingGroups"]
        if not groups:
            raise ClusterError(
                f"Auto Scaling group {group_name} does not exist: deploy the compute stack"
            )
        spec = groups[0].get("LaunchTemplate") or {}
        # The group names its template by ID or by name (Auto Scaling API reference,
        # LaunchTemplateSpecification); DescribeLaunchTemplateVersions takes either.
        which = {
            key: spec[key] for key in ("LaunchTemplateId", "LaunchTemplateName") if spec.get(key)
        }
        if not which:
            raise ClusterError(f"Auto Scaling group {group_name} has no launch template")
        with aws_errors("reading the launch template"):
            # "$Latest" / "$Default" resolve to a number here; ResolveAlias shows the AMI an
            # image parameter ("resolve:ssm:...") stands for.
            versions = self.clients.ec2.describe_launch_template_versions(
                **dict(list(which.items())[:1]),
                Versions=[str(spec.get("Version", "$Default"))],
                ResolveAlias=True,
            )["LaunchTemplateVersions"]
        current = versions[0] if versions else {}
        return {
            "id": str(current.get("LaunchTemplateId") or next(iter(which.values()))),
            "version": str(current.get("VersionNumber", spec.get("Version", ""))),
            "ami": str(current.get("LaunchTemplateData", {}).get("ImageId", "")),
        }

    def _refresh(self) -> dict[str, Any]:
        return self.active_refresh() or {}

    def active_refresh(self) -> dict[str, Any] | None:
        """The group's instance refresh that may still replace nodes, if any."""
        group_name = self.outputs()["AutoScalingGroupName"]
        with aws_errors("reading the group's instance refreshes"):
            refreshes = self.clients.autoscaling.describe_instance_refreshes(
                AutoScalingGroupName=group_name
            )["InstanceRefreshes"]
        for refresh in refreshes:
            if refresh.get("Status") in ACTIVE_REFRESH:
                return dict(refresh)
        return None

    def wait_for_refresh(self) -> None:
        """A job is never sent while an instance refresh may replace its nodes."""
        deadline = self.clock() + self.wait_timeout
        last = ""
        while (refresh := self.persist("reading instance refreshes", self._refresh)) != {}:
            problem = (
                f"instance refresh {refresh.get('InstanceRefreshId')} of group "
                f"{self.outputs()['AutoScalingGroupName']} is replacing nodes "
                f"({refresh.get('Status')}, {refresh.get('PercentageComplete', 0)}% done): "
                "wait for it (`cluster.py roll --wait`)"
            )
            if self.clock() >= deadline:
                raise ClusterError(problem)
            if problem != last:
                self.out(f"waiting: {problem}")
                last = problem
            self.sleep(self.poll_interval)

    def roll(self, *, force: bool = False, wait: bool = False) -> str:
        """Replaces the nodes that do not run the group's current launch template, through an
        Auto Scaling instance refresh; refused while a job runs unless forced."""
        group_name = self.outputs()["AutoScalingGroupName"]
        busy = self.active_commands()
        if busy and not force:
            names = ", ".join(
                f"{c['Document']} of job {c['JobId']} (command {c['CommandId']})" for c in busy
            )
            raise ClusterError(
                f"not rolling the fleet while {names} runs: it would lose its nodes; wait for "
                "it to end, stop it with `cluster.py stop --job-id ID`, or pass --force"
            )
        if busy:
            self.out(f"--force: rolling the fleet although {len(busy)} commands still run")
        try:
            with aws_errors(f"starting an instance refresh of {group_name}"):
                response = self.clients.autoscaling.start_instance_refresh(
                    AutoScalingGroupName=group_name,
                    Strategy="Rolling",
                    # SkipMatching keeps nodes that already run the current template. No job
                    # runs, and a job needs every node, so all others are replaced at once
                    # (MinHealthyPercentage 0); terminate-then-launch (MaxHealthyPercentage
                    # 100) fits a capacity reservation sized to the cluster.
                    Preferences={
                        "SkipMatching": True,
                        "MinHealthyPercentage": 0,
                        "MaxHealthyPercentage": 100,
                    },
                )
        except ClusterError as error:
            if "InstanceRefreshInProgress" in str(error):
                raise ClusterError(
                    f"an instance refresh of {group_name} is already running: follow it with "
                    "`cluster.py roll --wait` once it ends, or in the Auto Scaling console"
                ) from None
            raise
        refresh_id: str = response["InstanceRefreshId"]
        self.out(f"instance refresh {refresh_id} of group {group_name} started")
        if wait:
            self.follow_refresh(refresh_id)
        return refresh_id

    def follow_refresh(self, refresh_id: str) -> None:
        group_name = self.outputs()["AutoScalingGroupName"]
        last = ""
        while True:
            response = self.patiently(
                "following the instance refresh",
                lambda: self.clients.autoscaling.describe_instance_refreshes(
                    AutoScalingGroupName=group_name, InstanceRefreshIds=[refresh_id]
                ),
                hint=f"instance refresh {refresh_id} goes on",
            )
            refresh = (response or {}).get("InstanceRefreshes", [{}])[0] if response else {}
            status = refresh.get("Status", "")
            done = refresh.get("PercentageComplete", 0)
            line = f"instance refresh {refresh_id}: {status}, {done}% done"
            if response is not None and line != last:
                self.out(line)
                last = line
            if status == "Successful":
                return
            if status in REFRESH_DONE:
                raise ClusterError(
                    f"instance refresh {refresh_id} ended {status}: "
                    f"{refresh.get('StatusReason', 'no reason given')}"
                )
            self.sleep(self.poll_interval)

    # ------------------------------------------------------------- FSx export
    def export(self, *, timeout: float) -> dict[str, Any]:
        """Exports the file system's new and changed files to S3 through its data repository
        associations (an EXPORT_TO_REPOSITORY task) and waits for it (contract C6)."""
        values = self.outputs().values
        missing = [key for key in EXPORT_OUTPUTS if not values.get(key)]
        if missing:
            raise ClusterError(
                f"stack {self.stack_name} lacks the outputs {', '.join(missing)}: redeploy it "
                "from this version of the project"
            )
        file_system = values["FileSystemId"]
        paths = [p.strip() for p in values["ExportPaths"].split(",") if p.strip()]
        # CreateDataRepositoryTask wants export paths relative to the mount point ("path1"
        # for /mnt/fsx/path1; botocore's fsx model, CreateDataRepositoryTask Paths); none at
        # all exports the whole file system.
        relative = [p.strip("/") for p in paths]
        kwargs: dict[str, Any] = {}
        if relative and all(relative):
            kwargs["Paths"] = relative
        try:
            with aws_errors(f"starting the export of {file_system}"):
                task = self.clients.fsx.create_data_repository_task(
                    Type="EXPORT_TO_REPOSITORY",
                    FileSystemId=file_system,
                    Report={"Enabled": False},
                    **kwargs,
                )["DataRepositoryTask"]
        except ClusterError as error:
            if "DataRepositoryTaskExecuting" in str(error):
                raise ClusterError(
                    f"another data repository task runs on {file_system}: wait for it to end "
                    "(`aws fsx describe-data-repository-tasks`), then export again"
                ) from None
            raise
        task_id = task["TaskId"]
        self.out(f"export task {task_id} started: {', '.join(paths) or '/'} of {file_system} to S3")
        deadline = self.clock() + timeout
        hint = (
            f"export task {task_id} goes on: "
            f"`aws fsx describe-data-repository-tasks --task-ids {task_id}`"
        )
        last = ""
        while True:
            response = self.patiently(
                "following the export",
                lambda: self.clients.fsx.describe_data_repository_tasks(TaskIds=[task_id]),
                hint=hint,
            )
            if response is not None:
                task = response["DataRepositoryTasks"][0]
                lifecycle = task.get("Lifecycle", "")
                status = task.get("Status", {})
                line = (
                    f"export task {task_id}: {lifecycle}, {status.get('SucceededCount', 0)} of "
                    f"{status.get('TotalCount', 0)} files exported, "
                    f"{status.get('FailedCount', 0)} failed"
                )
                if line != last:
                    self.out(line)
                    last = line
                if lifecycle == "SUCCEEDED":
                    if status.get("FailedCount", 0):
                        raise ClusterError(
                            f"export task {task_id} ended with {status['FailedCount']} files not "
                            "exported: check them before destroying the storage stack"
                        )
                    return dict(task)
                if lifecycle in EXPORT_DONE:
                    reason = task.get("FailureDetails", {}).get("Message", "no reason given")
                    raise ClusterError(f"export task {task_id} {lifecycle}: {reason}")
            if self.clock() >= deadline:
                raise ClusterError(
                    f"export task {task_id} still runs after {timeout:.0f} s; {hint}"
                )
            self.sleep(self.poll_interval)


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
            for name in self.cluster.log_streams(self.log_group, self.prefix):
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
