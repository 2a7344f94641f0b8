"""Compute stack: EFA launch template, placement group, fixed-size Auto Scaling group, role."""

from __future__ import annotations

from typing import Any

import pytest

from stacks.config import CLUSTER_TAG_KEY, ROLE_TAG_KEY
from stacks.instance_types import INSTANCE_TYPES
from tests.cdk_support import Synth, alternative, flatten, only_resource, resources, synth

CLUSTER_ENV_KEYS = (
    "CLUSTER_NAME",
    "AWS_REGION",
    "INSTANCE_TYPE",
    "NODE_COUNT",
    "FSX_DNS_NAME",
    "FSX_MOUNT_NAME",
    "FSX_MOUNT_POINT",
    "DATA_BUCKET",
    "CHECKPOINT_BUCKET",
    "COMPILE_CACHE_BUCKET",
    "COMPILE_CACHE_URL",
    "TRAINING_LOG_GROUP",
    "WORKLOAD_DIR",
    "NEURON_VENV",
)


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def launch_template_data(synthesized: Synth) -> dict[str, Any]:
    template = only_resource(synthesized.templates["compute"], "AWS::EC2::LaunchTemplate")
    data: dict[str, Any] = template["Properties"]["LaunchTemplateData"]
    return data


def user_data_lines(synthesized: Synth) -> list[str]:
    return flatten(launch_template_data(synthesized)["UserData"]).splitlines()


def assert_efa_interfaces(data: dict[str, Any], expected: int) -> None:
    interfaces = data["NetworkInterfaces"]
    assert len(interfaces) == expected
    for card, interface in enumerate(interfaces):
        assert interface["NetworkCardIndex"] == card
        assert interface["DeviceIndex"] == (0 if card == 0 else 1)
        assert interface["InterfaceType"] == "efa"
        assert interface["DeleteOnTermination"] is True
        assert len(interface["Groups"]) == 1
        assert "EfaSecurityGroup" in flatten(interface["Groups"][0])
        assert "SubnetId" not in interface  # the Auto Scaling group places every node
    assert "SecurityGroupIds" not in data  # not allowed next to network interfaces


def test_one_efa_interface_per_network_card(default: Synth) -> None:
    assert_efa_interfaces(launch_template_data(default), 8)
    assert INSTANCE_TYPES["trn1.32xlarge"].efa_interfaces == 8


def test_imdsv2_is_required(default: Synth) -> None:
    options = launch_template_data(default)["MetadataOptions"]
    assert options["HttpTokens"] == "required"
    assert options["HttpPutResponseHopLimit"] == 1


def test_root_volume_is_encrypted_gp3(default: Synth) -> None:
    (mapping,) = launch_template_data(default)["BlockDeviceMappings"]
    assert mapping["Ebs"] == {
        "VolumeType": "gp3",
        "VolumeSize": 512,
        "Encrypted": True,
        "DeleteOnTermination": True,
    }


def test_ami_comes_from_the_dlami_parameter_at_deploy_time(default: Synth) -> None:
    template = default.templates["compute"]
    image = launch_template_data(default)["ImageId"]
    parameter = template["Parameters"][image["Ref"]]
    assert parameter["Type"] == "AWS::SSM::Parameter::Value<AWS::EC2::Image::Id>"
    assert parameter["Default"] == default.config.ami


