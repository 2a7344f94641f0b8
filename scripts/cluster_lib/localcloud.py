"""A local stand-in for the AWS side of a cluster, for the rehearsal and its tests.

The operator CLI's own code (scripts/cluster_lib/: `Cluster` and `Jobs`: `train`, `preflight`,
`stop`, `logs`) runs against real botocore clients whose calls are answered here instead of
by AWS: a `before-call` handler returns the response, after botocore has validated the
request against the service model, so paginators, waiters of our own and error handling all
run as they do against AWS. Behind the calls stand rehearsal nodes (network namespaces) with
a node agent each (scripts/cluster_lib/local_agent.py) that runs the real SSM documents,
parameters checked with Go's regexp and substituted as the SSM agent does, commands run with
`sh` in the agent's environment, SIGKILL to the process group on cancel and on
executionTimeout, output capped at 24,000 characters. The rehearsal differs from AWS only in
how commands are delivered.

Served: CloudFormation DescribeStacks; EC2 DescribeInstances; Auto Scaling
DescribeAutoScalingGroups, SetInstanceHealth (an Unhealthy node is replaced); SSM
SendCommand, ListCommands, ListCommandInvocations, GetCommandInvocation, CancelCommand,
DescribeInstanceInformation; CloudWatch Logs DescribeLogStreams, GetLogEvents,
FilterLogEvents; SNS Publish (kept in `notifications`). Step Functions calls pass through to
moto, where the job supervisor's state machine runs (scripts/cluster_lib/local_supervisor.py).
Any other call fails with a clear error.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.cluster_lib import REPO_ROOT, ClusterError
from scripts.cluster_lib.documents import DOCUMENT_NAMES, Document, load
from scripts.cluster_lib.rehearsal import NetnsHosts, _tagged_pids
from scripts.cluster_lib.ssm_agent import (
    MAX_STDERR_LENGTH,
    MAX_STDOUT_LENGTH,
    MAX_TIMEOUT_SECONDS,
    agent_environment,
    go_check,
    substitute,
)

#: SendCommand InstanceIds: "Array Members: Maximum number of 50 items" (SSM API reference).
MAX_INSTANCE_IDS = 50
ACTIVE = ("Pending", "InProgress", "Cancelling", "Delayed")
REGION = "us-east-1"
#: Services the stand-in leaves to whatever else answers botocore's calls: Step Functions is
#: moto's, with its ASL interpreter (scripts/cluster_lib/local_supervisor.py).
PASSED_THROUGH = {"stepfunctions"}
ZONE = "us-east-1a"
NEURON_VENV = "/opt/aws_neuronx_venv_pytorch_2_9"
INSTALL_ROOT = "/opt/trainium-cluster"
TAG_KEY = "trainium-cluster:cluster"
ROLE_TAG = "trainium-cluster:role"
LAUNCH_TEMPLATE_VERSION_TAG = "aws:ec2launchtemplate:version"

# Fake Neuron and EFA tools, installed at their DLAMI paths inside each node. neuron-ls
# reports one device whose cores are "in use" by the trainers running in this node's network
# namespace, as the real one lists the processes that hold NeuronCores.
FAKE_NEURON_LS = r"""#!/bin/sh
[ "$1" = -j ] || { echo "neuron-ls (rehearsal): only -j is supported" >&2; exit 2; }
echo "WARNING: rehearsal node: no real Neuron device" >&2
own=$(readlink /proc/self/ns/net)
busy=""
for dir in /proc/[0-9]*; do
  [ "$(readlink "$dir/ns/net" 2>/dev/null)" = "$own" ] || continue
  cmd=$(tr '\0' ' ' < "$dir/cmdline" 2>/dev/null) || continue
  case $cmd in
    *train.py*) busy="$busy{\"pid\": ${dir#/proc/}, \"command\": \"train.py\"}," ;;
  esac
done
busy=${busy%,}
printf '[{"neuron_device": 0, "bdf": "00:1e.0", "nc_count": %s, ' "__CORES__"
printf '"memory_size": 34359738368, "neuron_processes": [%s]}]\n' "$busy"
"""
FAKE_NCCOM_TEST = """#!/bin/sh
case $1 in
  allr|allg|redsct|sendrecv|alltoall) ;;
  *) echo "nccom-test (rehearsal): the operation comes first, got '$1'" >&2; exit 2 ;;
