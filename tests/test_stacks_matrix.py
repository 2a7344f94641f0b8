"""Every supported instance type synthesizes with the right EFA interfaces and passes cfn-lint.

Multi-node clusters (node_count=2) for the types with EFA, a single node for the one without,
each in the first region that offers it.
The same holds for a cluster with every switch flipped (no NAT, data not retained, pinned AMI,
Capacity Block).
"""

from __future__ import annotations

from typing import Any

import pytest

from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES
from tests.cdk_support import Synth, alternative, cfn_lint, only_resource, synth


def _lint_errors(synthesized: Synth) -> list[dict[str, Any]]:
    findings = cfn_lint(synthesized.template_paths(), region=synthesized.config.region)
    return [f for f in findings if f["Level"] == "Error"]


@pytest.mark.slow
@pytest.mark.parametrize("instance_type", CLUSTER_INSTANCE_TYPES)
def test_instance_type_synthesizes_and_lints(instance_type: str) -> None:
    spec = INSTANCE_TYPES[instance_type]
    node_count = 2 if spec.supports_multi_node else 1
    region = spec.regions[0]  # trn2 is not offered in the default region
    synthesized = synth(instance_type=instance_type, node_count=str(node_count), region=region)
    launch_template = only_resource(synthesized.templates["compute"], "AWS::EC2::LaunchTemplate")
    data = launch_template["Properties"]["LaunchTemplateData"]
    assert data["InstanceType"] == instance_type
    interfaces = data["NetworkInterfaces"]
    if spec.supports_multi_node:
        assert [i["InterfaceType"] for i in interfaces] == ["efa"] * spec.efa_interfaces
        assert [i["NetworkCardIndex"] for i in interfaces] == list(range(spec.efa_interfaces))
        assert [i["DeviceIndex"] for i in interfaces] == [0] + [1] * (spec.efa_interfaces - 1)
    else:
        assert len(interfaces) == 1
        assert "InterfaceType" not in interfaces[0]
    group = only_resource(synthesized.templates["compute"], "AWS::AutoScaling::AutoScalingGroup")
    assert group["Properties"]["DesiredCapacity"] == str(node_count)
    assert _lint_errors(synthesized) == []


def test_efa_interface_counts_match_the_hardware() -> None:
    expected = {"trn1.32xlarge": 8, "trn1n.32xlarge": 16, "trn2.48xlarge": 16}
    assert {t: INSTANCE_TYPES[t].efa_interfaces for t in expected} == expected
    assert set(expected) <= set(CLUSTER_INSTANCE_TYPES)


@pytest.mark.slow
def test_alternative_settings_synthesize_and_lint() -> None:
    assert _lint_errors(alternative()) == []