def test_pinned_ami_and_capacity_block() -> None:
    synthesized = alternative()
    data = launch_template_data(synthesized)
    assert data["ImageId"] == "ami-0123456789abcdef0"
    assert data["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0123456789abcdef0"}
    }
    assert data["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    # A Capacity Block places its instances itself: no placement group of ours.
    template = synthesized.templates["compute"]
    assert not resources(template, "AWS::EC2::PlacementGroup")
    group = only_resource(template, "AWS::AutoScaling::AutoScalingGroup")["Properties"]
    assert "PlacementGroup" not in group
    assert group["DesiredCapacity"] == "4"


def test_no_reservation_by_default(default: Synth) -> None:
    data = launch_template_data(default)
    assert "CapacityReservationSpecification" not in data
    assert "InstanceMarketOptions" not in data


def test_cluster_placement_group(default: Synth) -> None:
    default.template("compute").has_resource_properties(
        "AWS::EC2::PlacementGroup", {"Strategy": "cluster"}
    )


def test_auto_scaling_group_has_fixed_size_in_one_subnet(default: Synth) -> None:
    template = default.templates["compute"]
    group = only_resource(template, "AWS::AutoScaling::AutoScalingGroup")["Properties"]
    assert group["MinSize"] == group["MaxSize"] == group["DesiredCapacity"] == "2"
    assert group["AutoScalingGroupName"] == "trainium-workers"
    (subnet,) = group["VPCZoneIdentifier"]
    assert "ClusterSubnet" in flatten(subnet)
    (placement_group_id,) = resources(template, "AWS::EC2::PlacementGroup")
    assert group["PlacementGroup"] == {"Fn::GetAtt": [placement_group_id, "GroupName"]}
    assert group["HealthCheckType"] == "EC2"
    (launch_template_id,) = resources(template, "AWS::EC2::LaunchTemplate")
    assert group["LaunchTemplate"]["Version"] == {
        "Fn::GetAtt": [launch_template_id, "LatestVersionNumber"]
    }
    assert group["NotificationConfigurations"][0]["TopicARN"]


def test_nodes_carry_the_tags_the_operator_tooling_uses(default: Synth) -> None:
    group = only_resource(default.templates["compute"], "AWS::AutoScaling::AutoScalingGroup")
    tags = {t["Key"]: t for t in group["Properties"]["Tags"]}
    assert tags[CLUSTER_TAG_KEY] == {
        "Key": CLUSTER_TAG_KEY,
        "Value": "trainium",
        "PropagateAtLaunch": True,
    }
    assert tags[ROLE_TAG_KEY] == {"Key": ROLE_TAG_KEY, "Value": "worker", "PropagateAtLaunch": True}


def test_user_data_only_unpacks_writes_env_and_bootstraps(default: Synth) -> None:
    lines = user_data_lines(default)
    downloads = [line for line in lines if line.startswith("aws s3 cp ")]
    assert len(downloads) == 2
    assert all("cdk-hnb659fds-assets" in line and ".zip'" in line for line in downloads)
    unpack = "python3 -m zipfile -e /opt/trainium-cluster/dist/"
    assert f"{unpack}scripts-node.zip /opt/trainium-cluster/scripts/node" in lines
    assert f"{unpack}workload.zip /opt/trainium-cluster/workload" in lines
    start = lines.index("cat > /etc/trainium-cluster/cluster.env <<'CLUSTER_ENV'")
    end = lines.index("CLUSTER_ENV", start)
    env = dict(line.split("=", 1) for line in lines[start + 1 : end])
    assert set(CLUSTER_ENV_KEYS) <= set(env)
    assert env["CLUSTER_NAME"] == "trainium"
    assert env["NODE_COUNT"] == "2"
    assert env["FSX_MOUNT_POINT"] == "/fsx"
    assert env["WORKLOAD_DIR"] == "/opt/trainium-cluster/workload"
    assert env["NEURON_VENV"] == "/opt/aws_neuronx_venv_pytorch_2_9"
    assert env["COMPILE_CACHE_URL"].startswith("s3://")
    assert env["COMPILE_CACHE_URL"].endswith("/neuron-compile-cache/")
    assert lines[-1] == (
        "bash /opt/trainium-cluster/scripts/node/bootstrap.sh "
        "--env-file /etc/trainium-cluster/cluster.env"
    )


def test_node_role_is_scoped(default: Synth) -> None:
    template = default.templates["compute"]
    role = only_resource(template, "AWS::IAM::Role")["Properties"]
    managed = [flatten(arn) for arn in role["ManagedPolicyArns"]]
    assert any(arn.endswith(":iam::aws:policy/AmazonSSMManagedInstanceCore") for arn in managed)
    assert any("NodeAccessPolicy" in arn for arn in managed)  # the storage stack's S3 policy
    assert "Policies" not in role
    policy = only_resource(template, "AWS::IAM::ManagedPolicy")["Properties"]
    statements = {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}
    unscoped = {sid for sid, s in statements.items() if s["Resource"] == "*"}
    # Only actions that have no resource type may use "*".
    assert unscoped == {"PublishNodeMetrics", "DescribeOwnInstance"}
    assert statements["PublishNodeMetrics"]["Condition"] == {
        "StringEquals": {"cloudwatch:namespace": "TrainiumCluster/trainium"}
    }
    software = [flatten(r) for r in statements["ReadNodeSoftware"]["Resource"]]
    assert len(software) == 2  # exactly the two asset objects, not the assets bucket
    assert all(arn.endswith(".zip") and "cdk-hnb659fds-assets" in arn for arn in software)
    assert "trainium-operations" in flatten(statements["WriteTrainingLogs"]["Resource"])