esac
echo "Avg bus bandwidth: 1.0GB/s (rehearsal)"
"""
FAKE_FI_INFO = """#!/bin/sh
echo "provider: efa"
echo "    fabric: efa"
echo "    domain: rdmap0s0-rdm"
"""
FAKE_LSMOD = """#!/bin/sh
echo "Module                  Size  Used by"
echo "neuron                462848  0"
"""
FAKE_DMESG = """#!/bin/sh
echo "[    1.000000] neuron: driver loaded (rehearsal node)"
"""


def _now() -> datetime:
    return datetime.now(UTC)


class LocalError(Exception):
    """An AWS error response: code and message, as a service would send them."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


@dataclass
class Instance:
    slot: int
    instance_id: str
    address: str
    root: Path
    state: str = "running"
    launched: datetime = field(default_factory=_now)
    agent: subprocess.Popen[bytes] | None = None
    health: str = "Healthy"

    @property
    def spool(self) -> Path:
        return self.root / "spool"

    def online(self) -> bool:
        return self.state == "running" and self.agent is not None and self.agent.poll() is None


@dataclass
class Invocation:
    command_id: str
    instance: Instance
    folder: Path
    requested: datetime
    delivered: bool = False
    failure: str = ""  # the agent refused the command (parameter validation)

    def status(self) -> dict[str, Any]:
        if self.failure:
            return {"status": "Failed", "details": "Failed", "code": 1}
        path = self.folder / "status.json"
        if not path.is_file():
            if self.instance.state != "running":
                # The agent died with its node; SSM reports it when delivery times out.
                return {"status": "TimedOut", "details": "DeliveryTimedOut", "code": -1}
            return {"status": "Pending", "details": "Pending", "code": -1}
        state: dict[str, Any] = json.loads(path.read_text())
        if state["status"] == "InProgress" and self.instance.state != "running":
            return {"status": "TimedOut", "details": "ExecutionTimedOut", "code": -1}
        if state["status"] == "InProgress" and (self.instance.spool / "cancel" / self.key).exists():
            return {"status": "Cancelling", "details": "Cancelling", "code": -1}
        state.setdefault("details", state["status"])
        return state

    @property
    def key(self) -> str:
        return f"{self.command_id}-{self.instance.instance_id}"

    def output(self, name: str) -> str:
        path = self.folder / name
        if self.failure:
            return "" if name == "stdout" else self.failure
        return path.read_text(errors="replace") if path.is_file() else ""


@dataclass
class Command:
    command_id: str
    document: str
    parameters: dict[str, list[str]]
    comment: str
    requested: datetime
    log_group: str
    invocations: dict[str, Invocation]
    step: str


