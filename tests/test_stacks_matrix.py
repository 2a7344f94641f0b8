"""Every supported configuration synthesizes with cdk-nag clean (the synth raises otherwise) and
passes cfn-lint with no finding at all (errors, warnings, informational).

The modes: each instance type (multi-node where it has EFA, in the first region that offers
it), the default cluster, a Capacity Block in an endpoints-only VPC with a pinned AMI and data
not retained (the alternative settings), and an On-Demand Capacity Reservation made in an
existing placement group.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES
from tests.cdk_support import (
    CDK_CONTEXT,
    Synth,
    alternative,
    lint_every_configuration,
    machine_of,
    matrix_settings,
    odcr,
    only_resource,
    synth,
    synth_key,
)


def _lint_findings(synthesized: Synth) -> list[dict[str, Any]]:
    findings = lint_every_configuration()
    return [f for path in synthesized.template_paths() for f in findings.get(str(path), [])]


@pytest.mark.slow
@pytest.mark.parametrize("instance_type", CLUSTER_INSTANCE_TYPES)
def test_instance_type_synthesizes_and_lints(instance_type: str) -> None:
    spec = INSTANCE_TYPES[instance_type]
    node_count = 2 if spec.supports_multi_node else 1
    # In the first region that offers the type (trn2 is not offered in the default region).
    synthesized = synth(**matrix_settings()[instance_type])
    assert synthesized.config.region == spec.regions[0]
    launch_template = only_resource(synthesized.templates["compute"], "AWS::EC2::LaunchTemplate")
    data = launch_template["Properties"]["LaunchTemplateData"]
    assert data["InstanceType"] == instance_type
    interfaces = data["NetworkInterfaces"]
    if spec.supports_multi_node:
        others = "efa-only" if spec.efa_only_interfaces else "efa"
        expected = ["efa"] + [others] * (spec.efa_interfaces - 1)
        assert [i["InterfaceType"] for i in interfaces] == expected
        assert [i["NetworkCardIndex"] for i in interfaces] == list(range(spec.efa_interfaces))
        assert interfaces[0]["DeviceIndex"] == 0
    else:
        assert len(interfaces) == 1
        assert "InterfaceType" not in interfaces[0]
    group = only_resource(synthesized.templates["compute"], "AWS::AutoScaling::AutoScalingGroup")
    assert group["Properties"]["DesiredCapacity"] == str(node_count)
    assert _lint_findings(synthesized) == []


def test_efa_interface_counts_match_the_hardware() -> None:
    expected = {"trn1.32xlarge": 8, "trn1n.32xlarge": 16, "trn2.48xlarge": 16}
    assert {t: INSTANCE_TYPES[t].efa_interfaces for t in expected} == expected
    assert set(expected) <= set(CLUSTER_INSTANCE_TYPES)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["default", "capacity-block-endpoints", "odcr-placement-group"])
def test_mode_synthesizes_and_lints(mode: str) -> None:
    synthesized = {
        "default": synth,
        "capacity-block-endpoints": alternative,
        "odcr-placement-group": odcr,
    }[mode]()
    assert _lint_findings(synthesized) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trn1-1024", "trn2-1024"])
def test_the_largest_cluster_synthesizes_and_lints(name: str) -> None:
    """1,024 nodes, On-Demand: cdk-nag clean (the synth raises otherwise), cfn-lint without a
    finding, the group and the supervisor's host list sized for every node."""
    synthesized = synth(**matrix_settings()[name])
    group = only_resource(synthesized.templates["compute"], "AWS::AutoScaling::AutoScalingGroup")
    assert group["Properties"]["DesiredCapacity"] == "1024"
    assert group["Properties"]["MaxSize"] == "1024"
    machine = machine_of(synthesized.templates["operations"])
    assert "{}," * 1023 + "{}'" in json.dumps(machine["Properties"]["DefinitionString"])
    assert _lint_findings(synthesized) == []


def test_settings_that_repeat_cdk_json_are_the_default_synth() -> None:
    """A configuration spelled out with cdk.json's own values (the matrix's instance type
    case of the default type, as `-c` strings) is the default cluster, synthesized once."""
    same = {key: str(CDK_CONTEXT[key]) for key in ("instance_type", "node_count", "region")}
    assert synth(**same) is synth()
    other = str(int(CDK_CONTEXT["node_count"]) + 1)
    assert synth_key(node_count=other) == (("node_count", other),)
