"""ClusterConfig: parsing context values and refusing bad ones with one clear line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stacks.config import (
    DEFAULT_AMI_PARAMETER,
    DEFAULT_AZ_IDS,
    NEURON_RELEASE_AMI,
    ClusterConfig,
    ConfigError,
    az_id_prefix,
)
from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES

REPO_ROOT = Path(__file__).resolve().parent.parent
CDK_JSON_CONTEXT: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]


#: A valid Capacity Block: a reservation, its zone and its times.
CAPACITY_BLOCK = {
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "capacity_block": "true",
    "az_id": "use1-az6",
    "capacity_block_start": "2026-12-01T11:30:00Z",
    "capacity_block_end": "2026-12-08T11:30:00Z",
}
#: A valid On-Demand Capacity Reservation made in an existing cluster placement group.
ODCR = {
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "az_id": "use1-az6",
    "placement_group_name": "trn-odcr",
}


def from_context(**context: Any) -> ClusterConfig:
    """Build a config the way app.py does, from a context of CLI-style strings."""
    return ClusterConfig.from_context(context.get, context)


def test_cdk_json_defaults_are_the_dataclass_defaults() -> None:
    settings = {k: v for k, v in CDK_JSON_CONTEXT.items() if not k.startswith("@")}
    assert ClusterConfig.from_context(settings.get, settings) == ClusterConfig()


def test_defaults() -> None:
    config = ClusterConfig()
    assert config.cluster_name == "trainium"
    assert config.region == "us-east-1"
    assert config.az_id == "use1-az6"  # the region's trn1 zone
    assert config.instance_type == "trn1.32xlarge"
    assert config.node_count == 2
    # The table's training release, found at the first deploy (stacks/node_image.py).
    assert config.ami == NEURON_RELEASE_AMI
    assert config.retain_data is True
    assert config.internet_egress == "nat"
    assert config.instance is INSTANCE_TYPES["trn1.32xlarge"]


def test_cli_strings_are_parsed() -> None:
    config = from_context(
        node_count="4",
        retain_data="false",
        capacity_block="TRUE",
        capacity_reservation_id="cr-0123456789abcdef0",
        capacity_block_start="2026-12-01T11:30:00Z",
        capacity_block_end="2026-12-02T11:30:00Z",
        capacity_block_drain_minutes="45",
        fsx_storage_gib="4800",
        region="us-west-2",
        az_id="usw2-az4",
        instance_type="trn1n.32xlarge",
        ami="ami-0123456789abcdef0",
        internet_egress="endpoints",
    )
    assert config.node_count == 4
    assert config.retain_data is False
    assert config.capacity_block is True
    assert config.fsx_storage_gib == 4800
    assert config.az_id == DEFAULT_AZ_IDS["us-west-2"]
    assert config.instance.efa_interfaces == 16
    assert config.capacity_block_drain_minutes == 45


def test_capacity_block_schedule() -> None:
    config = from_context(**CAPACITY_BLOCK, capacity_block_drain_minutes="50")
    assert config.capacity_block_scale_out_time == "2026-12-01T11:30:00Z"
    # 50 minutes before the end: 20 minutes before EC2 starts reclaiming the block.
    assert config.capacity_block_scale_in_time == "2026-12-08T10:40:00Z"


def test_odcr_in_an_existing_placement_group() -> None:
    config = from_context(**ODCR)
    assert config.placement_group_name == "trn-odcr"
    assert config.az_id == "use1-az6"


@pytest.mark.parametrize(
    ("region", "prefix"),
    [("us-east-1", "use1"), ("us-west-2", "usw2"), ("eu-north-1", "eun1"),
     ("ap-southeast-2", "apse2"), ("us-gov-west-1", "usgw1"), ("ca-central-1", "cac1")],
)  # fmt: skip
def test_az_id_prefix(region: str, prefix: str) -> None:
    assert az_id_prefix(region) == prefix


@pytest.mark.parametrize(
    ("context", "message"),
    [
        (
            {"instance_type": "p9.96xlarge"},
            "instance_type='p9.96xlarge' is not supported; allowed: "
            + ", ".join(CLUSTER_INSTANCE_TYPES),
        ),
        ({"node_count": "0"}, "node_count=0 is out of range; allowed: 1 to 1024"),
        ({"node_count": "1025"}, "node_count=1025 is out of range; allowed: 1 to 1024"),
        ({"node_count": "abc"}, "node_count='abc' is not a whole number; allowed: 1 to 1024"),
        ({"node_count": "2.5"}, "node_count='2.5' is not a whole number; allowed: 1 to 1024"),
        (
            {"az_id": "usw2-az4"},
            "az_id='usw2-az4' is not in region=us-east-1; allowed: a zone ID of us-east-1 "
            "(starting with use1-az), such as use1-az6",
        ),
        ({"az_id": "us-east-1a"}, "az_id='us-east-1a' is not an Availability Zone ID"),
        (
            {"instance_type": "trn2.48xlarge"},
            "instance_type=trn2.48xlarge is not offered in region=us-east-1; allowed: region "
            "us-east-2 or ap-south-2",
        ),
        (
            {"instance_type": "trn2.48xlarge", "region": "ap-south-2"},
            "az_id is required for region=ap-south-2",
        ),
        (
            {"region": "eu-north-1"},
            "instance_type=trn1.32xlarge is not offered in region=eu-north-1; allowed: region "
            "us-east-1 or us-east-2 or us-west-2",
        ),
        ({"region": "mars-1"}, "region='mars-1' is not allowed; allowed: an AWS region name"),
        (
            {"fsx_storage_gib": "2000"},
            "fsx_storage_gib=2000 is not a size FSx for Lustre PERSISTENT_2 (SSD) allows; "
            "allowed: 1200 or a multiple of 2400",
        ),
        ({"fsx_storage_gib": "600"}, "fsx_storage_gib=600 is not a size"),
        (
            {"fsx_throughput_per_tib": "200"},
            "fsx_throughput_per_tib=200 is not a PERSISTENT_2 throughput tier; "
            "allowed: 125, 250, 500, 1000",
        ),
        (
            {"ami": "ami-123"},
            "ami='ami-123' is neither neuron-release, an AMI ID nor an SSM parameter path; "
            "allowed: neuron-release (the Neuron DLAMI of scripts/node/neuron_releases.json's "
            "release, found at the first deploy), an AMI ID (ami- and 8 or 17 hex digits)",
        ),
        (
            {"ami": "latest"},
            "ami='latest' is neither neuron-release, an AMI ID nor an SSM parameter path",
        ),
        ({"ami": "Neuron-Release"}, "ami='Neuron-Release' is neither neuron-release"),
        (
            {"instance_type": "trn1.2xlarge"},
            "node_count=2 is not allowed with instance_type=trn1.2xlarge: nodes talk over EFA "
            "and trn1.2xlarge has no EFA interface; allowed: node_count=1",
        ),
        ({"root_volume_gib": "50"}, "root_volume_gib=50 is out of range; allowed: 100 to 16384"),
        ({"capacity_reservation_id": "cr-xyz"}, "capacity_reservation_id='cr-xyz' is not a "),
        ({"capacity_block": "true"}, "capacity_block=true is not allowed without a reservation"),
        (
            {**CAPACITY_BLOCK, "node_count": "65"},
            "node_count=65 is not allowed with capacity_block=true: a Capacity Block holds at "
            "most 64 instances; allowed: node_count 1 to 64 with capacity_block=true, or up to "
            "1024 On-Demand or in a capacity reservation (capacity_block=false)",
        ),
        (
            {**CAPACITY_BLOCK, "az_id": ""},
            "capacity_reservation_id=cr-0123456789abcdef0 needs an explicit az_id: a "
            "reservation serves one Availability Zone",
        ),
        (
            {**ODCR, "az_id": ""},
            "capacity_reservation_id=cr-0123456789abcdef0 needs an explicit az_id",
        ),
        (
            {**ODCR, "placement_group_name": ""},
            "capacity_reservation_id=cr-0123456789abcdef0 needs placement_group_name: an "
            "On-Demand Capacity Reservation for trn capacity is made in a cluster placement group",
        ),
        (
            {**CAPACITY_BLOCK, "placement_group_name": "trn-odcr"},
            "placement_group_name=trn-odcr is not allowed with capacity_block=true",
        ),
        ({"placement_group_name": "bad name"}, "placement_group_name='bad name' is not a "),
        (
            {**CAPACITY_BLOCK, "capacity_block_start": ""},
            "capacity_block=true needs capacity_block_start: the group starts at 0",
        ),
        (
            {**CAPACITY_BLOCK, "capacity_block_end": ""},
            "capacity_block=true needs capacity_block_end",
        ),
        (
            {**CAPACITY_BLOCK, "capacity_block_start": "2026-12-01 11:30"},
            "capacity_block_start='2026-12-01 11:30' is not a UTC time; allowed: the block's "
            "start time in UTC, such as 2026-12-01T11:30:00Z",
        ),
        (
            {**CAPACITY_BLOCK, "capacity_block_end": "2026-12-01T11:30:00Z"},
            "capacity_block_end=2026-12-01T11:30:00Z leaves no time after "
            "capacity_block_start=2026-12-01T11:30:00Z",
        ),
        (
            {**CAPACITY_BLOCK, "capacity_block_end": "2026-12-01T12:00:00Z"},
            "capacity_block_end=2026-12-01T12:00:00Z leaves no time",
        ),
        (
            {**CAPACITY_BLOCK, "capacity_block_drain_minutes": "30"},
            "capacity_block_drain_minutes=30 is out of range; allowed: 35 to 1440 (EC2 reclaims "
            "a block's instances from 30 minutes before its end)",
        ),
        (
            {"capacity_block_start": "2026-12-01T11:30:00Z"},
            "capacity_block_start=2026-12-01T11:30:00Z is only used with a Capacity Block",
        ),
        (
            {"internet_egress": "endpoints"},
            f"internet_egress=endpoints is not allowed with ami={NEURON_RELEASE_AMI}: with no "
            "internet the nodes cannot install",
        ),
        (
            {"internet_egress": "endpoints", "ami": DEFAULT_AMI_PARAMETER},
            f"internet_egress=endpoints is not allowed with ami={DEFAULT_AMI_PARAMETER}: with no "
            "internet the nodes cannot install",
        ),
        (
            {"internet_egress": "none", "ami": "ami-0123456789abcdef0"},
            "internet_egress='none' is not allowed; allowed: nat",
        ),
        ({"retain_data": "maybe"}, "retain_data='maybe' is not a boolean; allowed: true or false"),
        ({"alarm_email": "ops"}, "alarm_email='ops' is not an email address"),
        ({"log_retention_days": "10"}, "log_retention_days=10 is not a retention"),
        (
            {"node_wait_hours": "0"},
            "node_wait_hours=0 is out of range; allowed: 1 to 168 (hours a job waits for a full "
            "set of nodes)",
        ),
        ({"node_wait_hours": "a day"}, "node_wait_hours='a day' is not a whole number; allowed:"),
        ({"spare_nodes": "-1"}, "spare_nodes=-1 is out of range; allowed: 0 or more, with "),
        (
            {"node_count": "1000", "spare_nodes": "25"},
            "node_count=1000 with spare_nodes=25 is 1025 instances, more than a cluster holds "
            "(1024); allowed: node_count + spare_nodes at most 1024",
        ),
        (
            # Spares are the block's instances too (Amazon EC2 user guide, Capacity Blocks for
            # ML: one to 64 instances).
            {**CAPACITY_BLOCK, "node_count": "64", "spare_nodes": "1"},
            "node_count=64 with spare_nodes=1 is 65 instances, more than a Capacity Block holds "
            "(64); allowed: node_count + spare_nodes at most 64",
        ),
        ({"cluster_name": "Trainium_1"}, "cluster_name='Trainium_1' is not allowed; allowed: "),
        ({"cluster_name": "a" * 25}, f"cluster_name='{'a' * 25}' is not allowed; allowed: 1-24"),
        ({"node_cout": "4"}, "node_cout is not a setting (did you mean node_count?); allowed: "),
    ],
)
def test_bad_values_are_refused_with_one_line(context: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as raised:
        from_context(**context)
    text = str(raised.value)
    assert text.startswith(message)
    assert "\n" not in text


@pytest.mark.parametrize("ami", [DEFAULT_AMI_PARAMETER, "ami-0123456789abcdef0", "ami-12c6146b"])
def test_a_pinned_ami_or_an_ssm_parameter_replaces_the_default(ami: str) -> None:
    assert from_context(ami=ami).ami == ami


def test_endpoints_with_a_pinned_ami_is_allowed() -> None:
    config = from_context(internet_egress="endpoints", ami="ami-0123456789abcdef0")
    assert config.internet_egress == "endpoints"


def test_existing_placement_group_without_reservation_is_allowed() -> None:
    assert from_context(placement_group_name="my-group").placement_group_name == "my-group"


def test_spares_fill_a_capacity_block_up_to_its_size() -> None:
    config = from_context(**CAPACITY_BLOCK, node_count="60", spare_nodes="4")
    assert (config.node_count, config.spare_nodes, config.group_size) == (60, 4, 64)
    assert ClusterConfig().group_size == 2  # no spares by default


def test_single_node_without_efa_is_allowed() -> None:
    config = from_context(instance_type="trn1.2xlarge", node_count="1")
    assert config.instance.efa_interfaces == 0


def test_cdk_keys_are_not_mistaken_for_settings() -> None:
    context = {
        "@aws-cdk/core:checkSecretUsage": True,
        "aws:cdk:enable-path-metadata": True,
        "cli-telemetry": False,
        "node_count": 3,
    }
    assert ClusterConfig.from_context(context.get, context).node_count == 3


def test_json_types_from_cdk_json_are_accepted_but_not_coerced_wrongly() -> None:
    with pytest.raises(ConfigError, match="node_count=True is not a whole number"):
        ClusterConfig.from_context({"node_count": True}.get, ["node_count"])
    with pytest.raises(ConfigError, match="cluster_name=5 is not a string"):
        ClusterConfig.from_context({"cluster_name": 5}.get, ["cluster_name"])


def test_names_derived_from_the_config() -> None:
    config = from_context(cluster_name="demo")
    assert config.auto_scaling_group_name == "demo-workers"
    assert config.metrics_namespace == "TrainiumCluster/demo"
    assert config.stack_name("compute") == "demo-compute"
    assert config.lifecycle_hook_name == "demo-bootstrap"


def test_instance_table_records_efa_only_and_instance_store() -> None:
    for name in ("trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"):
        spec = INSTANCE_TYPES[name]
        assert spec.efa_only_interfaces is True, name
        assert (spec.instance_store_volumes, spec.instance_store_volume_gb) == (4, 1900), name
    assert INSTANCE_TYPES["trn1.32xlarge"].instance_store_gb == 7600
    assert INSTANCE_TYPES["trn1.2xlarge"].efa_only_interfaces is False  # no EFA at all