class LocalCloud:
    """The cluster's AWS side on this machine; `clients()` gives the CLI its boto3 clients."""

    def __init__(
        self,
        hosts: NetnsHosts,
        output: Path,
        *,
        cluster_name: str = "rehearsal",
        cores_per_node: int = 1,
        node_settings: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.hosts = hosts
        self.output = output.resolve()
        self.cluster_name = cluster_name
        self.cores_per_node = cores_per_node
        self.python = python
        self.jobs = self.output / "jobs"
        self.jobs.mkdir(parents=True, exist_ok=True)
        self.documents: dict[str, Document] = {}
        #: Lines every node's cluster.env gets after the rehearsal's own (launch.sh exports
        #: them to the job), e.g. TRAINIUM_HOLD_AFTER_STEP (workload/stop.py).
        self.node_settings = node_settings or {}
        for name in DOCUMENT_NAMES:
            self.documents[f"{cluster_name}-{name}"] = load(name)
        self.commands: dict[str, Command] = {}
        self.health_reports: list[tuple[str, str]] = []
        self.notifications: list[dict[str, str]] = []
        #: Outputs added to the operations stack's, e.g. the local job supervisor's ARN.
        self.extra_outputs: dict[str, str] = {}
        self.region = REGION
        self.calls: list[str] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.instances: list[Instance] = []
        digest = hashlib.sha256()
        for folder in ("scripts/node", "workload"):
            for path in sorted((REPO_ROOT / folder).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    digest.update(path.read_bytes())
        self.software_version = digest.hexdigest()[:16]
        for slot in range(hosts.count):
            self.instances.append(self._launch(slot))

    # ------------------------------------------------------------------ nodes
    def _new_instance_id(self) -> str:
        return f"i-{next(self._ids):017x}"

    def _launch(self, slot: int) -> Instance:
        """Starts a node: its DLAMI-like file system and its agent, in the slot's namespace."""
        instance_id = self._new_instance_id()
        root = self.output / "nodes" / instance_id
        shutil.rmtree(root, ignore_errors=True)
        instance = Instance(slot, instance_id, self.hosts.addresses[slot], root)
        mounts = self._lay_out(instance)
        (root / "mounts.json").write_text(json.dumps(mounts))
        log = (root / "agent.log").open("ab")
        instance.agent = subprocess.Popen(
            self.hosts.command(
                slot,
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    self.python,
                    str(Path(__file__).with_name("local_agent.py")),
                    "--spool",
                    str(instance.spool),
                    "--mounts",
                    str(root / "mounts.json"),
                ],
            ),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while not (instance.spool / "agent.json").is_file():
            if instance.agent.poll() is not None or time.monotonic() > deadline:
                raise ClusterError(
                    f"the rehearsal node agent of {instance_id} did not start: "
                    f"{(root / 'agent.log').read_text().strip()[-500:]}"
                )
            time.sleep(0.1)
        return instance

    def _lay_out(self, instance: Instance) -> list[dict[str, str]]:
        """Writes the node's files into overlay upper folders; returns the mounts."""
        root = instance.root
        mounts: list[dict[str, str]] = []
        uppers = {}
        for target in ("/etc", "/opt", "/var", "/usr/local"):
            name = target.strip("/").replace("/", "-")
            upper, work = root / "upper" / name, root / "work" / name
            upper.mkdir(parents=True)
            work.mkdir(parents=True)
            uppers[target] = upper
            mounts.append(
                {"type": "overlay", "target": target, "upper": str(upper), "work": str(work)}
            )

        def install(target: str, relative: str, text: str, mode: int = 0o755) -> None:
            path = uppers[target] / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            path.chmod(mode)

        install(
            "/opt",
            "aws/neuron/bin/neuron-ls",
            FAKE_NEURON_LS.replace("__CORES__", str(self.cores_per_node)),
        )
        install("/opt", "aws/neuron/bin/nccom-test", FAKE_NCCOM_TEST)
        install("/opt", "amazon/efa/bin/fi_info", FAKE_FI_INFO)
        install("/usr/local", "sbin/lsmod", FAKE_LSMOD)
        install("/usr/local", "sbin/dmesg", FAKE_DMESG)
        settings = {
            "CLUSTER_NAME": self.cluster_name,
            "AWS_REGION": REGION,
            "INSTANCE_TYPE": "trn1.32xlarge",
            "NODE_COUNT": str(self.hosts.count),
            "FSX_MOUNT_POINT": str(self.output),
            "WORKLOAD_DIR": f"{INSTALL_ROOT}/workload",
            "NEURON_VENV": NEURON_VENV,
            "METRICS_NAMESPACE": "TrainiumCluster",
            "SOFTWARE_VERSION": self.software_version,
            "PREFLIGHT_MIN_FREE_GB": "1",
            # Rehearsal nodes share two cores and have no network beyond the bridge.
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": "1",
            **self.node_settings,
        }
        install("/etc", "trainium-cluster/cluster.env",
                "".join(f"{k}={v}\n" for k, v in settings.items()), 0o644)  # fmt: skip
        node_env = {
            "AMI_ID": "ami-0000000000rehearsal",
            "LAUNCH_TEMPLATE_VERSION": "1",
            "SOFTWARE_VERSION": self.software_version,
        }
        install("/etc", "trainium-cluster/node.env",
                "".join(f"{k}={v}\n" for k, v in node_env.items()), 0o644)  # fmt: skip
        install("/var", "lib/trainium-cluster/ready", "ready (rehearsal node)\n", 0o644)
        (uppers["/var"] / "log" / "trainium-cluster").mkdir(parents=True)
        for target in (NEURON_VENV, f"{INSTALL_ROOT}/scripts/node", f"{INSTALL_ROOT}/workload"):
            (uppers["/opt"] / target.removeprefix("/opt/")).mkdir(parents=True, exist_ok=True)
        venv = Path(self.python).parent.parent
        mounts += [
            {"type": "bind", "source": str(venv), "target": NEURON_VENV},
            {"type": "bind", "source": str(REPO_ROOT / "scripts" / "node"),
             "target": f"{INSTALL_ROOT}/scripts/node"},
            {"type": "bind", "source": str(REPO_ROOT / "workload"),
             "target": f"{INSTALL_ROOT}/workload"},
        ]  # fmt: skip
        return mounts

    def node_pids(self, slot: int) -> list[int]:
        return self.hosts.pids(slot)

    def terminate(self, instance: Instance) -> None:
        """The instance goes away: every process in its namespace dies, the agent too."""
        instance.state = "terminated"
        self.hosts.kill(instance.slot)
        if instance.agent is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                instance.agent.wait(timeout=10)

    def close(self) -> None:
        for instance in self.instances:
            if instance.state == "running":
                self.terminate(instance)

    def __enter__(self) -> LocalCloud:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def group_name(self) -> str:
        """The Auto Scaling group's name, as the stacks name it (ClusterConfig)."""
        return f"{self.cluster_name}-workers"

    def running(self) -> list[Instance]:
        return [i for i in self.instances if i.state == "running"]

    def instance(self, instance_id: str) -> Instance | None:
        return next((i for i in self.instances if i.instance_id == instance_id), None)

    # --------------------------------------------------------------- clients
    def session(self) -> Any:
        """A boto3 Session whose clients this stand-in answers (for `cluster.main(session=)`)."""
        import boto3

        session = boto3.Session(
            aws_access_key_id="rehearsal", aws_secret_access_key="rehearsal", region_name=REGION
        )
        session.events.register("before-parameter-build.*.*", self._keep_params)
        session.events.register("before-call.*.*", self._answer)
        return session

    def clients(self) -> Any:
        """The CLI's Clients, built by its own factory, answered by this stand-in."""
        from scripts.cluster_lib.clients import Clients

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
        handler: Callable[[dict[str, Any]], dict[str, Any]] | None = getattr(
            self, f"_{service.replace('-', '_')}_{operation}", None
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
        from scripts.cluster_lib.outputs import EXPORT_OUTPUTS, REQUIRED_OUTPUTS

        values = {
            "ClusterName": self.cluster_name,
            "ClusterTagKey": TAG_KEY,
            "NodeCount": str(self.hosts.count),
            "InstanceType": "trn1.32xlarge",
            "AutoScalingGroupName": self.group_name,
            "TrainingLogGroupName": f"/trainium-cluster/{self.cluster_name}/training",
            "FileSystemId": "fs-0000000rehearsal",
            "ExportPaths": "/jobs",
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
                    "CreationTime": _now(),
                    "Outputs": outputs,
                }
            ]
        }

    # ------------------------------------------------------------------- EC2
    def _ec2_DescribeInstances(self, params: dict[str, Any]) -> dict[str, Any]:
        filters = {f["Name"]: set(f["Values"]) for f in params.get("Filters", [])}
        wanted_ids = set(params.get("InstanceIds", []))
        found = []
        for instance in self.instances:
            tags = {
                TAG_KEY: self.cluster_name,
                ROLE_TAG: "worker",
                LAUNCH_TEMPLATE_VERSION_TAG: "1",
                "aws:autoscaling:groupName": self.group_name,
            }
            state = instance.state
            if wanted_ids and instance.instance_id not in wanted_ids:
                continue
            if "instance-state-name" in filters and state not in filters["instance-state-name"]:
                continue
            if any(
                name.startswith("tag:") and tags.get(name[4:]) not in values
                for name, values in filters.items()
            ):
                continue
            found.append(
                {
                    "InstanceId": instance.instance_id,
                    "InstanceType": "trn1.32xlarge",
                    "ImageId": "ami-0000000000rehearsal",
                    "PrivateIpAddress": instance.address,
                    "Placement": {"AvailabilityZone": ZONE},
                    "State": {"Name": state},
                    "LaunchTime": instance.launched,
                    "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
                }
            )
        return {"Reservations": [{"Instances": found}] if found else []}

    # ---------------------------------------------------------- Auto Scaling
    def _autoscaling_DescribeAutoScalingGroups(self, params: dict[str, Any]) -> dict[str, Any]:
        name = self.group_name
        template = {"LaunchTemplateName": f"{self.cluster_name}-node", "Version": "1"}
        names = params.get("AutoScalingGroupNames") or [name]
        if name not in names:
            return {"AutoScalingGroups": []}
        return {
            "AutoScalingGroups": [
                {
                    "AutoScalingGroupName": name,
                    "MinSize": self.hosts.count,
                    "MaxSize": self.hosts.count,
                    "DesiredCapacity": self.hosts.count,
                    "DefaultCooldown": 300,
                    "AvailabilityZones": [ZONE],
                    "HealthCheckType": "EC2",
                    "CreatedTime": _now(),
                    "LaunchTemplate": template,
                    "Instances": [
                        {
                            "InstanceId": i.instance_id,
                            "AvailabilityZone": ZONE,
                            "LifecycleState": "InService",
                            "HealthStatus": i.health,
                            "ProtectedFromScaleIn": False,
                            "LaunchTemplate": template,
                        }
                        for i in self.running()
                    ],
                }
            ]
        }

    def _autoscaling_DescribeInstanceRefreshes(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"InstanceRefreshes": []}

    def _autoscaling_SetInstanceHealth(self, params: dict[str, Any]) -> dict[str, Any]:
        instance = self.instance(params["InstanceId"])
        if instance is None or instance.state != "running":
            raise LocalError("ValidationError", f"Instance Id not found - {params['InstanceId']}")
        self.health_reports.append((instance.instance_id, params["HealthStatus"]))
        if params["HealthStatus"] == "Unhealthy":
            # The group terminates the node and launches a replacement in its place.
            self.terminate(instance)
            self.instances.append(self._launch(instance.slot))
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

    # ------------------------------------------------------------------- SSM
    def _ssm_DescribeInstanceInformation(self, params: dict[str, Any]) -> dict[str, Any]:
        wanted: set[str] = set()
        for item in params.get("Filters", []) or []:
            if item["Key"] == "InstanceIds":
                wanted |= set(item["Values"])
        infos = [
            {
                "InstanceId": i.instance_id,
                "PingStatus": "Online" if i.online() else "ConnectionLost",
                "PlatformType": "Linux",
                "IPAddress": i.address,
            }
            for i in self.instances
            if (not wanted or i.instance_id in wanted) and i.state == "running"
        ]
        return {"InstanceInformationList": infos}

    def _ssm_SendCommand(self, params: dict[str, Any]) -> dict[str, Any]:
        ids = list(params.get("InstanceIds", []))
        if len(ids) > MAX_INSTANCE_IDS:
            raise LocalError(
                "ValidationException",
                f"1 validation error detected: Value at 'instanceIds' failed to satisfy "
                f"constraint: Member must have length less than or equal to {MAX_INSTANCE_IDS}",
            )
        if params.get("Targets"):
            raise LocalError("UnsupportedOperation", "the local stand-in takes InstanceIds only")
        document = self.documents.get(params["DocumentName"])
        if document is None:
            raise LocalError("InvalidDocument", f"document {params['DocumentName']} does not exist")
        given = {k: v for k, v in (params.get("Parameters") or {}).items()}
        unknown = set(given) - set(document.parameters)
        if unknown:
            raise LocalError("InvalidParameters", f"unknown parameters {sorted(unknown)}")
        values: dict[str, str] = {}
        for name, parameter in document.parameters.items():
            if name in given:
                values[name] = given[name][0] if given[name] else ""
            elif parameter.default is not None:
                values[name] = parameter.default
            else:
                raise LocalError("InvalidParameters", f"parameter {name} is required")
        # The agent's checks: Go's regexp on allowedPattern, then minChars/maxChars.
        names = list(document.parameters)
        errors = go_check(
            [
                {
                    "pattern": document.parameters[n].allowed_pattern,
                    "minChars": document.parameters[n].min_chars,
                    "maxChars": document.parameters[n].max_chars,
                    "value": values[n],
                }
                for n in names
            ]
        )
        refusal = next((e for e in errors if e), "")
        step = document.content["mainSteps"][0]
        script = "\n".join(substitute(line, values) for line in step["inputs"]["runCommand"])
        timeout_text = substitute(str(step["inputs"].get("timeoutSeconds", "3600")), values)
        try:
            timeout = min(int(timeout_text), MAX_TIMEOUT_SECONDS)
        except ValueError:
            refusal = refusal or f"timeoutSeconds {timeout_text!r} is not a number"
            timeout = 3600
        command_id = f"{next(self._ids):08x}-0000-4000-8000-{int(time.time()):012x}"
        output_config = params.get("CloudWatchOutputConfig") or {}
        now = _now()
        command = Command(
            command_id=command_id,
            document=params["DocumentName"],
            parameters={k: [v] for k, v in values.items()},
            comment=params.get("Comment", ""),
            requested=now,
            log_group=output_config.get("CloudWatchLogGroupName", ""),
            invocations={},
            step=step["name"],
        )
        for instance_id in ids:
            instance = self.instance(instance_id)
            if instance is None:
                raise LocalError("InvalidInstanceId", f"instance {instance_id} is not valid")
            folder = instance.root / "orchestration" / command_id / step["name"]
            invocation = Invocation(command_id, instance, folder, now)
            command.invocations[instance_id] = invocation
            if refusal:
                invocation.failure = refusal + "\n"
                continue
            if instance.state != "running":
                continue
            env = agent_environment(instance.instance_id, REGION)
            spec = {"id": invocation.key, "script": script, "env": env, "timeout": timeout,
                    "dir": str(folder)}  # fmt: skip
            commands = instance.spool / "commands"
            partial = commands / f"{invocation.key}.json.tmp"
            partial.write_text(json.dumps(spec))
            partial.replace(commands / f"{invocation.key}.json")
        self.commands[command_id] = command
        return {"Command": self._command_view(command)}

    def _command_view(self, command: Command) -> dict[str, Any]:
        statuses = [inv.status()["status"] for inv in command.invocations.values()]
        if any(s in ("Pending", "InProgress", "Cancelling") for s in statuses):
            status = "Cancelling" if "Cancelling" in statuses else "InProgress"
            if all(s == "Pending" for s in statuses):
                status = "Pending"
        elif all(s == "Success" for s in statuses):
            status = "Success"
        elif any(s == "Cancelled" for s in statuses):
            status = "Cancelled"
        elif any(s == "TimedOut" for s in statuses):
            status = "TimedOut"
        else:
            status = "Failed"
        return {
            "CommandId": command.command_id,
            "DocumentName": command.document,
            "Comment": command.comment,
            "Parameters": command.parameters,
            "InstanceIds": list(command.invocations),
            "RequestedDateTime": command.requested,
            "Status": status,
            "StatusDetails": status,
            "TargetCount": len(statuses),
            "CompletedCount": sum(
                s not in ("Pending", "InProgress", "Cancelling") for s in statuses
            ),
            "ErrorCount": sum(s in ("Failed", "TimedOut") for s in statuses),
            "CloudWatchOutputConfig": {
                "CloudWatchLogGroupName": command.log_group,
                "CloudWatchOutputEnabled": bool(command.log_group),
            },
        }

    def _command(self, command_id: str) -> Command:
        command = self.commands.get(command_id)
        if command is None:
            raise LocalError("InvalidCommandId", f"command {command_id} does not exist")
        return command

    @staticmethod
    def _page(items: list[Any], params: dict[str, Any], default: int = 50) -> tuple[list[Any], str]:
        start = int(params.get("NextToken") or 0)
        size = int(params.get("MaxResults") or default)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    def _ssm_ListCommands(self, params: dict[str, Any]) -> dict[str, Any]:
        commands = sorted(self.commands.values(), key=lambda c: c.requested, reverse=True)
        if params.get("CommandId"):
            commands = [self._command(params["CommandId"])]
        if params.get("InstanceId"):
            commands = [c for c in commands if params["InstanceId"] in c.invocations]
        views = [self._command_view(c) for c in commands]
        for item in params.get("Filters", []) or []:
            key, value = item["key"], item["value"]
            if key == "DocumentName":
                views = [v for v in views if v["DocumentName"] == value]
            elif key == "Status":
                views = [v for v in views if v["Status"] == value]
            elif key == "ExecutionStage":
                active = {"Pending", "InProgress", "Cancelling"}
                views = [v for v in views if (v["Status"] in active) == (value == "Executing")]
            elif key in ("InvokedAfter", "InvokedBefore"):
                # The form the SSM API reference (CommandFilter, value) gives:
                # "2024-07-07T00:00:00Z"; anything else is refused here rather than guessed.
                try:
                    moment = datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
                except ValueError:
                    raise LocalError(
                        "InvalidFilterValue", f"{key} {value!r} is not like 2024-07-07T00:00:00Z"
                    ) from None
                views = [
                    v for v in views
                    if (v["RequestedDateTime"] >= moment) == (key == "InvokedAfter")
                ]  # fmt: skip
        page, token = self._page(views, params)
        result: dict[str, Any] = {"Commands": page}
        if token:
            result["NextToken"] = token
        return result

    def _invocation_view(self, command: Command, inv: Invocation, details: bool) -> dict[str, Any]:
        state = inv.status()
        view: dict[str, Any] = {
            "CommandId": command.command_id,
            "InstanceId": inv.instance.instance_id,
            "DocumentName": command.document,
            "Comment": command.comment,
            "RequestedDateTime": inv.requested,
            "Status": state["status"],
            "StatusDetails": state["details"],
        }
        if details:
            view["CommandPlugins"] = [
                {
                    "Name": command.step,
                    "Status": state["status"],
                    "StatusDetails": state["details"],
                    "ResponseCode": int(state.get("code", -1)),
                    "Output": inv.output("stdout")[:2500],
                }
            ]
        return view

    def _ssm_ListCommandInvocations(self, params: dict[str, Any]) -> dict[str, Any]:
        commands = (
            [self._command(params["CommandId"])]
            if params.get("CommandId")
            else sorted(self.commands.values(), key=lambda c: c.requested, reverse=True)
        )
        views = [
            self._invocation_view(c, inv, bool(params.get("Details")))
            for c in commands
            for instance_id, inv in c.invocations.items()
            if not params.get("InstanceId") or params["InstanceId"] == instance_id
        ]
        page, token = self._page(views, params)
        result: dict[str, Any] = {"CommandInvocations": page}
        if token:
            result["NextToken"] = token
        return result

    def _ssm_GetCommandInvocation(self, params: dict[str, Any]) -> dict[str, Any]:
        command = self.commands.get(params["CommandId"])
        inv = command.invocations.get(params["InstanceId"]) if command else None
        if command is None or inv is None:
            raise LocalError("InvocationDoesNotExist", "the invocation does not exist")
        state = inv.status()
        ended = state["status"] not in ("Pending", "InProgress", "Cancelling", "Delayed")
        stdout = inv.output("stdout") if ended else ""
        stderr = inv.output("stderr") if ended else ""
        return {
            "CommandId": command.command_id,
            "InstanceId": inv.instance.instance_id,
            "DocumentName": command.document,
            "PluginName": command.step,
            "ResponseCode": int(state.get("code", -1)),
            "Status": state["status"],
            "StatusDetails": state["details"],
            # The agent keeps the first 24,000 / 8,000 characters (appconfig/constants.go).
            "StandardOutputContent": stdout[:MAX_STDOUT_LENGTH],
            "StandardErrorContent": stderr[:MAX_STDERR_LENGTH],
            "CloudWatchOutputConfig": {
                "CloudWatchLogGroupName": command.log_group,
                "CloudWatchOutputEnabled": bool(command.log_group),
            },
        }

    def _ssm_CancelCommand(self, params: dict[str, Any]) -> dict[str, Any]:
        command = self._command(params["CommandId"])
        for instance_id in params.get("InstanceIds") or list(command.invocations):
            inv = command.invocations.get(instance_id)
            if inv is not None and inv.instance.state == "running":
                (inv.instance.spool / "cancel" / inv.key).touch()
        return {}

    def cancel(self, command_id: str, instance_id: str) -> None:
        """What the console's Cancel command does, for one node."""
        with self._lock:
            self._ssm_CancelCommand({"CommandId": command_id, "InstanceIds": [instance_id]})

    # ------------------------------------------------------------ CloudWatch Logs
    def _streams(self, group: str) -> dict[str, Path]:
        """Log streams the agent writes with CloudWatchOutputEnabled:
        <command-id>/<instance-id>/<step>/stdout|stderr."""
        streams = {}
        for command in self.commands.values():
            if command.log_group != group:
                continue
            for instance_id, inv in command.invocations.items():
                for name in ("stdout", "stderr"):
                    if (inv.folder / name).is_file():
                        key = f"{command.command_id}/{instance_id}/{command.step}/{name}"
                        streams[key] = inv.folder / name
        return streams

    def _logs_DescribeLogStreams(self, params: dict[str, Any]) -> dict[str, Any]:
        prefix = params.get("logStreamNamePrefix", "")
        names = sorted(n for n in self._streams(params["logGroupName"]) if n.startswith(prefix))
        start = int(params.get("nextToken") or 0)
        size = int(params.get("limit") or 50)
        views = [{"logStreamName": n, "creationTime": 0} for n in names[start : start + size]]
        result: dict[str, Any] = {"logStreams": views}
        if start + size < len(names):
            result["nextToken"] = str(start + size)
        return result

    @staticmethod
    def _events(path: Path) -> list[dict[str, Any]]:
        stamp = int(path.stat().st_mtime * 1000)
        lines = path.read_text(errors="replace").splitlines()
        return [{"timestamp": stamp, "message": line, "ingestionTime": stamp} for line in lines]

    def _logs_GetLogEvents(self, params: dict[str, Any]) -> dict[str, Any]:
        path = self._streams(params["logGroupName"]).get(params["logStreamName"])
        if path is None:
            raise LocalError(
                "ResourceNotFoundException", "The specified log stream does not exist."
            )
        events = self._events(path)
        token = params.get("nextToken") or ""
        if token.startswith("f/"):
            start = int(token[2:])
        elif params.get("startFromHead"):
            start = 0
        else:
            start = max(0, len(events) - int(params.get("limit") or 10000))
        page = events[start:]
        if params.get("limit"):
            page = page[: int(params["limit"])]
        end = start + len(page)
        return {
            "events": page,
            "nextForwardToken": f"f/{end}",
            "nextBackwardToken": f"b/{start}",
        }

    def _logs_FilterLogEvents(self, params: dict[str, Any]) -> dict[str, Any]:
        streams = self._streams(params["logGroupName"])
        names = params.get("logStreamNames")
        prefix = params.get("logStreamNamePrefix", "")
        events = []
        for name, path in sorted(streams.items()):
            if (names and name not in names) or not name.startswith(prefix):
                continue
            events += [{**e, "logStreamName": name, "eventId": f"{name}-{i}"}
                       for i, e in enumerate(self._events(path))]  # fmt: skip
        start = int(params.get("nextToken") or 0)
        size = int(params.get("limit") or 10000)
        result: dict[str, Any] = {"events": events[start : start + size]}
        if start + size < len(events):
            result["nextToken"] = str(start + size)
        return result


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


def job_processes(job_id: str) -> list[int]:
    """PIDs on this machine tagged with the job (any node), zombies left out: what must be
    gone after a cancel or a stop."""
    return [pid for pid in _tagged_pids(job_id, None) if _alive(pid)]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
