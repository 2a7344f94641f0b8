"""What EC2 answers about a node, field for field, so that the stand-in's answers are as large
as EC2's: a Step Functions task's result is limited to 262,144 bytes before its ResultSelector
runs (Step Functions API reference, TaskSucceededEventDetails.output: "The full JSON response
from a resource ... Maximum length of 262144"), and a trn1.32xlarge has 8 network interfaces,
a trn1n.32xlarge or trn2.48xlarge 16 (stacks/instance_types.py), each listed in full in every
DescribeInstances answer. Which interfaces a node has (network card, device index, type) comes
from the synthesized launch template, never from here.

The fields are those of the EC2 API reference's Instance and NetworkInterface (and
InstanceNetworkInterface) data types that EC2 fills in for an instance launched from a launch
template into a VPC with an IAM instance profile, EFA interfaces and Auto Scaling tags; values
have the lengths of real ones (IDs, ARNs, DNS names, MAC addresses).
"""

from __future__ import annotations

import functools
import hashlib
from datetime import datetime
from typing import Any

ACCOUNT = "123456789012"
PROFILE = "trainium-cluster-compute-NodeInstanceProfile"
VPC_ID = "vpc-0a1b2c3d4e5f60718"
SUBNET_ID = "subnet-0a1b2c3d4e5f60718"
GROUP = {
    "GroupName": "trainium-cluster-network-EfaSecurityGroup1A2B3C4D-0A1B2C3D4E5F",
    "GroupId": "sg-0a1b2c3d4e5f60718",
}


def _hex(seed: str, length: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:length]


def _dns(address: str, region: str) -> str:
    return f"ip-{address.replace('.', '-')}.{region}.compute.internal"


@functools.cache
def launch_template_interfaces(instance_type: str) -> tuple[dict[str, Any], ...]:
    """The NetworkInterfaces entries of the cluster's launch template for `instance_type`, as
    CloudFormation gets them: stacks/compute.py's `network_interfaces`, synthesized into a
    launch template (tests/test_ec2_shapes.py checks them against the whole compute stack's,
    for every instance type). Each entry's NetworkCardIndex, DeviceIndex and InterfaceType is
    what EC2 attaches to every node launched from it."""
    import aws_cdk as cdk
    from aws_cdk import aws_ec2 as ec2

    from stacks.compute import network_interfaces
    from stacks.instance_types import INSTANCE_TYPES

    spec = INSTANCE_TYPES[instance_type]
    app = cdk.App()
    stack = cdk.Stack(app, "LaunchTemplate")
    ec2.CfnLaunchTemplate(
        stack,
        "LaunchTemplate",
        launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
            instance_type=instance_type,
            network_interfaces=network_interfaces(
                efa_interfaces=spec.efa_interfaces,
                efa_only=spec.efa_only_interfaces,
                security_group_id=GROUP["GroupId"],
            ),
        ),
    )
    template = app.synth().get_stack_by_name("LaunchTemplate").template
    (resource,) = template["Resources"].values()
    entries = resource["Properties"]["LaunchTemplateData"]["NetworkInterfaces"]
    return tuple(sorted(entries, key=lambda e: (e.get("NetworkCardIndex", 0), e["DeviceIndex"])))


def network_interface(
    instance_id: str,
    address: str,
    entry: dict[str, Any],
    *,
    zone: str,
    region: str,
    launched: datetime,
) -> dict[str, Any]:
    """The interface EC2 attaches for one of the launch template's NetworkInterfaces entries,
    as DescribeNetworkInterfaces lists it: on its entry's network card and device index, of
    its type (`interface` where the entry names none). The primary interface (network card 0,
    device index 0) has the instance's address, another `efa` interface one of its own; an
    `efa-only` interface has none (EC2 user guide, "Elastic Fabric Adapter": an EFA-only
    interface supports only the EFA device, no IP address)."""
    card, device = entry.get("NetworkCardIndex", 0), entry["DeviceIndex"]
    kind = entry.get("InterfaceType", "interface")
    seed = f"{instance_id}/{card}/{device}"
    own = address if (card, device) == (0, 0) else f"10.0.{card}.{int(_hex(seed, 2), 16)}"
    addressed: dict[str, Any] = {"PrivateIpAddresses": []}
    if kind != "efa-only":
        addressed = {
            "PrivateDnsName": _dns(own, region),
            "PrivateIpAddress": own,
            "PrivateIpAddresses": [
                {"Primary": True, "PrivateDnsName": _dns(own, region), "PrivateIpAddress": own}
            ],
        }
    return {
        "Attachment": {
            "AttachTime": launched,
            "AttachmentId": f"eni-attach-{_hex(seed + 'a', 17)}",
            "DeleteOnTermination": entry.get("DeleteOnTermination", False),
            "DeviceIndex": device,
            "NetworkCardIndex": card,
            "InstanceId": instance_id,
            "InstanceOwnerId": ACCOUNT,
            "Status": "attached",
            "EnaSrdSpecification": {
                "EnaSrdEnabled": False,
                "EnaSrdUdpSpecification": {"EnaSrdUdpEnabled": False},
            },
        },
        "AvailabilityZone": zone,
        "ConnectionTrackingConfiguration": {
            "TcpEstablishedTimeout": 432000,
            "UdpStreamTimeout": 180,
            "UdpTimeout": 30,
        },
        "Description": entry.get("Description", ""),
        "Groups": [GROUP],
        "InterfaceType": kind,
        "Ipv6Addresses": [],
        "MacAddress": ":".join(_hex(seed + "m", 12)[i : i + 2] for i in range(0, 12, 2)),
        "NetworkInterfaceId": f"eni-{_hex(seed, 17)}",
        "OwnerId": ACCOUNT,
        **addressed,
        "RequesterManaged": False,
        "SourceDestCheck": True,
        "Status": "in-use",
        "SubnetId": SUBNET_ID,
        "TagSet": [],
        "VpcId": VPC_ID,
        "Operator": {"Managed": False},
    }


