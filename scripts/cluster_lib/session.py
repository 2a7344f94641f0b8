"""`shell NODE`: a Session Manager session on one of the cluster's nodes, and which node a rank,
an address or an instance ID names (`shell`, `logs --node`).

The session is the AWS CLI's: `aws ssm start-session --target <instance-id>` calls SSM's
StartSession (the document SSM-SessionManagerRunShell when none is named) and hands the
session's stream to the Session Manager plugin, which it starts as `session-manager-plugin`
(AWS CLI user guide and Systems Manager user guide, "Install the Session Manager plugin for
the AWS CLI"). boto3 can start a session but cannot carry its stream, so the CLI runs the AWS CLI,
with the operator's own region and profile, and waits for it; Ctrl-C goes to the session.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from typing import TYPE_CHECKING

from scripts.cluster_lib import ClusterError

if TYPE_CHECKING:
    from scripts.cluster_lib.cluster import Cluster

#: The SSM operations a session needs the operator's credentials for, in botocore's names: the
#: AWS CLI calls StartSession; the plugin ends the session with TerminateSession and
#: reconnects a dropped one with ResumeSession (Systems Manager user guide, "Sample IAM
#: policies for Session Manager": the end user's policy). docs/security.md lists them.
SESSION_OPERATIONS = ("start_session", "terminate_session", "resume_session")
#: What `shell` runs, and what the AWS CLI runs for it.
AWS_CLI, PLUGIN = "aws", "session-manager-plugin"


def node_instance(cluster: Cluster, spec: str, *, gone_ok: bool = False) -> str:
    """The instance ID of the running node that `spec` names: its rank (the order `status`
    lists), its private address or its instance ID. With `gone_ok`, an instance ID that is no
    longer running is taken as given (`logs` of a node the group has replaced)."""
    nodes, _ = cluster.running_nodes()
    match = [n for rank, n in enumerate(nodes) if spec in (str(rank), n.address, n.instance_id)]
    if match:
        return match[0].instance_id
    if gone_ok and spec.startswith("i-"):
        return spec
    raise ClusterError(
        f"--node {spec!r} matches no running node (rank, address or ID)"
        if gone_ok
        else f"{spec!r} matches none of the {len(nodes)} running nodes: give a rank (0 to "
        f"{len(nodes) - 1}), a private address or an instance ID (`status` lists them)"
    )


def shell_command(instance_id: str, region: str, profile: str | None) -> list[str]:
    """The AWS CLI's command line for a session on `instance_id`."""
    command = [AWS_CLI, "ssm", "start-session", "--target", instance_id, "--region", region]
    return [*command, "--profile", profile] if profile else command


def open_shell(cluster: Cluster, spec: str, profile: str | None) -> int:
    """Runs a Session Manager session on the node `spec` names until it ends; returns the AWS
    CLI's exit status."""
    missing = [tool for tool in (AWS_CLI, PLUGIN) if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"shell needs the AWS CLI (`aws`) and the Session Manager plugin "
            f"(`session-manager-plugin`) on PATH; missing: {', '.join(missing)} (Systems Manager "
            'user guide, "Install the Session Manager plugin for the AWS CLI")'
        )
    instance_id = node_instance(cluster, spec)
    command = shell_command(instance_id, cluster.clients.ec2.meta.region_name, profile)
    cluster.patience.out(f"node {spec}: {instance_id}; running {' '.join(command)}")
    # The session reads the terminal; Ctrl-C is the remote shell's, not this process's.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return subprocess.call(command)
    finally:
        signal.signal(signal.SIGINT, previous)
