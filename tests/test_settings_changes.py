"""The table of disruptive settings (stacks/settings_changes.py) against the templates.

For each setting, the cluster is synthesized before and after a change of it alone (with the
companions some values need in both), and the change's effect on the network, storage and
compute templates is derived by the rules the module's docstring states; CloudFormation's
resource provider schemas (cfn-lint's copy) say which property changes replace a resource.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cfnlint.schema import PROVIDER_SCHEMA_MANAGER

from stacks.settings_changes import DISRUPTIVE, RELINKS, disruption
from stacks.settings_file import settable
from tests.cdk_support import synth

#: What the nodes stand on: replacing one of these takes it from under running nodes.
NODE_BEARING = {
    "AWS::EC2::VPC",
    "AWS::EC2::Subnet",
    "AWS::EC2::SecurityGroup",
    "AWS::FSx::FileSystem",
    "AWS::EC2::PlacementGroup",
    "AWS::AutoScaling::AutoScalingGroup",
}
#: What the launch template launches: the nodes themselves.
LAUNCHED = ("InstanceType", "ImageId", "CapacityReservationSpecification", "Placement")
SIZES = ("DesiredCapacity", "MinSize", "MaxSize")
BLOCK = {
    "az_id": "use1-az6",
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "capacity_block": "true",
    "capacity_block_start": "2026-12-01T11:30:00Z",
    "capacity_block_end": "2026-12-08T11:30:00Z",
}
ODCR = {
    "az_id": "use1-az6",
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "placement_group_name": "odcr-group",
}

#: (setting, settings before, settings after): one change each, companions in both.
CHANGES: list[tuple[str, dict[str, str], dict[str, str]]] = [
    ("region", {}, {"region": "us-west-2"}),
    ("az_id", {"region": "us-east-2"}, {"region": "us-east-2", "az_id": "use2-az1"}),
    ("instance_type", {}, {"instance_type": "trn1n.32xlarge"}),
    ("node_count", {}, {"node_count": "4"}),
    ("node_count", {"node_count": "4"}, {}),
    ("spare_nodes", {}, {"spare_nodes": "1"}),
    ("spare_nodes", {"spare_nodes": "1"}, {}),
    ("ami", {}, {"ami": "ami-0123456789abcdef0"}),
    ("fsx_storage_gib", {}, {"fsx_storage_gib": "2400"}),
    ("fsx_throughput_per_tib", {}, {"fsx_throughput_per_tib": "500"}),
    ("root_volume_gib", {}, {"root_volume_gib": "1024"}),
    ("capacity_reservation_id", ODCR, {**ODCR, "capacity_reservation_id": "cr-0fedcba987654321f"}),
    (
        "capacity_block",
        {
            **BLOCK,
            "capacity_block": "false",
            "capacity_block_start": "",
            "capacity_block_end": "",
            "placement_group_name": "odcr-group",
        },
        {**BLOCK},
    ),
    ("capacity_block_start", BLOCK, {**BLOCK, "capacity_block_start": "2026-12-02T11:30:00Z"}),
    ("capacity_block_end", BLOCK, {**BLOCK, "capacity_block_end": "2026-12-07T11:30:00Z"}),
    ("capacity_block_drain_minutes", BLOCK, {**BLOCK, "capacity_block_drain_minutes": "90"}),
    ("placement_group_name", {}, {"placement_group_name": "my-group"}),
    (
        "internet_egress",
        {"ami": "ami-0123456789abcdef0"},
        {"ami": "ami-0123456789abcdef0", "internet_egress": "endpoints"},
    ),
    ("retain_data", {}, {"retain_data": "false"}),
    ("node_usd_per_hour", {}, {"node_usd_per_hour": "21.50"}),
    ("idle_warning_minutes", {}, {"idle_warning_minutes": "0"}),
    ("alarm_email", {}, {"alarm_email": "ops@example.com"}),
    ("log_retention_days", {}, {"log_retention_days": "30"}),
    ("node_wait_hours", {}, {"node_wait_hours": "48"}),
    ("data_bucket_name", {}, {"data_bucket_name": "kept-data-bucket"}),
    ("checkpoint_bucket_name", {}, {"checkpoint_bucket_name": "kept-checkpoint-bucket"}),
]


def _at(value: Any, pointer: str) -> Any:
    for part in pointer.removeprefix("/properties/").split("/"):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def derived_disruptions(
    before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]], region: str
) -> list[str]:
    """What a deploy from `before` to `after` (templates by stack part) does to the nodes."""
    found = []
    for part in ("network", "storage", "compute"):
        old, new = before[part]["Resources"], after[part]["Resources"]
        for logical_id, resource in old.items():
            kind = resource["Type"]
            if kind in NODE_BEARING:
                if logical_id not in new:
                    found.append(f"{part}: {kind} {logical_id} removed")
                    continue
                schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema(region, kind).schema
                for pointer in schema.get("createOnlyProperties", []):
                    was = _at(resource.get("Properties", {}), pointer)
                    will = _at(new[logical_id].get("Properties", {}), pointer)
                    if json.dumps(was, sort_keys=True) != json.dumps(will, sort_keys=True):
                        found.append(f"{part}: {kind} {logical_id} replaced ({pointer})")
            if kind == "AWS::AutoScaling::AutoScalingGroup" and logical_id in new:
                for size in SIZES:
                    was = int(resource["Properties"][size])
                    will = int(new[logical_id]["Properties"][size])
                    if will < was:
                        found.append(f"{part}: {size} {was} -> {will}")
            if kind == "AWS::EC2::LaunchTemplate" and logical_id in new:
                was = resource["Properties"]["LaunchTemplateData"]
                will = new[logical_id]["Properties"]["LaunchTemplateData"]
                for key in LAUNCHED:
                    if json.dumps(was.get(key), sort_keys=True) != json.dumps(
                        will.get(key), sort_keys=True
                    ):
                        found.append(f"{part}: launch template {key} changes")
        scheduled = {
            part: {
                k: json.dumps(r["Properties"], sort_keys=True)
                for k, r in template["Resources"].items()
                if r["Type"] == "AWS::AutoScaling::ScheduledAction"
            }
            for part, template in (("before", before[part]), ("after", after[part]))
        }
        if scheduled["before"] != scheduled["after"]:
            found.append(f"{part}: scheduled actions change")
    return found


def derived_relinks(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Data repository associations whose bucket changes (DataRepositoryPath is create-only in
    AWS::FSx::DataRepositoryAssociation's provider schema: the association is replaced)."""
    schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema(
        "us-east-1", "AWS::FSx::DataRepositoryAssociation"
    ).schema
    assert "/properties/DataRepositoryPath" in schema["createOnlyProperties"]
    old, new = before["Resources"], after["Resources"]
    return [
        logical_id
        for logical_id, resource in old.items()
        if resource["Type"] == "AWS::FSx::DataRepositoryAssociation"
        and json.dumps(resource["Properties"]["DataRepositoryPath"], sort_keys=True)
        != json.dumps(new[logical_id]["Properties"]["DataRepositoryPath"], sort_keys=True)
    ]


def test_every_setting_is_changed_once_here() -> None:
    assert {key for key, _, _ in CHANGES} == set(settable()) - {"cluster_name"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("key", "before", "after"),
    CHANGES,
    ids=[f"{key}-{i}" for i, (key, _, _) in enumerate(CHANGES)],
)
def test_the_table_says_what_the_templates_do(
    key: str, before: dict[str, str], after: dict[str, str]
) -> None:
    old, new = synth(**before), synth(**after)
    derived = derived_disruptions(old.templates, new.templates, new.config.region)
    relinked = derived_relinks(old.templates["storage"], new.templates["storage"])
    said = disruption(key, getattr(old.config, key), getattr(new.config, key))
    assert bool(said) == bool(derived or relinked), (key, said, derived, relinked)
    assert (key in RELINKS) == bool(relinked), (key, relinked)


def test_the_table_names_only_settings() -> None:
    assert set(DISRUPTIVE) | set(RELINKS) <= set(settable())