def instance_interface(interface: dict[str, Any]) -> dict[str, Any]:
    """The same interface as an Instance lists it (InstanceNetworkInterface)."""
    attachment = {
        k: v
        for k, v in interface["Attachment"].items()
        if k not in ("InstanceId", "InstanceOwnerId")
    }
    keep = ("Description", "Groups", "Ipv6Addresses", "MacAddress", "NetworkInterfaceId",
            "OwnerId", "PrivateDnsName", "PrivateIpAddress", "PrivateIpAddresses",
            "SourceDestCheck", "Status", "SubnetId", "VpcId", "InterfaceType",
            "Operator")  # fmt: skip
    return {"Attachment": attachment, **{k: interface[k] for k in keep if k in interface}}


def instance(
    *,
    instance_id: str,
    instance_type: str,
    image_id: str,
    state: str,
    zone: str,
    region: str,
    launched: datetime,
    interfaces: list[dict[str, Any]],
    tags: dict[str, str],
) -> dict[str, Any]:
    """An Instance as DescribeInstances lists it, with every interface."""
    primary = interfaces[0]
    return {
        "AmiLaunchIndex": 0,
        "ImageId": image_id,
        "InstanceId": instance_id,
        "InstanceType": instance_type,
        "LaunchTime": launched,
        "Monitoring": {"State": "disabled"},
        "Placement": {
            "AvailabilityZone": zone,
            "GroupName": "trainium-cluster-placement",
            "Tenancy": "default",
            "AvailabilityZoneId": "use1-az6",
        },
        "PrivateDnsName": primary["PrivateDnsName"],
        "PrivateIpAddress": primary["PrivateIpAddress"],
        "ProductCodes": [],
        "PublicDnsName": "",
        "State": {"Code": 16 if state == "running" else 48, "Name": state},
        "StateTransitionReason": "",
        "SubnetId": SUBNET_ID,
        "VpcId": VPC_ID,
        "Architecture": "x86_64",
        "BlockDeviceMappings": [
            {
                "DeviceName": "/dev/sda1",
                "Ebs": {
                    "AttachTime": launched,
                    "DeleteOnTermination": True,
                    "Status": "attached",
                    "VolumeId": f"vol-{_hex(instance_id, 17)}",
                },
            }
        ],
        "ClientToken": f"fleet-{_hex(instance_id + 'c', 8)}-{_hex(instance_id + 'd', 4)}",
        "EbsOptimized": True,
        "EnaSupport": True,
        "Hypervisor": "xen",
        "IamInstanceProfile": {
            "Arn": f"arn:aws:iam::{ACCOUNT}:instance-profile/{PROFILE}-{_hex(instance_id, 12)}",
            "Id": "AIPA" + _hex(instance_id + "p", 17).upper(),
        },
        "NetworkInterfaces": [instance_interface(i) for i in interfaces],
        "RootDeviceName": "/dev/sda1",
        "RootDeviceType": "ebs",
        "SecurityGroups": [GROUP],
        "SourceDestCheck": True,
        "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
        "VirtualizationType": "hvm",
        "CpuOptions": {"CoreCount": 64, "ThreadsPerCore": 2},
        "CapacityReservationSpecification": {"CapacityReservationPreference": "open"},
        "HibernationOptions": {"Configured": False},
        "MetadataOptions": {
            "State": "applied",
            "HttpTokens": "required",
            "HttpPutResponseHopLimit": 1,
            "HttpEndpoint": "enabled",
            "HttpProtocolIpv6": "disabled",
            "InstanceMetadataTags": "enabled",
        },
        "EnclaveOptions": {"Enabled": False},
        "BootMode": "uefi-preferred",
        "PlatformDetails": "Linux/UNIX",
        "UsageOperation": "RunInstances",
        "UsageOperationUpdateTime": launched,
        "PrivateDnsNameOptions": {
            "HostnameType": "ip-name",
            "EnableResourceNameDnsARecord": False,
            "EnableResourceNameDnsAAAARecord": False,
        },
        "MaintenanceOptions": {"AutoRecovery": "default"},
        "CurrentInstanceBootMode": "uefi",
        "NetworkPerformanceOptions": {"BandwidthWeighting": "default"},
        "Operator": {"Managed": False},
    }
