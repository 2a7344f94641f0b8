"""Cross-stack references are strong: CloudFormation exports and Fn::ImportValue.

A weak reference (Fn::GetStackOutput) is resolved only when the consuming stack is updated, so
a replaced subnet, security group or file system would leave the nodes with stale values, and
CloudFormation would let the producer be deleted while the nodes still use it. With exports,
CloudFormation refuses to change or delete a value another stack imports.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cdk_support import STACK_PARTS, Synth, alternative, flatten, only_resource, synth


def _exports(template: dict[str, Any]) -> dict[str, Any]:
    """Export name -> exported value."""
    return {
        o["Export"]["Name"]: o["Value"]
        for o in template.get("Outputs", {}).values()
        if "Export" in o
    }


def _imported(value: Any, producer: dict[str, Any]) -> Any:
    """The producer's value behind an Fn::ImportValue (fails if it is anything else)."""
    assert set(value) == {"Fn::ImportValue"}, value
    return _exports(producer)[value["Fn::ImportValue"]]


@pytest.mark.parametrize("which", ["default", "alternative"])
def test_no_weak_references(which: str) -> None:
    synthesized: Synth = synth() if which == "default" else alternative()
    for part in STACK_PARTS:
        assert "Fn::GetStackOutput" not in json.dumps(synthesized.templates[part]), part


def test_nodes_import_subnet_security_group_and_file_system() -> None:
    templates = synth().templates
    compute, network, storage = templates["compute"], templates["network"], templates["storage"]
    group = only_resource(compute, "AWS::AutoScaling::AutoScalingGroup")["Properties"]
    (subnet,) = group["VPCZoneIdentifier"]
    assert _imported(subnet, network) == {"Ref": "NetworkVpcClusterSubnet1Subnet46780068"}
    data = only_resource(compute, "AWS::EC2::LaunchTemplate")["Properties"]["LaunchTemplateData"]
    for interface in data["NetworkInterfaces"]:
        (security_group,) = interface["Groups"]
        value = _imported(security_group, network)
        assert value["Fn::GetAtt"][0].startswith("EfaSecurityGroup")
    user_data = flatten(data["UserData"])
    (file_system,) = [
        i for i, r in storage["Resources"].items() if r["Type"] == "AWS::FSx::FileSystem"
    ]
    dns_exports = [
        name
        for name, value in _exports(storage).items()
        if value == {"Fn::GetAtt": [file_system, "DNSName"]}
    ]
    assert len(dns_exports) == 1
    assert json.dumps({"Fn::ImportValue": dns_exports[0]}) in user_data
