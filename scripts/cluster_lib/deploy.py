"""`deploy`: the cluster's settings file deployed, after a look at what it changes.

The operations stack records the settings it was deployed with (its output `Settings`,
stacks/settings_file.py). Before `npx cdk deploy --all`, `deploy` reads that record
(CloudFormation DescribeStacks), compares it with the cluster's settings file
(clusters/<cluster_name>.yaml, or cdk.json's defaults without one), prints every change, and
refuses the changes that end running jobs or replace nodes (stacks/settings_changes.py) unless
given --allow-disruption, in one line naming them. This is ParallelCluster's `pcluster
update-cluster`, which compares the cluster's configuration file with the settings the running
cluster was created with and blocks the changes its update policies forbid (AWS
ParallelCluster user guide, "Using pcluster update-cluster"). After a deploy it notes the names
of the buckets a destroy keeps in the settings file, as comments (note_kept_buckets).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import aws_errors
from stacks.bucket_names import bucket_name_problem
from stacks.config import ClusterConfig, ConfigError
from stacks.settings_changes import disruption
from stacks.settings_file import (
    CLUSTER_CONTEXT_KEY,
    PROJECT_ROOT,
    checkout_root,
    config_from_app_context,
    settable,
    settings_path,
)

SETTINGS_OUTPUT = "Settings"
IN_PROGRESS = "_IN_PROGRESS"


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    #: Why the change ends running jobs or replaces nodes; None when it does neither.
    disruption: str | None

    @property
    def values(self) -> str:
        """Old and new as the settings file writes them (JSON scalars are YAML's too)."""
        return f"{json.dumps(self.old)} -> {json.dumps(self.new)}"

    def __str__(self) -> str:
        text = f"{self.key}: {self.values}"
        return f"{text} ({self.disruption})" if self.disruption else text


def cluster_settings(cluster_name: str, root: Path = PROJECT_ROOT) -> ClusterConfig:
    """The settings to deploy: the cluster's file over cdk.json, or cdk.json's defaults for the
    default cluster without a file; one line for a file that is wrong or missing."""
    context = {CLUSTER_CONTEXT_KEY: cluster_name}
    try:
        return config_from_app_context(context.get, context, root=root, environ={})
    except ConfigError as error:
        raise ClusterError(str(error)) from None


def deployed_settings(cloudformation: Any, cluster_name: str) -> dict[str, Any] | None:
    """The settings the deployed cluster records, or None when it is not deployed."""
    stack_name = f"{cluster_name}-operations"
    try:
        with aws_errors(f"reading stack {stack_name}"):
            stacks = cloudformation.describe_stacks(StackName=stack_name)["Stacks"]
    except ClusterError as error:
        if "does not exist" in str(error):
            return None
        raise
    stack = stacks[0]
    status = str(stack.get("StackStatus", ""))
    if status.endswith(IN_PROGRESS):
        raise ClusterError(f"stack {stack_name} is in state {status}: wait until it ends")
    if status == "DELETE_COMPLETE":
        return None
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    if SETTINGS_OUTPUT not in outputs:
        raise ClusterError(
            f"stack {stack_name} records no settings (output {SETTINGS_OUTPUT}; deployed by an "
            "older version): compare its outputs with the settings file yourself, then deploy "
            "with --allow-disruption"
        )
    record: dict[str, Any] = json.loads(outputs[SETTINGS_OUTPUT])
    return record


def plan(deployed: Mapping[str, Any] | None, wanted: ClusterConfig) -> list[Change]:
    """Every setting whose value differs from the deployed one (nothing for a new cluster)."""
    if deployed is None:
        return []
    changes = []
    for key in settable():
        new = getattr(wanted, key)
        if key not in deployed:  # a setting newer than the deployed cluster: its default
            continue
        old = deployed[key]
        if old != new:
            changes.append(Change(key, old, new, disruption(key, old, new)))
    return changes


def deploy_command(cluster_name: str) -> list[str]:
    return ["npx", "cdk", "deploy", "--all", "-c", f"{CLUSTER_CONTEXT_KEY}={cluster_name}"]


def deploy(
    cloudformation: Any,
    cluster_name: str,
    *,
    allow_disruption: bool,
    dry_run: bool,
    out: Callable[[str], None],
    root: Path | None = None,
    run: Callable[[Sequence[str], Path], int] | None = None,
) -> int:
    """Compare, print, refuse or deploy; the exit status of `npx cdk deploy`. `root` is the
    checkout (cdk.json, clusters/): the current directory's, else this code's."""
    root = root or checkout_root()
    wanted = cluster_settings(cluster_name, root)
    path = settings_path(cluster_name, root)
    source = path.relative_to(root) if path.is_file() else "cdk.json (no settings file)"
    deployed = deployed_settings(cloudformation, cluster_name)
    changes = plan(deployed, wanted)
    if deployed is None:
        out(f"cluster {cluster_name} is not deployed: a new cluster from {source}")
    elif not changes:
        out(f"cluster {cluster_name}: {source} matches the deployed settings")
    else:
        out(f"cluster {cluster_name}: {source} changes {len(changes)} deployed settings:")
        for change in changes:
            out(f"  {change}")
    disruptive = [c for c in changes if c.disruption]
    if disruptive and not allow_disruption:
        named = ", ".join(f"{c.key} {c.values}" for c in disruptive)
        undo = (
            f"edit {source} back"
            if path.is_file()
            else f"write the deployed settings into {path.relative_to(root)}"
        )
        raise ClusterError(
            f"deploy refused: {named} would end running jobs or replace nodes; stop the "
            f"cluster's jobs first and deploy with --allow-disruption, or {undo}"
        )
    command = deploy_command(cluster_name)
    if dry_run:
        out("dry run: would run " + " ".join(command))
        return 0
    status = (run or _run)(command, root)
    if status == 0 and wanted.retain_data:
        note_kept_buckets(cloudformation, cluster_name, wanted, path, out)
    return status


#: The comment above the kept buckets' names in a settings file (note_kept_buckets).
KEPT_MARKER = (
    "# Kept on destroy (retain_data): to deploy this cluster again after `npx cdk destroy "
    "--all`, uncomment these lines (docs/deploy.md, Deploying again after a destroy)"
)
_KEPT_KEYS = {
    "data_bucket_name": "DataBucketName",
    "checkpoint_bucket_name": "CheckpointBucketName",
}


def note_kept_buckets(
    cloudformation: Any,
    cluster_name: str,
    wanted: ClusterConfig,
    path: Path,
    out: Callable[[str], None],
) -> None:
    """After a deploy: the names of the buckets a destroy keeps, as comments in the cluster's
    settings file, since the stack outputs that name them go with the destroy. Comments change
    no setting; uncommented, they adopt the buckets (data_bucket_name, checkpoint_bucket_name).
    An adopted bucket is in the file already."""
    stack_name = f"{cluster_name}-operations"
    with aws_errors(f"reading stack {stack_name}"):
        stack = cloudformation.describe_stacks(StackName=stack_name)["Stacks"][0]
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    lines = []
    for key, output in _KEPT_KEYS.items():
        name = outputs.get(output, "")
        if not getattr(wanted, key) and name and bucket_name_problem(name) is None:
            lines.append(f"# {key}: {name}")
    if not lines:
        return
    text = path.read_text() if path.is_file() else ""
    managed = (KEPT_MARKER, *(f"# {key}: " for key in _KEPT_KEYS))
    kept = [line for line in text.splitlines() if not line.startswith(managed)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([*kept, KEPT_MARKER, *lines]) + "\n")
    out(f"kept on destroy: {', '.join(line[2:] for line in lines)} (noted in {path.name})")


def _run(command: Sequence[str], root: Path) -> int:
    return subprocess.run(list(command), cwd=root, check=False).returncode
