"""The operator's commands that run one SSM document on the nodes and wait for it:
`preflight` (then the check that every node runs the same software, contract C3),
`precompile` and `stop`.

Each checks its parameters against the document (documents.py) before it waits for the nodes,
then sends and follows the document through Run Command (commands.py). `train` is not here: the
job supervisor in AWS sends RunTraining (jobs.py).
"""

from __future__ import annotations

from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import Patience, aws_errors
from scripts.cluster_lib.command_history import CommandHistory
from scripts.cluster_lib.commands import CommandResult, Invocation, RunCommand
from scripts.cluster_lib.documents import CLI_LABELS, job_parameters, load
from scripts.cluster_lib.fleet import SOFTWARE_LINE, Fleet, Node, hosts
from scripts.cluster_lib.job_inputs import JobInputs
from scripts.cluster_lib.logs import Logs

MISSING_SOFTWARE = "no node-software line"


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


class NodeOperations:
    """preflight, precompile and stop on the cluster's nodes."""

    def __init__(
        self,
        cluster_name: str,
        ssm: Any,
        patience: Patience,
        *,
        fleet: Fleet,
        commands: RunCommand,
        history: CommandHistory,
        logs: Logs,
    ) -> None:
        self.cluster_name = cluster_name
        self.ssm = ssm
        self.patience = patience
        self.fleet = fleet
        self.commands = commands
        self.history = history
        self.logs = logs

    def preflight(self, nodes: list[Node] | None = None, *, port: str = "29600") -> CommandResult:
        """Runs Preflight on every node; when it passes, refuses nodes that run different
        software (contract C3)."""
        nodes = nodes or self.fleet.wait_for_nodes()
        self.patience.out(f"preflight on {len(nodes)} nodes, master {nodes[0].address}")
        result = self.commands.run(
            "Preflight",
            nodes,
            {"Hosts": hosts(nodes), "Port": port},
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
                self.patience.out("software: no node reports it (node scripts older than this CLI)")
            else:
                self.patience.out(f"software: {software} on all {len(result.invocations)} nodes")
            return
        raise ClusterError(
            f"the nodes run different software: {describe_groups(groups)}: roll the fleet "
            "so that every node runs the group's current launch template "
            "(`cluster.py roll`, see the README)"
        )

    def _software_from_logs(self, inv: Invocation) -> str | None:
        """The node-software line from CloudWatch Logs, when the invocation's output (its
        first 24,000 characters) does not hold it."""
        messages = self.logs.matching(inv.command_id, inv.node.instance_id, '"node-software:"')
        for message in messages or []:
            found = software_of(message)
            if found:
                return found
        return None

    def precompile(
        self,
        job_id: str,
        train_args: list[str],
        inputs: JobInputs,
        *,
        steps: str = "10",
        master_port: str = "29500",
        nproc_per_node: str = "auto",
    ) -> CommandResult:
        parameters = job_parameters(
            job_id, train_args, master_port=master_port, nproc_per_node=nproc_per_node,
            Steps=steps, **inputs.parameters(),
        )  # fmt: skip
        load("Precompile").check(parameters, CLI_LABELS)
        # The job's world: node_count nodes, as the supervisor's JoinHosts takes them, not the
        # warm spares beside them (a graph traced for another world size is another graph).
        nodes = self.fleet.wait_for_nodes()[: self.fleet.stack.outputs().node_count]
        parameters["Hosts"] = hosts(nodes)
        return self.commands.run("Precompile", nodes, parameters, f"{job_id} precompile")

    def stop(self, job_id: str) -> CommandResult:
        """Runs StopTraining on the online nodes, then cancels whatever command of the job
        SSM still runs (every batch of it), so nothing of the job is left running."""
        load("StopTraining").check({"JobId": job_id}, CLI_LABELS)
        nodes = self.fleet.wait_for_nodes(require_all=False)
        result = self.commands.run("StopTraining", nodes, {"JobId": job_id}, f"{job_id} stop")
        for command in self.history.active_commands(job_id=job_id):
            self.patience.out(
                f"cancelling {command['Document']} command {command['CommandId']} of job {job_id}"
            )
            with aws_errors("cancelling the job's commands"):
                self.ssm.cancel_command(CommandId=command["CommandId"])
        return result
