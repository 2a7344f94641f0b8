"""The cluster's nodes: which run, which SSM manages, what software they report, and the Auto
Scaling group's launch template and instance refreshes that replace them (`roll`).

Nodes are the running EC2 instances tagged with the cluster's name and the worker role, in
rank order (by private address): the first is the master. Each carries the launch template
version it was launched from (the EC2 tag `aws:ec2launchtemplate:version`) and reports the
software it runs in its preflight output (contract C3).
"""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import Clients, Patience, aws_errors
from scripts.cluster_lib.command_history import CommandHistory, attempt_of, newest
from scripts.cluster_lib.outputs import Stack
from scripts.cluster_lib.spares import spare_count

ROLE_TAG = "trainium-cluster:role"
#: EC2 tags every instance launched from a launch template with the template's ID and the
#: version it was launched from (EC2 user guide, "Launch an instance from a launch template").
LAUNCH_TEMPLATE_VERSION_TAG = "aws:ec2launchtemplate:version"
#: preflight.sh prints one such line per node (contract C3).
SOFTWARE_LINE = re.compile(
    r"^node-software: version=(?P<version>\S*) launch-template-version=(?P<lt>\S*)"
    r" ami=(?P<ami>\S*)\s*$",
    re.MULTILINE,
)
#: Instance refresh statuses (Auto Scaling API reference, InstanceRefresh.Status) during which
#: the group may replace nodes.
ACTIVE_REFRESH = {"Pending", "InProgress", "Cancelling", "RollbackInProgress", "Baking"}
REFRESH_DONE = {"Successful", "Failed", "Cancelled", "RollbackFailed", "RollbackSuccessful"}


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


def hosts(nodes: list[Node]) -> str:
    """The host list the node scripts take (addresses in rank order, comma separated)."""
    return ",".join(n.address for n in nodes)


