"""A local stand-in for the AWS side of a cluster, for the rehearsal and its tests.

The operator CLI's own code (scripts/cluster_lib/: `Cluster` and `Jobs`: `train`, `preflight`,
`stop`, `logs`) runs against real botocore clients whose calls are answered here instead of
by AWS: a `before-call` handler returns the response, after botocore has validated the
request against the service model, so paginators, waiters of our own and error handling all
run as they do against AWS. Behind the calls stand rehearsal nodes (network namespaces,
instances.py) with a node agent each (node_agent.py) that runs the real SSM documents,
parameters checked with Go's regexp and substituted as the SSM agent does, commands run with
`sh` in the agent's environment, SIGKILL to the process group on cancel and on
executionTimeout, output capped at 24,000 characters. The rehearsal differs from AWS only in
how commands are delivered. Every answer is checked against botocore's output shape for its
operation before the caller sees it (`validate_answer`, as botocore's Stubber checks).

Served here: CloudFormation DescribeStacks; EC2 DescribeInstances, DescribeTags,
DescribeNetworkInterfaces; Auto Scaling DescribeAutoScalingGroups, DescribeAutoScalingInstances,
DescribeInstanceRefreshes, SetInstanceHealth (an Unhealthy node is replaced),
UpdateAutoScalingGroup and CompleteLifecycleAction (a node that a scale-in takes waits in
Terminating:Wait under the group's termination hook: lifecycle_hooks.py); SNS Publish (kept in
`notifications`). Served by the parts beside this file: SSM SendCommand, ListCommands,
ListCommandInvocations, GetCommandInvocation, CancelCommand, DescribeInstanceInformation
(ssm_stand_in.py); CloudWatch Logs DescribeLogStreams, GetLogEvents, FilterLogEvents
(logs_stand_in.py); S3 HeadObject, PutObject, ListObjectsV2 on the data bucket, whose objects
are the files under the rehearsal's /fsx/data (s3_stand_in.py). Step Functions calls pass
through to moto,
where the job supervisor's state machine runs (supervisor.py). Any other call fails with a
clear error.
"""

from __future__ import annotations

import contextlib
import itertools
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import Clients
from scripts.cluster_lib.documents import DOCUMENT_NAMES, load
from scripts.cluster_lib.outputs import EXPORT_OUTPUTS, REQUIRED_OUTPUTS
from scripts.rehearsal import ec2_shapes
from scripts.rehearsal.hosts import NetnsHosts
from scripts.rehearsal.instances import (
    IMAGE_ID,
    INSTANCE_TYPE,
    REGION,
    ZONE,
    Instance,
    Instances,
    now,
)
from scripts.rehearsal.lifecycle_hooks import TerminatingNodes, TerminationHook
from scripts.rehearsal.logs_stand_in import LogsStandIn
from scripts.rehearsal.s3_stand_in import S3StandIn
from scripts.rehearsal.sessions import stand_in_session
from scripts.rehearsal.ssm_stand_in import LocalError, SsmStandIn
from stacks.config import CLUSTER_TAG_KEY

#: Services the stand-in leaves to whatever else answers botocore's calls: Step Functions is
#: moto's, with its ASL interpreter (supervisor.py), and so are DynamoDB (the job queue) and SQS
#: (the supervisor's wake queue: wake.py).
PASSED_THROUGH = {"stepfunctions", "dynamodb", "sqs"}
TAG_KEY = CLUSTER_TAG_KEY  # the nodes' tags as the compute stack writes them
ROLE_TAG = "trainium-cluster:role"
LAUNCH_TEMPLATE_VERSION_TAG = "aws:ec2launchtemplate:version"


