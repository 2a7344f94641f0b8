"""Network stack: one zone-ID-pinned cluster subnet, endpoints, flow logs, EFA security group."""

from __future__ import annotations

from typing import Any

import pytest
from aws_cdk.assertions import Match

from tests.cdk_support import STACK_PARTS, Synth, alternative, only_resource, resources, synth

#: What the nodes call with no internet: Run Command and Session Manager, logs, metrics,
#: bootstrap's lifecycle hook (autoscaling), the CloudWatch agent's and bootstrap's EC2 reads.
INTERFACE_ENDPOINT_SERVICES = (
    "ssm",
    "ssmmessages",
    "ec2messages",
    "logs",
    "monitoring",
    "autoscaling",
    "ec2",
)
#: Ports FSx for Lustre needs between the file servers and the clients, both ways (FSx for
#: Lustre user guide, "File system access control with Amazon VPC").
LUSTRE_PORTS = (988, *range(1018, 1024))


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
@pytest.mark.parametrize("which", ["default", "endpoints-only"])
def test_interface_endpoints_in_the_cluster_subnet(which: str, service: str) -> None:
    synthesized = synth() if which == "default" else alternative()
    region = synthesized.config.region
    synthesized.template("network").has_resource_properties(
        "AWS::EC2::VPCEndpoint",
        {
            "ServiceName": f"com.amazonaws.{region}.{service}",
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
    # Inbound only from itself and (Lustre ports only) the file system: nothing from outside,
    # no SSH.
    fsx_group = _group_id(template, "FsxSecurityGroup")
    for rule in ingress:
        props = rule["Properties"]
        if props["GroupId"] != group:
            continue
        assert props["SourceSecurityGroupId"] in (group, fsx_group), props
        if props["SourceSecurityGroupId"] == fsx_group:
            assert props["IpProtocol"] == "tcp"
            assert set(range(props["FromPort"], props["ToPort"] + 1)) <= set(LUSTRE_PORTS)


def _group_id(template: dict[str, Any], prefix: str) -> dict[str, Any]:
    (logical_id,) = [
        i for i in resources(template, "AWS::EC2::SecurityGroup") if i.startswith(prefix)
    ]
    return {"Fn::GetAtt": [logical_id, "GroupId"]}


def _allows(rules: list[dict[str, Any]], group: Any, peer_key: str, peer: Any, port: int) -> bool:
    return any(
        r["GroupId"] == group
        and r.get(peer_key) == peer
        and (
            r["IpProtocol"] == "-1"
            or (r["IpProtocol"] == "tcp" and r["FromPort"] <= port <= r["ToPort"])
        )
        for r in rules
    )


def _can_connect(template: dict[str, Any], source: Any, target: Any, port: int) -> bool:
    """A TCP connection from `source`'s members to `target`'s on `port` passes both groups:
    egress from the source to the target group, ingress to the target from the source group."""
    ingress = [
        r["Properties"] for r in resources(template, "AWS::EC2::SecurityGroupIngress").values()
    ]
    egress = [
        r["Properties"] for r in resources(template, "AWS::EC2::SecurityGroupEgress").values()
    ]
    return _allows(egress, source, "DestinationSecurityGroupId", target, port) and _allows(
        ingress, target, "SourceSecurityGroupId", source, port
    )


@pytest.mark.parametrize("port", LUSTRE_PORTS)
def test_lustre_flows_both_ways_between_file_system_and_nodes(default: Synth, port: int) -> None:
    template = default.templates["network"]
    nodes, fsx = _group_id(template, "EfaSecurityGroup"), _group_id(template, "FsxSecurityGroup")
    assert _can_connect(template, nodes, fsx, port)
    assert _can_connect(template, fsx, nodes, port)
    assert _can_connect(template, fsx, fsx, port)  # between the file servers


def test_lustre_ports_only(default: Synth) -> None:
    template = default.templates["network"]
    nodes, fsx = _group_id(template, "EfaSecurityGroup"), _group_id(template, "FsxSecurityGroup")
    assert not _can_connect(template, fsx, nodes, 22)
    assert not _can_connect(template, nodes, fsx, 1024)


@pytest.mark.parametrize("part", STACK_PARTS)
def test_no_security_group_admits_the_internet(default: Synth, part: str) -> None:
    template = default.templates[part]
    groups = resources(template, "AWS::EC2::SecurityGroup")
    assert groups or part != "network", "the network stack's groups were not found"
    inline = [
        (logical_id, rule)
        for logical_id, group in groups.items()
        for rule in group["Properties"].get("SecurityGroupIngress", [])
    ]
    separate = [
        (r["Properties"]["GroupId"]["Fn::GetAtt"][0], r["Properties"])
        for r in resources(template, "AWS::EC2::SecurityGroupIngress").values()
    ]
    # Every group of the template admits something (EFA from itself, FSx and the endpoints
    # from the nodes), so the rules below were read, not missed.
    assert {logical_id for logical_id, _ in inline + separate} == set(groups)
    for _, rule in inline + separate:
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
    """aws-cdk-lib's custom resource removes every rule of the cluster VPC's default group."""
    template = default.templates["network"]
    (vpc_id,) = resources(template, "AWS::EC2::VPC")
    restrict = only_resource(template, "Custom::VpcRestrictDefaultSG")["Properties"]
    assert restrict["DefaultSecurityGroupId"] == {"Fn::GetAtt": [vpc_id, "DefaultSecurityGroup"]}
    handler = restrict["ServiceToken"]["Fn::GetAtt"][0]
    assert template["Resources"][handler]["Type"] == "AWS::Lambda::Function"


def test_the_cluster_subnet_holds_the_largest_cluster_and_its_replacements() -> None:
    """A multi-node type's node takes one address (its other cards' interfaces are efa-only),
    so 1,024 nodes, a replacement launching for each, the interface endpoints and a generous
    allowance for FSx for Lustre's interfaces fit the /20 (4,096 addresses, 5 kept by AWS:
    Amazon VPC user guide, Subnet CIDR blocks)."""
    from stacks.compute import network_interfaces
    from stacks.config import CLUSTER_INSTANCE_TYPES, MAX_NODES
    from stacks.instance_types import INSTANCE_TYPES
    from stacks.network import CLUSTER_SUBNET_MASK, INTERFACE_ENDPOINTS

    for name in CLUSTER_INSTANCE_TYPES:
        spec = INSTANCE_TYPES[name]
        if not spec.supports_multi_node:
            continue
        interfaces = network_interfaces(
            efa_interfaces=spec.efa_interfaces,
            efa_only=spec.efa_only_interfaces,
            security_group_id="sg-1",
        )
        with_address = [i for i in interfaces if i.interface_type != "efa-only"]
        assert len(with_address) == 1, name
    fsx_allowance = 256
    needed = 2 * MAX_NODES + len(INTERFACE_ENDPOINTS) + fsx_allowance
    assert needed <= 2 ** (32 - CLUSTER_SUBNET_MASK) - 5, needed
