"""Which of the cluster's nodes run a job and which wait as warm spares (spare_nodes).

The job supervisor runs a job on node_count of the group's node_count + spare_nodes nodes
(stacks/supervisor_workflow.py, JoinHosts); the rest are spares. The nodes a job runs on are
the targets of its RunTraining commands still executing: ListCommands with the document's name
and ExecutionStage Executing ("Returns a list of command executions that are currently still
running", SSM API reference, CommandFilter), one command per batch of nodes, and each command's
invocations (ListCommandInvocations) name its nodes.
"""

from __future__ import annotations

from typing import Any

from scripts.cluster_lib.clients import aws_errors
from scripts.cluster_lib.outputs import StackOutputs


def spare_count(outputs: StackOutputs) -> int:
    """The cluster's spare_nodes; 0 for a stack deployed before the setting existed."""
    return int(outputs.values.get("SpareNodes", "0") or 0)


def job_nodes(ssm: Any, outputs: StackOutputs) -> dict[str, str]:
    """Instance ID -> the job whose RunTraining command is still executing there."""
    found: dict[str, str] = {}
    with aws_errors("reading which nodes run a job"):
        commands = ssm.get_paginator("list_commands").paginate(
            Filters=[
                {"key": "DocumentName", "value": outputs.document("RunTraining")},
                {"key": "ExecutionStage", "value": "Executing"},
            ]
        )
        invocations = ssm.get_paginator("list_command_invocations")
        for page in commands:
            for command in page["Commands"]:
                job = command.get("Parameters", {}).get("JobId", ["?"])[0]
                for listed in invocations.paginate(CommandId=command["CommandId"]):
                    for invocation in listed["CommandInvocations"]:
                        found[invocation["InstanceId"]] = job
    return found


def role_of(instance_id: str, running: dict[str, str]) -> str:
    """What `status` shows for a node of a cluster with spares: its job, or spare."""
    job = running.get(instance_id)
    return f"job {job}" if job else "spare"
