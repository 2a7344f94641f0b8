"""Compute stack: the nodes. A launch template with one EFA interface per network card, a
cluster placement group, and an Auto Scaling group of fixed size that replaces failed nodes.

Nodes get their software from two S3 assets (the repository's scripts/node and workload
folders); user data only downloads them, writes /etc/trainium-cluster/cluster.env and runs
bootstrap.sh. All node logic lives in scripts/node/*.sh.
"""

from __future__ import annotations

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

from stacks.config import CLUSTER_TAG_KEY, ROLE_TAG_KEY, WORKER_ROLE, ClusterConfig
from stacks.nag import acknowledge
from stacks.storage import FSX_MOUNT_POINT, StorageStack

REPO_ROOT = Path(__file__).resolve().parent.parent
NODE_SCRIPTS_DIR = REPO_ROOT / "scripts" / "node"
WORKLOAD_DIR = REPO_ROOT / "workload"
ASSET_EXCLUDES = ["__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache", "*.egg-info"]

INSTALL_ROOT = "/opt/trainium-cluster"
ENV_FILE = "/etc/trainium-cluster/cluster.env"
NEURON_VENV = "/opt/aws_neuronx_venv_pytorch_2_9"
#: Root device of the Ubuntu Neuron DLAMI (a pinned AMI of another OS may differ).
ROOT_DEVICE_NAME = "/dev/sda1"
#: Time a new node gets to boot and bootstrap before its status checks count.
HEALTH_CHECK_GRACE = cdk.Duration.minutes(15)
ASG_NOTIFICATIONS = [
    "autoscaling:EC2_INSTANCE_LAUNCH",
    "autoscaling:EC2_INSTANCE_LAUNCH_ERROR",
    "autoscaling:EC2_INSTANCE_TERMINATE",
    "autoscaling:EC2_INSTANCE_TERMINATE_ERROR",
]


