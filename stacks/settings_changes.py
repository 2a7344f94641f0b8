"""What changing a setting of a deployed cluster does to its nodes, and so to a running job.

`trainium-cluster deploy` (scripts/cluster_lib/deploy.py) compares the cluster's settings file
with the settings the deployed cluster records and refuses, without --allow-disruption, a
change listed here. The table is derived from the templates, not from belief:
tests/test_settings_changes.py synthesizes the cluster before and after each change and checks
that a setting is listed exactly when the change does one of these to the network, storage or
compute stack:

- replaces or removes a resource the nodes stand on (the VPC, the subnet, a security group,
  the file system, the placement group, the Auto Scaling group): a property CloudFormation
  cannot update in place changes (`createOnlyProperties` of the resource's provider schema,
  read from cfn-lint's copy), or the resource leaves the template;
- lowers the Auto Scaling group's desired, minimum or maximum size (Auto Scaling terminates
  nodes to reach it) or adds, removes or moves a scheduled action (a Capacity Block's scale-in);
- changes what the launch template launches (instance type, image, capacity reservation,
  placement, network interfaces): the running nodes keep the old, every node launched from then
  on (a replacement, a scale-out) gets the new, and a job needs all its nodes alike (preflight
  refuses a mixed set; `trainium-cluster roll` replaces them all).

A change of an adopted bucket (RELINKS) replaces a data repository association: refused too.

ParallelCluster does the same per setting ("Update policy: The compute fleet must be stopped
for this setting to be changed", AWS ParallelCluster user guide, "Using pcluster
update-cluster").
"""

from __future__ import annotations

from collections.abc import Mapping

_NEW_NODES = (
    "nodes launched from now on differ from the running ones (a replaced node cannot join "
    "the job; `trainium-cluster roll` replaces them all)"
)
_SCHEDULE = "moves the Capacity Block's scheduled scaling, which terminates the nodes at scale-in"

#: Settings whose every change ends running jobs or replaces nodes, and why.
DISRUPTIVE: Mapping[str, str] = {
    "region": "another region: every stack and node is new",
    "az_id": "replaces the subnet, and with it the file system and every node",
    "instance_type": _NEW_NODES,
    "ami": _NEW_NODES,
    "capacity_reservation_id": _NEW_NODES,
    "capacity_block": "Capacity Block scheduling on or off: the group is resized and the "
    "placement group created or removed",
    "capacity_block_start": _SCHEDULE,
    "capacity_block_end": _SCHEDULE,
    "capacity_block_drain_minutes": _SCHEDULE,
    "placement_group_name": "replaces the nodes' placement group",
    "internet_egress": "replaces the nodes' subnet (its address range changes with the VPC's "
    "layout), and with it the file system and every node",
}
#: Settings whose change links /fsx/data or /fsx/jobs to another bucket: the data repository
#: association is replaced (its DataRepositoryPath is a create-only property), and a bucket the
#: stack created is left out of it (kept, with no bucket policy) or an adopted one replaced by a
#: new, empty bucket. Meant for the first deploy after a destroy, never for a running cluster.
RELINKS: Mapping[str, str] = {
    "data_bucket_name": "links /fsx/data to another bucket: a running job's data goes",
    "checkpoint_bucket_name": "links /fsx/jobs to another bucket: running jobs lose where they "
    "save",
}
#: node_count and spare_nodes (the group's size together) end nodes only when one goes down:
#: the group's termination policy may pick a node of the running job, not a spare.
NODE_COUNT_DOWN = "Auto Scaling terminates the nodes above the new count"


def disruption(key: str, old: object, new: object) -> str | None:
    """Why changing `key` from `old` to `new` ends running jobs or replaces nodes, or None."""
    if key in ("node_count", "spare_nodes"):
        return NODE_COUNT_DOWN if int(str(new)) < int(str(old)) else None
    return DISRUPTIVE.get(key) or RELINKS.get(key)