#: The DescribeInstances filters the stand-in answers (besides tag:<key>).
KNOWN_INSTANCE_FILTERS = frozenset({"instance-id", "instance-state-name"})
#: The DescribeNetworkInterfaces filters it answers.
KNOWN_INTERFACE_FILTERS = frozenset(
    {"attachment.instance-id", "attachment.device-index", "interface-type"}
)
#: The DescribeTags filters it answers, and its MaxResults' bounds (EC2 API reference).
KNOWN_TAG_FILTERS = frozenset({"resource-type", "key", "value"})
TAG_PAGE_MIN, TAG_PAGE_MAX = 5, 1000
#: DescribeAutoScalingInstances: at most 50 InstanceIds and MaxRecords (Auto Scaling API
#: reference); an ID that does not exist "is ignored with no error".
AUTO_SCALING_INSTANCES_MAX = 50


class StandInAnswerError(Exception):
    """An answer of the stand-in's that the service's model does not allow: a fault of the
    stand-in, never an AWS error (no code a caller could catch as one)."""


def validate_answer(operation: Any, body: dict[str, Any]) -> None:
    """Checks a stand-in's answer against botocore's output shape for the operation, as
    botocore's Stubber checks the responses it is given (botocore/stub.py,
    _validate_operation_response: botocore.validate.ParamValidator on the output shape; with
    no output shape, the answer must be empty). Every answer the stand-ins give (SSM,
    CloudWatch Logs, EC2, Auto Scaling, SNS, CloudFormation, the scale rehearsal's fleet)
    passes here, so none can carry a member, a type or a value the service never sends."""
    from botocore.validate import ParamValidator

    shape = operation.output_shape
    name = f"{operation.service_model.service_name} {operation.name}"
    if shape is None:
        if body:
            raise StandInAnswerError(f"the stand-in answered {name} with {sorted(body)}: none")
        return
    report = ParamValidator().validate(body, shape)
    if report.has_errors():
        raise StandInAnswerError(
            f"the stand-in's answer to {name} is not what botocore's model allows: "
            f"{report.generate_report()}"
        )