class Fleet:
    """The cluster's nodes and the Auto Scaling group that keeps them."""

    def __init__(
        self,
        clients: Clients,
        stack: Stack,
        patience: Patience,
        history: CommandHistory,
        *,
        wait_timeout: float,
    ) -> None:
        self.ec2 = clients.ec2
        self.ssm = clients.ssm
        self.autoscaling = clients.autoscaling
        self.stack = stack
        self.patience = patience
        self.history = history
        self.wait_timeout = wait_timeout

    @property
    def group_name(self) -> str:
        return self.stack.outputs()["AutoScalingGroupName"]

    # ------------------------------------------------------------------- nodes
    def running_nodes(self) -> tuple[list[Node], int]:
        """Returns (running nodes in rank order, nodes still starting)."""
        outputs = self.stack.outputs()
        filters = [
            {"Name": f"tag:{outputs['ClusterTagKey']}", "Values": [outputs["ClusterName"]]},
            {"Name": f"tag:{ROLE_TAG}", "Values": ["worker"]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]},
        ]
        nodes, pending = [], 0
        with aws_errors("listing the cluster's instances"):
            for page in self.ec2.get_paginator("describe_instances").paginate(Filters=filters):
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
            paginator = self.ssm.get_paginator("describe_instance_information")
            for page in paginator.paginate(
                Filters=[{"Key": "InstanceIds", "Values": [n.instance_id for n in nodes]}]
            ):
                for info in page["InstanceInformationList"]:
                    status[info["InstanceId"]] = info.get("PingStatus", "Unknown")
        return status

    def wait_for_nodes(self, *, require_all: bool = True) -> list[Node]:
        """Waits until NodeCount nodes and the warm spares (SpareNodes) run and are online in
        SSM; returns them in rank order.

        The first node is the master. With require_all=False returns whatever nodes are
        running and online (for stop).
        """
        outputs = self.stack.outputs()
        expected = outputs.node_count + spare_count(outputs)
        deadline = self.patience.clock() + self.wait_timeout
        last = ""
        while True:
            nodes, starting = self.patience.persist("listing the nodes", self.running_nodes)
            status = self.patience.persist(
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
            last = self._wait_or_give_up(deadline, problem, last)

    def _wait_or_give_up(self, deadline: float, problem: str, last: str) -> str:
        """One more wait for `problem` to clear: raises it past the deadline, says it when it
        is new, sleeps until the next poll. Returns what it said last."""
        if self.patience.clock() >= deadline:
            raise ClusterError(problem)
        if problem != last:
            self.patience.out(f"waiting: {problem}")
        self.patience.pause()
        return problem

    def reported_software(self) -> dict[str, str]:
        """Each instance's SOFTWARE_VERSION as the latest Preflight (every batch of it)
        reported it (contract C3), from the first 2,500 characters of its output."""
        with aws_errors("listing Preflight commands"):
            commands = self.ssm.list_commands(
                Filters=[
                    {"key": "DocumentName", "value": self.stack.outputs().document("Preflight")}
                ],
                MaxResults=10,
            )["Commands"]
        if not commands:
            return {}
        last = newest(commands)
        found: dict[str, str] = {}
        with aws_errors("reading the latest preflight"):
            paginator = self.ssm.get_paginator("list_command_invocations")
            for command in commands:
                if command is not last and attempt_of(command) != attempt_of(last):
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

    # ------------------------------------------------------- the group's template
    def launch_template(self) -> dict[str, str]:
        """The group's current launch template: ID, version number and AMI."""
        group_name = self.group_name
        with aws_errors(f"reading Auto Scaling group {group_name}"):
            groups = self.autoscaling.describe_auto_scaling_groups(
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
            versions = self.ec2.describe_launch_template_versions(
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

    # -------------------------------------------------------- instance refreshes
    def _refresh(self) -> dict[str, Any]:
        return self.active_refresh() or {}

    def active_refresh(self) -> dict[str, Any] | None:
        """The group's instance refresh that may still replace nodes, if any."""
        group_name = self.group_name
        with aws_errors("reading the group's instance refreshes"):
            refreshes = self.autoscaling.describe_instance_refreshes(
                AutoScalingGroupName=group_name
            )["InstanceRefreshes"]
        for refresh in refreshes:
            if refresh.get("Status") in ACTIVE_REFRESH:
                return dict(refresh)
        return None

    def wait_for_refresh(self) -> None:
        """A job is never sent while an instance refresh may replace its nodes."""
        deadline = self.patience.clock() + self.wait_timeout
        last = ""
        while (refresh := self.patience.persist("reading instance refreshes", self._refresh)) != {}:
            problem = (
                f"instance refresh {refresh.get('InstanceRefreshId')} of group "
                f"{self.group_name} is replacing nodes "
                f"({refresh.get('Status')}, {refresh.get('PercentageComplete', 0)}% done): "
                "wait for it (`cluster.py roll --wait`)"
            )
            last = self._wait_or_give_up(deadline, problem, last)

    def roll(self, *, force: bool = False, wait: bool = False) -> str:
        """Replaces the nodes that do not run the group's current launch template, through an
        Auto Scaling instance refresh; refused while a job runs unless forced."""
        group_name = self.group_name
        busy = self.history.active_commands()
        if busy and not force:
            names = ", ".join(
                f"{c['Document']} of job {c['JobId']} (command {c['CommandId']})" for c in busy
            )
            raise ClusterError(
                f"not rolling the fleet while {names} runs: it would lose its nodes; wait for "
                "it to end, stop it with `cluster.py stop --job-id ID`, or pass --force"
            )
        if busy:
            self.patience.out(f"--force: rolling the fleet although {len(busy)} commands still run")
        try:
            with aws_errors(f"starting an instance refresh of {group_name}"):
                response = self.autoscaling.start_instance_refresh(
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
        self.patience.out(f"instance refresh {refresh_id} of group {group_name} started")
        if wait:
            self.follow_refresh(refresh_id)
        return refresh_id

    def follow_refresh(self, refresh_id: str) -> None:
        group_name = self.group_name
        last = ""
        while True:
            response = self.patience.patiently(
                "following the instance refresh",
                lambda: self.autoscaling.describe_instance_refreshes(
                    AutoScalingGroupName=group_name, InstanceRefreshIds=[refresh_id]
                ),
                hint=f"instance refresh {refresh_id} goes on",
            )
            refresh = (response or {}).get("InstanceRefreshes", [{}])[0] if response else {}
            status = refresh.get("Status", "")
            done = refresh.get("PercentageComplete", 0)
            line = f"instance refresh {refresh_id}: {status}, {done}% done"
            if response is not None and line != last:
                self.patience.out(line)
                last = line
            if status == "Successful":
                return
            if status in REFRESH_DONE:
                raise ClusterError(
                    f"instance refresh {refresh_id} ended {status}: "
                    f"{refresh.get('StatusReason', 'no reason given')}"
                )
            self.patience.pause()
