"""Network stack: one zone-ID-pinned cluster subnet, endpoints, flow logs, EFA security group."""

from __future__ import annotations

from typing import Any

import pytest
from aws_cdk.assertions import Match

from tests.cdk_support import STACK_PARTS, Synth, alternative, only_resource, resources, synth

INTERFACE_ENDPOINT_SERVICES = ("ssm", "ssmmessages", "ec2messages", "logs", "monitoring")


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def _efa_group_id(template: dict[str, Any]) -> dict[str, Any]:
    groups = resources(template, "AWS::EC2::SecurityGroup")
    (efa_id,) = [i for i in groups if i.startswith("EfaSecurityGroup")]
    return {"Fn::GetAtt": [efa_id, "GroupId"]}


def test_every_subnet_is_pinned_to_the_zone_id(default: Synth) -> None:
    subnets = resources(default.templates["network"], "AWS::EC2::Subnet")
    assert len(subnets) == 2  # the cluster subnet and the NAT gateway's public subnet
    for subnet in subnets.values():
        assert subnet["Properties"]["AvailabilityZoneId"] == "use1-az6"
        assert "AvailabilityZone" not in subnet["Properties"]
        assert subnet["Properties"]["MapPublicIpOnLaunch"] is False


def test_endpoints_only_network_has_no_internet_path() -> None:
    template = alternative().templates["network"]
    subnets = resources(template, "AWS::EC2::Subnet")
    assert len(subnets) == 1
    assert next(iter(subnets.values()))["Properties"]["AvailabilityZoneId"] == "usw2-az4"
    for absent in ("AWS::EC2::NatGateway", "AWS::EC2::InternetGateway", "AWS::EC2::EIP"):
        assert not resources(template, absent), absent


@pytest.mark.parametrize("service", INTERFACE_ENDPOINT_SERVICES)
def test_interface_endpoints_in_the_cluster_subnet(default: Synth, service: str) -> None:
    default.template("network").has_resource_properties(
        "AWS::EC2::VPCEndpoint",
        {
            "ServiceName": f"com.amazonaws.us-east-1.{service}",
            "VpcEndpointType": "Interface",
            "PrivateDnsEnabled": True,
            "SubnetIds": [{"Ref": Match.string_like_regexp("ClusterSubnet")}],
        },
    )


def test_s3_gateway_endpoint(default: Synth) -> None:
    default.template("network").has_resource_properties(
        "AWS::EC2::VPCEndpoint",
        {"VpcEndpointType": "Gateway", "ServiceName": Match.any_value()},
    )


def test_efa_security_group_allows_all_traffic_to_and_from_itself(default: Synth) -> None:
    template = default.templates["network"]
    group = _efa_group_id(template)
    ingress = resources(template, "AWS::EC2::SecurityGroupIngress").values()
    egress = resources(template, "AWS::EC2::SecurityGroupEgress").values()
    assert any(
        r["Properties"]["GroupId"] == group
        and r["Properties"]["SourceSecurityGroupId"] == group
        and r["Properties"]["IpProtocol"] == "-1"
        for r in ingress
    )
    assert any(
        r["Properties"]["GroupId"] == group
        and r["Properties"].get("DestinationSecurityGroupId") == group
        and r["Properties"]["IpProtocol"] == "-1"
        for r in egress
    )
    # The self rule is all the inbound there is: nothing from outside, no SSH.
    assert [r["Properties"]["SourceSecurityGroupId"] for r in ingress
            if r["Properties"]["GroupId"] == group] == [group]  # fmt: skip


@pytest.mark.parametrize("part", STACK_PARTS)
def test_no_security_group_admits_the_internet(default: Synth, part: str) -> None:
    template = default.templates[part]
    rules = [
        rule
        for group in resources(template, "AWS::EC2::SecurityGroup").values()
        for rule in group["Properties"].get("SecurityGroupIngress", [])
    ] + [r["Properties"] for r in resources(template, "AWS::EC2::SecurityGroupIngress").values()]
    for rule in rules:
        assert rule.get("CidrIp") not in ("0.0.0.0/0",), rule
        assert rule.get("CidrIpv6") not in ("::/0",), rule
        assert "CidrIp" not in rule, f"ingress only from security groups: {rule}"


def test_flow_logs_capture_all_traffic_into_an_encrypted_log_group(default: Synth) -> None:
    template = default.template("network")
    template.has_resource_properties(
        "AWS::EC2::FlowLog", {"TrafficType": "ALL", "ResourceType": "VPC"}
    )
    template.has_resource_properties(
        "AWS::Logs::LogGroup",
        {
            "RetentionInDays": 365,
            "KmsKeyId": {"Fn::GetAtt": [Match.string_like_regexp("FlowLogKey"), "Arn"]},
        },
    )
    template.has_resource_properties("AWS::KMS::Key", {"EnableKeyRotation": True})


def test_default_security_group_is_locked_down(default: Synth) -> None:
    only_resource(default.templates["network"], "Custom::VpcRestrictDefaultSG")