class LocalCloud:
    """The cluster's AWS side on this machine; `clients()` gives the CLI its boto3 clients."""

    #: The nodes a scale-in took, in Terminating:Wait (None: the group has no such hook). A
    #: class default too: the tests that measure single answers make a LocalCloud without
    #: __init__.
    terminating: TerminatingNodes | None = None
    #: The supervisor's wake rules (wake.py WakeRules) while its state machine runs here.
    wake: Any = None

    def __init__(
        self,
        hosts: NetnsHosts,
        output: Path,
        *,
        cluster_name: str = "rehearsal",
        cores_per_node: int = 1,
        node_settings: dict[str, str] | None = None,
        python: str = sys.executable,
        instances: type[Instances] = Instances,
        termination_hook: TerminationHook | None = None,
    ) -> None:
        """`instances` makes the nodes: the rehearsal's (namespaces, an agent each) or the
        scale rehearsal's simulated ones (fleet.py). `termination_hook`: the group's, from the
        synthesized compute template (lifecycle_hooks.termination_hook); without one a
        scale-in terminates its nodes at once, as a group without a hook does."""
        self.hosts = hosts
        self.output = output.resolve()
        self.cluster_name = cluster_name
        self.jobs = self.output / "jobs"
        self.jobs.mkdir(parents=True, exist_ok=True)
        documents = {f"{cluster_name}-{name}": load(name) for name in DOCUMENT_NAMES}
        self.health_reports: list[tuple[str, str]] = []
        self.notifications: list[dict[str, str]] = []
        #: Outputs added to the operations stack's, e.g. the local job supervisor's ARN.
        self.extra_outputs: dict[str, str] = {}
        self.region = REGION
        self.calls: list[str] = []
        #: When each call came (time.monotonic()), in the order of `calls`.
        self.call_times: list[float] = []
        #: One counter of IDs for the instances and the commands.
        ids = itertools.count(1)
        self._lock = threading.Lock()
        #: Held while an API answer is made: what changes under it, no answer sees half of.
        self.answering = self._lock
        self.instances = instances(
            hosts, self.output, ids, cluster_name=cluster_name, cores_per_node=cores_per_node,
            node_settings=node_settings or {}, python=python,
        )  # fmt: skip
        self.software_version = self.instances.software_version
        self.ssm = SsmStandIn(self.instances, documents, ids)
        self.ssm.tags = self._tags
        #: The group's size once UpdateAutoScalingGroup set it (None: node_count, as deployed).
        self.desired: int | None = None
        self.terminating = (
            None
            if termination_hook is None
            else TerminatingNodes(termination_hook, self._terminate, self._lock)
        )
        self.commands = self.ssm.commands
        self.logs = LogsStandIn(self.ssm)
        #: Who answers each service's calls (its methods `_<service>_<Operation>`); this
        #: object answers the services not named here.
        #: The data bucket, whose objects are the files under the rehearsal's /fsx/data.
        self.data_bucket = f"{cluster_name}-data"
        self.s3 = S3StandIn(self.data_bucket, self.output / "data")
        self._services: dict[str, object] = {"ssm": self.ssm, "logs": self.logs, "s3": self.s3}
        #: CloudWatch GetMetricData, once the job supervisor runs (supervisor.py: it needs the
        #: operations stack's metric filters).
        self.metrics: Any = None

    def close(self) -> None:
        if self.terminating is not None:
            self.terminating.close()
        self.instances.close()

    def __enter__(self) -> LocalCloud:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def group_name(self) -> str:
        """The Auto Scaling group's name, as the stacks name it (ClusterConfig)."""
        return f"{self.cluster_name}-workers"

    def running(self) -> list[Instance]:
        return self.instances.running()

    def lifecycle_state(self, instance: Instance) -> str:
        """The node's Auto Scaling lifecycle state (Auto Scaling API reference, Instance)."""
        waiting = self.terminating is not None and instance.instance_id in self.terminating
        return "Terminating:Wait" if waiting else "InService"

    def in_service(self) -> list[Instance]:
        return [i for i in self.running() if self.lifecycle_state(i) == "InService"]

    def _terminate(self, instance_id: str) -> None:
        instance = self.instances.instance(instance_id)
        if instance is not None and instance.state == "running":
            self.instances.terminate(instance)

    def cancel(self, command_id: str, instance_id: str) -> None:
        """What the console's Cancel command does, for one node."""
        with self._lock:
            self.ssm.cancel(command_id, instance_id)

    # --------------------------------------------------------------- clients
    def session(self) -> Any:
        """A boto3 Session whose clients this stand-in answers (for `cluster.main(session=)`)."""
        session = stand_in_session("rehearsal", REGION)
        session.events.register("before-parameter-build.*.*", self._keep_params)
        session.events.register("before-call.*.*", self._answer)
        return session

    def client(self, service: str) -> Any:
        """This stand-in's client for `service`, made once: a test that polls every fraction
        of a second asks for the same client each time (botocore clients are thread safe)."""
        cache: dict[str, Any] = self.__dict__.setdefault("_client_cache", {})
        with self._lock:
            if service not in cache:
                cache[service] = self.session().client(service)
            return cache[service]

    def clients(self) -> Clients:
        """The CLI's Clients, built by its own factory, answered by this stand-in."""
        return Clients.from_session(self.session())

    @staticmethod
    def _keep_params(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        context["local_params"] = dict(params)

    def _answer(self, model: Any, context: dict[str, Any], **_: Any) -> tuple[Any, dict[str, Any]]:
        from botocore.awsrequest import AWSResponse

        service = model.service_model.service_name
        if service in PASSED_THROUGH:
            return None  # type: ignore[return-value]
        operation = model.name
        params = context.get("local_params", {})
        self.calls.append(f"{service}.{operation}")
        self.call_times.append(time.monotonic())
        handler: Callable[[dict[str, Any]], dict[str, Any]] | None = getattr(
            self._services.get(service, self), f"_{service.replace('-', '_')}_{operation}", None
        )
        metadata = {"RequestId": "rehearsal", "HTTPStatusCode": 200, "HTTPHeaders": {}}
        try:
            if handler is None:
                raise LocalError(
                    "UnsupportedOperation",
                    f"the local stand-in does not serve {service} {operation}",
                )
            with self._lock:
                body = handler(params)
            validate_answer(model, body)
        except LocalError as error:
            metadata["HTTPStatusCode"] = error.status
            parsed = {
                "Error": {"Code": error.code, "Message": error.message},
                "ResponseMetadata": metadata,
            }
            return AWSResponse("https://rehearsal.local", error.status, {}, None), parsed
        body["ResponseMetadata"] = metadata
        return AWSResponse("https://rehearsal.local", 200, {}, None), body

    # ------------------------------------------------------------ CloudFormation
    def stack_outputs(self) -> dict[str, str]:
        values = {
            "ClusterName": self.cluster_name,
            "ClusterTagKey": TAG_KEY,
            "NodeCount": str(self.hosts.count),
            "InstanceType": INSTANCE_TYPE,
            "AutoScalingGroupName": self.group_name,
            "TrainingLogGroupName": f"/trainium-cluster/{self.cluster_name}/training",
            "FileSystemId": "fs-0000000rehearsal",
            "ExportPaths": "/jobs",
            "DataBucketName": self.data_bucket,
        }
        for name in DOCUMENT_NAMES:
            values[f"{name}DocumentName"] = f"{self.cluster_name}-{name}"
        for key in (*REQUIRED_OUTPUTS, *EXPORT_OUTPUTS):
            values.setdefault(key, f"rehearsal-{key}")
        values.update(self.extra_outputs)
        return values

    def _cloudformation_DescribeStacks(self, params: dict[str, Any]) -> dict[str, Any]:
        name = params.get("StackName", "")
        if name != f"{self.cluster_name}-operations":
            raise LocalError("ValidationError", f"Stack with id {name} does not exist")
        outputs = [{"OutputKey": k, "OutputValue": v} for k, v in self.stack_outputs().items()]
        return {
            "Stacks": [
                {
                    "StackName": name,
                    "StackStatus": "CREATE_COMPLETE",
                    "CreationTime": now(),
                    "Outputs": outputs,
                }
            ]
        }

    # ------------------------------------------------------------------- EC2
    def _tags(self) -> dict[str, str]:
        return {
            TAG_KEY: self.cluster_name,
            ROLE_TAG: "worker",
            LAUNCH_TEMPLATE_VERSION_TAG: "1",
            "aws:autoscaling:groupName": self.group_name,
        }

    def _interfaces(self, instance: Instance) -> list[dict[str, Any]]:
        """Every network interface of the node, one per entry of the launch template's
        NetworkInterfaces (ec2_shapes.launch_template_interfaces), as EC2 lists them."""
        return [
            ec2_shapes.network_interface(
                instance.instance_id,
                instance.address,
                entry,
                zone=ZONE,
                region=REGION,
                launched=instance.launched,
            )
            for entry in ec2_shapes.launch_template_interfaces(INSTANCE_TYPE)
        ]

    @staticmethod
    def _filters(params: dict[str, Any], known: frozenset[str]) -> dict[str, set[str]]:
        """The call's filters; EC2 refuses a filter it does not know rather than ignoring it,
        and so does the stand-in for a filter it does not implement (EC2 API reference,
        Filter.N), instead of matching everything."""
        filters = {f["Name"]: set(f["Values"]) for f in params.get("Filters", [])}
        for name in filters:
            if name not in known and not name.startswith("tag:"):
                raise LocalError("InvalidParameterValue", f"The filter '{name}' is invalid")
        return filters

    def _ec2_DescribeInstances(self, params: dict[str, Any]) -> dict[str, Any]:
        filters = self._filters(params, KNOWN_INSTANCE_FILTERS)
        wanted_ids = set(params.get("InstanceIds", []))
        tags = self._tags()
        found = []
        for instance in self.instances.instances:
            state = instance.state
            if wanted_ids and instance.instance_id not in wanted_ids:
                continue
            if "instance-state-name" in filters and state not in filters["instance-state-name"]:
                continue
            if "instance-id" in filters and instance.instance_id not in filters["instance-id"]:
                continue
            if any(
                name.startswith("tag:") and tags.get(name[4:]) not in values
                for name, values in filters.items()
            ):
                continue
            found.append(
                ec2_shapes.instance(
                    instance_id=instance.instance_id,
                    instance_type=INSTANCE_TYPE,
                    image_id=IMAGE_ID,
                    state=state,
                    zone=ZONE,
                    region=REGION,
                    launched=instance.launched,
                    interfaces=self._interfaces(instance),
                    tags=tags,
                )
            )
        return {"Reservations": [{"Instances": found}] if found else []}

    def _ec2_DescribeTags(self, params: dict[str, Any]) -> dict[str, Any]:
        """The instances' tags, every instance the stand-in launched (a terminated one keeps its
        tags for a while on EC2 too), in pages of MaxResults (5 to 1000, EC2 API reference,
        DescribeTags; without it, every entry)."""
        filters = self._filters(params, KNOWN_TAG_FILTERS)
        limit = params.get("MaxResults")
        if limit is not None and not TAG_PAGE_MIN <= limit <= TAG_PAGE_MAX:
            raise LocalError(
                "InvalidParameterValue",
                f"Value ( {limit} ) for parameter maxResults is invalid. Expecting a value "
                f"between {TAG_PAGE_MIN} and {TAG_PAGE_MAX}.",
            )
        found = [
            {"Key": key, "ResourceId": instance.instance_id, "ResourceType": "instance",
             "Value": value}
            for instance in self.instances.instances
            for key, value in self._tags().items()
            if "instance" in filters.get("resource-type", {"instance"})
            and key in filters.get("key", {key})
            and value in filters.get("value", {value})
        ]  # fmt: skip
        start = int(params.get("NextToken") or 0)
        if limit is None:
            return {"Tags": found[start:]}
        page = found[start : start + limit]
        if start + limit < len(found):
            return {"Tags": page, "NextToken": str(start + limit)}
        return {"Tags": page}

    def _ec2_DescribeNetworkInterfaces(self, params: dict[str, Any]) -> dict[str, Any]:
        filters = self._filters(params, KNOWN_INTERFACE_FILTERS)
        found = []
        for instance in self.running():
            if "attachment.instance-id" in filters and (
                instance.instance_id not in filters["attachment.instance-id"]
            ):
                continue
            for interface in self._interfaces(instance):
                index = str(interface["Attachment"]["DeviceIndex"])
                if "attachment.device-index" in filters and (
                    index not in filters["attachment.device-index"]
                ):
                    continue
                if "interface-type" in filters and (
                    interface["InterfaceType"] not in filters["interface-type"]
                ):
                    continue
                found.append(interface)
        return {"NetworkInterfaces": found}

    # ---------------------------------------------------------- Auto Scaling
    def _autoscaling_DescribeAutoScalingGroups(self, params: dict[str, Any]) -> dict[str, Any]:
        name = self.group_name
        template = {"LaunchTemplateName": f"{self.cluster_name}-node", "Version": "1"}
        names = params.get("AutoScalingGroupNames") or [name]
        if name not in names:
            return {"AutoScalingGroups": []}
        size = self.hosts.count if self.desired is None else self.desired
        return {
            "AutoScalingGroups": [
                {
                    "AutoScalingGroupName": name,
                    "MinSize": size,
                    "MaxSize": self.hosts.count,
                    "DesiredCapacity": size,
                    "DefaultCooldown": 300,
                    "AvailabilityZones": [ZONE],
                    "HealthCheckType": "EC2",
                    "CreatedTime": now(),
                    "LaunchTemplate": template,
                    "Instances": [
                        {
                            "InstanceId": i.instance_id,
                            "AvailabilityZone": ZONE,
                            "LifecycleState": self.lifecycle_state(i),
                            "HealthStatus": i.health,
                            "ProtectedFromScaleIn": False,
                            "LaunchTemplate": template,
                        }
                        for i in self.running()
                    ],
                }
            ]
        }

    def _autoscaling_DescribeAutoScalingInstances(self, params: dict[str, Any]) -> dict[str, Any]:
        ids = params.get("InstanceIds") or [i.instance_id for i in self.running()]
        limit = int(params.get("MaxRecords", AUTO_SCALING_INSTANCES_MAX))
        if len(params.get("InstanceIds") or []) > AUTO_SCALING_INSTANCES_MAX or not (
            1 <= limit <= AUTO_SCALING_INSTANCES_MAX
        ):
            raise LocalError("ValidationError", "at most 50 InstanceIds and MaxRecords")
        template = {"LaunchTemplateName": f"{self.cluster_name}-node", "Version": "1"}
        found = [
            {
                "InstanceId": i.instance_id,
                "InstanceType": INSTANCE_TYPE,
                "AutoScalingGroupName": self.group_name,
                "AvailabilityZone": ZONE,
                "LifecycleState": self.lifecycle_state(i),
                "HealthStatus": "HEALTHY" if i.health == "Healthy" else "UNHEALTHY",
                "LaunchTemplate": template,
                "ProtectedFromScaleIn": False,
            }
            for i in self.running()
            if i.instance_id in ids
        ]
        return {"AutoScalingInstances": found[:limit]}

    def _autoscaling_UpdateAutoScalingGroup(self, params: dict[str, Any]) -> dict[str, Any]:
        """A new size (the drain's scale-in): the group terminates the InService nodes beyond
        it; under a termination hook each leaves InService at once and waits, still running,
        in Terminating:Wait (lifecycle_hooks.py)."""
        if params["AutoScalingGroupName"] != self.group_name:
            raise LocalError("ValidationError", f"group {params['AutoScalingGroupName']} not found")
        if "DesiredCapacity" in params:
            self.desired = int(params["DesiredCapacity"])
            for instance in self.in_service()[self.desired :]:
                if self.terminating is None:
                    self.instances.terminate(instance)
                else:
                    self.terminating.wait(instance.instance_id)
        return {}

    def _autoscaling_CompleteLifecycleAction(self, params: dict[str, Any]) -> dict[str, Any]:
        """What termination_watch.sh calls once its node's job stopped: the waiting node is
        terminated now (CONTINUE or ABANDON alike, for a termination hook)."""
        hook, instance_id = params["LifecycleHookName"], params.get("InstanceId", "")
        if (
            self.terminating is None
            or hook != self.terminating.hook.name
            or params["AutoScalingGroupName"] != self.group_name
        ):
            raise LocalError("ValidationError", f"No Lifecycle Hook found named {hook}")
        if not self.terminating.complete(instance_id):
            raise LocalError(
                "ValidationError",
                f"No active Lifecycle Action found with instance ID {instance_id}",
            )
        return {}

    def _autoscaling_DescribeInstanceRefreshes(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"InstanceRefreshes": []}

    def _autoscaling_SetInstanceHealth(self, params: dict[str, Any]) -> dict[str, Any]:
        instance = self.instances.instance(params["InstanceId"])
        if instance is None or instance.state != "running":
            raise LocalError("ValidationError", f"Instance Id not found - {params['InstanceId']}")
        self.health_reports.append((instance.instance_id, params["HealthStatus"]))
        if params["HealthStatus"] == "Unhealthy":
            # The group terminates the node and launches a replacement in its place.
            self.instances.replace(instance)
        return {}

    # ------------------------------------------------------------------- SNS
    def _sns_Publish(self, params: dict[str, Any]) -> dict[str, Any]:
        self.notifications.append(
            {
                "TopicArn": params.get("TopicArn", ""),
                "Subject": params.get("Subject", ""),
                "Message": params["Message"],
            }
        )
        return {"MessageId": f"{len(self.notifications):08x}-0000-4000-8000-000000000000"}


@contextlib.contextmanager
def local_cloud(nodes: int, output: Path, **options: Any) -> Iterator[LocalCloud]:
    """Network namespaces for the nodes and the stand-in behind them; removed afterwards."""
    if not NetnsHosts.available() or shutil.which("unshare") is None:
        raise ClusterError(
            "the Run Command stand-in needs root, iproute2 and util-linux (ip, unshare)"
        )
    hosts = NetnsHosts(nodes)
    try:
        with LocalCloud(hosts, output, **options) as cloud:
            yield cloud
    finally:
        hosts.close()