def network_interfaces(
    *, efa_interfaces: int, security_group_id: str
) -> list[ec2.CfnLaunchTemplate.NetworkInterfaceProperty]:
    """One EFA interface per network card: card 0 at device index 0, the others at 1.

    The subnet comes from the Auto Scaling group (a launch template used by a group names none).
    An instance type without EFA gets one ordinary interface.
    """
    if efa_interfaces == 0:
        return [
            ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
                device_index=0, groups=[security_group_id], delete_on_termination=True
            )
        ]
    return [
        ec2.CfnLaunchTemplate.NetworkInterfaceProperty(
            network_card_index=card,
            device_index=0 if card == 0 else 1,
            interface_type="efa",
            groups=[security_group_id],
            delete_on_termination=True,
            description=f"EFA on network card {card}",
        )
        for card in range(efa_interfaces)
    ]


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
                sid="FindTrainingLogGroup",
                # Run Command checks that the output log group exists before writing to it.
                actions=["logs:DescribeLogGroups"],
                resources=[
                    stack.format_arn(
                        service="logs",
                        resource="log-group",
                        resource_name="*",
                        arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
                    )
                ],
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
                # Read-only calls the CloudWatch agent makes to label metrics; they have no
                # resource type.
                actions=["ec2:DescribeTags", "ec2:DescribeVolumes"],
                resources=["*"],
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
            "ec2:DescribeTags and ec2:DescribeVolumes support no resource-level permissions.",
        )
        acknowledge(
            self.policy,
            f"AwsSolutions-IAM5[Resource::arn:{RegionInfo.get(config.region).partition}:logs:"
            f"{config.region}:<AWS::AccountId>:log-group:*]",
            "logs:DescribeLogGroups lists log groups and supports no narrower resource; Run "
            "Command calls it to find the training log group before writing output to it.",
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
    ) -> None:
        super().__init__(scope, construct_id)
        if config.ami.startswith("ami-"):
            image_id = config.ami
        else:
            # A CloudFormation parameter resolved at deploy time: every node launched from this
            # template version runs the same image, even when the parameter moves on.
            image_id = ec2.MachineImage.from_ssm_parameter(config.ami).get_image(self).image_id
        # Nodes of a Capacity Block are already placed close together (EC2 UltraClusters) and
        # launch where the block is; everything else goes into a cluster placement group.
        self.placement_group = (
            None
            if config.capacity_block
            else ec2.PlacementGroup(
                self, "PlacementGroup", strategy=ec2.PlacementGroupStrategy.CLUSTER
            )
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
                    security_group_id=security_group.security_group_id,
                ),
                metadata_options=ec2.CfnLaunchTemplate.MetadataOptionsProperty(
                    http_tokens="required",
                    http_endpoint="enabled",
                    http_put_response_hop_limit=1,
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
                    for resource_type in ("volume", "network-interface")
                ],
            ),
        )
        self.auto_scaling_group = autoscaling.CfnAutoScalingGroup(
            self,
            "AutoScalingGroup",
            auto_scaling_group_name=config.auto_scaling_group_name,
            min_size=str(config.node_count),
            max_size=str(config.node_count),
            desired_capacity=str(config.node_count),
            vpc_zone_identifier=[subnet.subnet_id],
            placement_group=self.placement_group.placement_group_name
            if self.placement_group
            else None,
            launch_template=autoscaling.CfnAutoScalingGroup.LaunchTemplateSpecificationProperty(
                launch_template_id=self.launch_template.ref,
                version=self.launch_template.attr_latest_version_number,
            ),
            health_check_type="EC2",
            health_check_grace_period=int(HEALTH_CHECK_GRACE.to_seconds()),
            metrics_collection=[
                autoscaling.CfnAutoScalingGroup.MetricsCollectionProperty(granularity="1Minute")
            ],
            notification_configurations=[
                autoscaling.CfnAutoScalingGroup.NotificationConfigurationProperty(
                    topic_arn=alarm_topic.topic_arn, notification_types=ASG_NOTIFICATIONS
                )
            ],
        )
        cdk.Tags.of(self.auto_scaling_group).add(ROLE_TAG_KEY, WORKER_ROLE)
        cdk.Tags.of(self.auto_scaling_group).add("Name", f"{config.cluster_name}-worker")
        acknowledge(
            self.auto_scaling_group,
            ["AwsSolutions-AS2", "NIST.800.53.R5-AutoScalingGroupELBHealthCheckRequired"],
            "Training nodes serve no load balancer; EC2 status checks detect failed nodes, "
            "which the group replaces.",
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
        workload = s3_assets.Asset(
            self, "WorkloadAsset", path=str(WORKLOAD_DIR), exclude=ASSET_EXCLUDES
        )
        role = NodeRole(
            self,
            "NodeRole",
            config=config,
            storage=storage,
            training_log_group=training_log_group,
            assets=[node_scripts, workload],
        )
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
            "COMPILE_CACHE_BUCKET": storage.compile_cache_bucket.bucket_name,
            "COMPILE_CACHE_URL": storage.compile_cache_url,
            "TRAINING_LOG_GROUP": training_log_group.log_group_name,
            "WORKLOAD_DIR": f"{INSTALL_ROOT}/workload",
            "NEURON_VENV": NEURON_VENV,
            "METRICS_NAMESPACE": config.metrics_namespace,
        }
        self.user_data = node_user_data(
            region=config.region, node_scripts=node_scripts, workload=workload, env=env
        )
        self.nodes = ClusterNodes(
            self,
            "Nodes",
            config=config,
            subnet=subnet,
            security_group=efa_security_group,
            instance_profile=role.instance_profile,
            user_data=self.user_data,
            alarm_topic=alarm_topic,
        )
        self.node_role = role
        self.launch_template = self.nodes.launch_template
        self.auto_scaling_group = self.nodes.auto_scaling_group


def node_user_data(
    *,
    region: str,
    node_scripts: s3_assets.Asset,
    workload: s3_assets.Asset,
    env: dict[str, str],
) -> ec2.UserData:
    """Download and unpack the two assets, write cluster.env, run bootstrap.sh. Nothing else."""
    user_data = ec2.UserData.for_linux()
    user_data.add_commands("set -euo pipefail")
    zips = {}
    for name, asset in (("scripts/node", node_scripts), ("workload", workload)):
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
