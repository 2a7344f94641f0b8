"""Operations stack: SSM Command documents, the training log group, the job supervisor (a Step
Functions state machine, stacks/supervisor.py), dashboard, alarms, outputs.

It deploys before the compute stack (the nodes write to its log group and notify its topic), so
destroying the compute stack alone stops the instances and keeps logs, documents and dashboards.
It watches the Auto Scaling group by its configured name and carries every output that
`scripts/cluster.py` reads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aws_cdk as cdk
import yaml
from aws_cdk import aws_cloudwatch as cloudwatch
from aws_cdk import aws_cloudwatch_actions as cloudwatch_actions
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from aws_cdk import aws_ssm as ssm
from constructs import Construct

from stacks.config import CLUSTER_TAG_KEY, ClusterConfig
from stacks.drain import CapacityDrain
from stacks.job_queue import JobDispatcher, queue_table
from stacks.log_groups import allow_cloudwatch_logs, retention
from stacks.progress_metric import (
    METRIC_NAME,
    METRIC_VALUE,
    PATTERN_ANY,
    PATTERN_PHASE,
    PHASE_DIMENSION,
)
from stacks.settings_file import settings_record
from stacks.storage import StorageStack
from stacks.supervisor import JobSupervisor

SSM_DOCUMENTS_DIR = Path(__file__).resolve().parent / "ssm_documents"
#: Search term for the NeuronCore utilization (percent busy) that neuron-monitor publishes.
NEURONCORE_UTILIZATION_TERM = "utilization"
FIVE_MINUTES = cdk.Duration.minutes(5)
ONE_MINUTE = cdk.Duration.minutes(1)


def load_ssm_documents() -> dict[str, dict[str, Any]]:
    """Every stacks/ssm_documents/<Name>.yaml, parsed, by Name."""
    return {
        path.stem: yaml.safe_load(path.read_text(encoding="utf-8"))
        for path in sorted(SSM_DOCUMENTS_DIR.glob("*.yaml"))
    }


class OperationsStack(cdk.Stack):
    """What operators use to run and watch training on the cluster."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        storage: StorageStack,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        self.config = config
        self.key = kms.Key(
            self,
            "OperationsKey",
            description=f"{config.cluster_name}: encrypts the training log group and alarm topic",
            enable_key_rotation=True,
            removal_policy=cdk.RemovalPolicy.RETAIN
            if config.retain_data
            else cdk.RemovalPolicy.DESTROY,
        )
        allow_cloudwatch_logs(self.key)
        self.training_log_group = logs.LogGroup(
            self,
            "TrainingLogGroup",
            retention=retention(config.log_retention_days),
            encryption_key=self.key,
            removal_policy=cdk.RemovalPolicy.RETAIN
            if config.retain_data
            else cdk.RemovalPolicy.DESTROY,
        )
        self._progress_metric()
        self.documents = {
            name: ssm_document(self, name, content)
            for name, content in load_ssm_documents().items()
        }
        self.alarm_topic = self._alarm_topic()
        self.queue_table = queue_table(self, config)
        self.supervisor = JobSupervisor(
            self,
            "JobSupervisor",
            config=config,
            documents=self.documents,
            training_log_group=self.training_log_group,
            topic=self.alarm_topic,
            key=self.key,
            queue_table=self.queue_table,
        )
        self.dispatcher = JobDispatcher(
            self,
            "JobDispatcher",
            config=config,
            table=self.queue_table,
            supervisor=self.supervisor.state_machine,
            supervisor_name=self.supervisor.state_machine_name,
            key=self.key,
        )
        # A Capacity Block's end: the running job is stopped, saved, before the scale-in.
        self.drain = (
            CapacityDrain(
                self,
                "CapacityDrain",
                config=config,
                table=self.queue_table,
                supervisor_arn=self.supervisor.state_machine.state_machine_arn,
                supervisor_name=self.supervisor.state_machine_name,
                stop_document=self.documents["StopTraining"],
                training_log_group=self.training_log_group,
                key=self.key,
            )
            if config.capacity_block
            else None
        )
        self.dashboard = self._dashboard(storage.file_system)
        self._alarms(storage.file_system)
        self._outputs(storage)

    def _alarm_topic(self) -> sns.Topic:
        config = self.config
        # CloudWatch alarms and the Auto Scaling group's notifications publish to an encrypted
        # topic only if the key lets them.
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AllowCloudWatchAlarms",
                principals=[iam.ServicePrincipal("cloudwatch.amazonaws.com")],
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                resources=["*"],  # in a key policy, "*" is this key
                conditions={"StringEquals": {"aws:SourceAccount": self.account}},
            )
        )
        # The Auto Scaling service-linked role publishes the group's notifications. A key policy
        # may only name a principal that exists: the role exists once the account has had an
        # Auto Scaling group (README: `aws iam create-service-linked-role` on a new account).
        self.key.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AllowAutoScalingNotifications",
                principals=[iam.ArnPrincipal(self.auto_scaling_service_role_arn)],
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                resources=["*"],
            )
        )
        topic = sns.Topic(
            self,
            "AlarmTopic",
            display_name=f"{config.cluster_name} cluster alarms",
            master_key=self.key,
            enforce_ssl=True,
        )
        if config.alarm_email:
            topic.add_subscription(subscriptions.EmailSubscription(config.alarm_email))
        return topic

    @property
    def auto_scaling_service_role_arn(self) -> str:
        return self.format_arn(
            service="iam",
            region="",
            resource="role",
            resource_name="aws-service-role/autoscaling.amazonaws.com/AWSServiceRoleForAutoScaling",
        )

    # Metrics -----------------------------------------------------------------------------
    def _progress_metric(self) -> None:
        """Rank 0's metrics-file lines, shipped to the training log group, as the metric
        JobStep in the cluster's namespace: one filter for every line, one by phase
        (stacks/progress_metric.py says why each is as it is)."""
        for construct_id, pattern, dimensions in (
            ("ProgressMetricFilter", PATTERN_ANY, None),
            ("ProgressPhaseMetricFilter", PATTERN_PHASE, {PHASE_DIMENSION: "$.phase"}),
        ):
            logs.MetricFilter(
                self,
                construct_id,
                log_group=self.training_log_group,
                filter_pattern=logs.FilterPattern.literal(pattern),
                metric_namespace=self.config.metrics_namespace,
                metric_name=METRIC_NAME,
                metric_value=METRIC_VALUE,
                dimensions=dimensions,
            )

    def _asg_metric(
        self,
        namespace: str,
        name: str,
        statistic: str,
        label: str,
        period: cdk.Duration = FIVE_MINUTES,
    ) -> cloudwatch.Metric:
        return cloudwatch.Metric(
            namespace=namespace,
            metric_name=name,
            dimensions_map={"AutoScalingGroupName": self.config.auto_scaling_group_name},
            statistic=statistic,
            label=label,
            period=period,
        )

    def _fsx_metric(
        self, file_system: fsx.CfnFileSystem, name: str, statistic: str, label: str
    ) -> cloudwatch.Metric:
        return cloudwatch.Metric(
            namespace="AWS/FSx",
            metric_name=name,
            dimensions_map={"FileSystemId": file_system.ref},
            statistic=statistic,
            label=label,
            period=FIVE_MINUTES,
        )

    def _neuroncore_utilization(self) -> cloudwatch.MathExpression:
        # neuron-monitor-cloudwatch.py (started by bootstrap.sh) publishes per-instance and
        # per-core series under the cluster's namespace; a search finds them whatever
        # dimensions and exact metric name the DLAMI's version of the script uses. Within that
        # namespace only NeuronCore utilization matches "utilization" (the CloudWatch agent's
        # own metrics there are *_used_percent).
        return cloudwatch.MathExpression(
            expression=(
                f'SEARCH(\'Namespace="{self.config.metrics_namespace}" '
                f"{NEURONCORE_UTILIZATION_TERM}', 'Average', 60)"
            ),
            label="NeuronCore utilization",
            period=ONE_MINUTE,
            using_metrics={},
        )

    def _dashboard(self, file_system: fsx.CfnFileSystem) -> cloudwatch.Dashboard:
        config = self.config
        node_metrics = {
            "in_service": self._asg_metric(
                "AWS/AutoScaling", "GroupInServiceInstances", "Minimum", "Nodes in service"
            ),
        }
        fsx_read = self._fsx_metric(file_system, "DataReadBytes", "Sum", "read")
        fsx_write = self._fsx_metric(file_system, "DataWriteBytes", "Sum", "write")
        dashboard = cloudwatch.Dashboard(
            self,
            "Dashboard",
            default_interval=cdk.Duration.hours(6),
            period_override=cloudwatch.PeriodOverride.AUTO,
        )
        dashboard.add_widgets(
            cloudwatch.TextWidget(
                markdown=(
                    f"# {config.cluster_name}: {config.node_count} x {config.instance_type}\n"
                    f"Nodes carry the tag `{CLUSTER_TAG_KEY}={config.cluster_name}`. "
                    f"Training output: log group `{self.training_log_group.log_group_name}`."
                ),
                width=24,
                height=2,
            )
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="NeuronCore utilization (%, from neuron-monitor)",
                left=[self._neuroncore_utilization()],
                left_y_axis=cloudwatch.YAxisProps(min=0, max=100),
                width=12,
            ),
            cloudwatch.GraphWidget(
                title="CPU utilization (%)",
                left=[
                    self._asg_metric("AWS/EC2", "CPUUtilization", "Average", "average"),
                    self._asg_metric("AWS/EC2", "CPUUtilization", "Maximum", "busiest node"),
                ],
                left_y_axis=cloudwatch.YAxisProps(min=0, max=100),
                width=12,
            ),
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Network (bytes per 5 minutes, all nodes)",
                left=[
                    self._asg_metric("AWS/EC2", "NetworkIn", "Sum", "in"),
                    self._asg_metric("AWS/EC2", "NetworkOut", "Sum", "out"),
                ],
                width=12,
            ),
            cloudwatch.GraphWidget(
                title="FSx for Lustre throughput (MB/s)",
                left=[
                    cloudwatch.MathExpression(
                        expression="read / PERIOD(read) / 1000000",
                        using_metrics={"read": fsx_read},
                        label="read",
                    ),
                    cloudwatch.MathExpression(
                        expression="write / PERIOD(write) / 1000000",
                        using_metrics={"write": fsx_write},
                        label="write",
                    ),
                ],
                width=12,
            ),
        )
        dashboard.add_widgets(
            cloudwatch.GraphWidget(
                title="Nodes in service",
                left=[node_metrics["in_service"]],
                left_annotations=[
                    cloudwatch.HorizontalAnnotation(value=config.node_count, label="node_count")
                ],
                left_y_axis=cloudwatch.YAxisProps(min=0),
                width=12,
            ),
            cloudwatch.LogQueryWidget(
                title="Latest training output",
                log_group_names=[self.training_log_group.log_group_name],
                query_lines=[
                    "fields @timestamp, @logStream, @message",
                    "sort @timestamp desc",
                    "limit 50",
                ],
                width=12,
            ),
        )
        return dashboard

    def _alarms(self, file_system: fsx.CfnFileSystem) -> None:
        config = self.config
        action = cloudwatch_actions.SnsAction(self.alarm_topic)
        alarms = [
            cloudwatch.Alarm(
                self,
                "NodesMissingAlarm",
                alarm_description=(
                    "Fewer nodes in service than the group wants for 15 minutes: a node failed "
                    "(or its bootstrap did) and its replacement has not come up (capacity?). "
                    "Compared with the desired capacity, not node_count: a Capacity Block's "
                    "group is empty outside the block."
                ),
                metric=cloudwatch.MathExpression(
                    expression="desired - inService",
                    using_metrics={
                        "desired": self._asg_metric(
                            "AWS/AutoScaling", "GroupDesiredCapacity", "Maximum", "Desired"
                        ),
                        "inService": self._asg_metric(
                            "AWS/AutoScaling",
                            "GroupInServiceInstances",
                            "Minimum",
                            "Nodes in service",
                        ),
                    },
                    label="Nodes missing",
                    period=FIVE_MINUTES,
                ),
                threshold=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                evaluation_periods=3,
                treat_missing_data=cloudwatch.TreatMissingData.MISSING,
            ),
            cloudwatch.Alarm(
                self,
                "StatusCheckFailedAlarm",
                alarm_description=(
                    "An instance or system status check failed on a node: the Auto Scaling "
                    "group replaces it; training resumes from the latest checkpoint."
                ),
                metric=self._asg_metric(
                    "AWS/EC2", "StatusCheckFailed", "Maximum", "Status check failed", ONE_MINUTE
                ),
                threshold=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                evaluation_periods=2,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ),
            cloudwatch.Alarm(
                self,
                "BootstrapFailedAlarm",
                alarm_description=(
                    "bootstrap.sh failed on a node (BootstrapFailures): the node ended its launch "
                    "lifecycle hook with ABANDON and the group replaces it. Repeated failures "
                    "mean every new node fails: read /var/log/trainium-cluster/bootstrap.log."
                ),
                metric=cloudwatch.Metric(
                    namespace=config.metrics_namespace,
                    metric_name="BootstrapFailures",
                    dimensions_map={"ClusterName": config.cluster_name},
                    statistic="Sum",
                    label="Bootstrap failures",
                    period=FIVE_MINUTES,
                ),
                threshold=1,
                comparison_operator=cloudwatch.ComparisonOperator.GREATER_THAN_OR_EQUAL_TO_THRESHOLD,
                evaluation_periods=1,
                treat_missing_data=cloudwatch.TreatMissingData.NOT_BREACHING,
            ),
            cloudwatch.Alarm(
                self,
                "FsxStorageLowAlarm",
                alarm_description="Less than 10% of the FSx for Lustre file system is free.",
                metric=self._fsx_metric(
                    file_system, "FreeDataStorageCapacity", "Minimum", "Free bytes"
                ),
                threshold=config.fsx_storage_gib * 2**30 * 0.10,
                comparison_operator=cloudwatch.ComparisonOperator.LESS_THAN_THRESHOLD,
                evaluation_periods=3,
                treat_missing_data=cloudwatch.TreatMissingData.MISSING,
            ),
        ]
        for alarm in alarms:
            alarm.add_alarm_action(action)
            alarm.add_ok_action(action)

    def _outputs(self, storage: StorageStack) -> None:
        config = self.config
        values = {
            "ClusterName": config.cluster_name,
            "ClusterTagKey": CLUSTER_TAG_KEY,
            "NodeCount": str(config.node_count),
            "SpareNodes": str(config.spare_nodes),
            "InstanceType": config.instance_type,
            "AutoScalingGroupName": config.auto_scaling_group_name,
            **{f"{name}DocumentName": doc.ref for name, doc in self.documents.items()},
            "TrainingLogGroupName": self.training_log_group.log_group_name,
            "DataBucketName": storage.data_bucket.bucket_name,
            "CheckpointBucketName": storage.checkpoint_bucket.bucket_name,
            "CompileCacheBucketName": storage.compile_cache_bucket.bucket_name,
            "FsxMountName": storage.file_system.attr_lustre_mount_name,
            "FsxDnsName": storage.file_system.attr_dns_name,
            # For the export before destroy: a data repository task on these paths.
            "FileSystemId": storage.file_system.ref,
            "ExportPaths": ",".join(storage.export_paths),
            "LifecycleHookName": config.lifecycle_hook_name,
            "AlarmTopicArn": self.alarm_topic.topic_arn,
            "JobStateMachineArn": self.supervisor.state_machine.state_machine_arn,
            "JobQueueTableName": self.queue_table.table_name,
            "JobDispatcherArn": self.dispatcher.state_machine.state_machine_arn,
            "DashboardName": self.dashboard.dashboard_name,
            # The settings this deploy was made with (stacks/settings_file.py): what
            # `trainium-cluster deploy` compares the cluster's settings file with.
            "Settings": settings_record(config),
            # What `jobs` and `status` price a node-hour at, and when they call nodes idle.
            "NodeUsdPerHour": "unknown" if config.node_price is None else f"{config.node_price}",
            "IdleWarningMinutes": str(config.idle_warning_minutes),
        }
        for key, value in values.items():
            cdk.CfnOutput(self, key, value=value)
        # Several outputs repeat the storage stack's exports (imports, cfn-lint W6001) on
        # purpose: the operator CLI reads one stack's outputs only.
        self.template_options.metadata = {
            "cfn-lint": {"config": {"ignore_checks": ["W6001"]}},
            "Reasons": {
                "cfn-lint W6001": "Outputs such as FileSystemId and DataBucketName repeat the "
                "storage stack's values on purpose: scripts/cluster.py reads the outputs of "
                "this one stack, and the strong reference keeps them current."
            },
        }


def ssm_document(scope: Construct, name: str, content: dict[str, Any]) -> ssm.CfnDocument:
    """One SSM Command document; CloudFormation names it, operators read the name from outputs."""
    document = ssm.CfnDocument(
        scope,
        f"{name}Document",
        content=content,
        document_type="Command",
        # Keep the name across updates: a changed document becomes its new default version.
        update_method="NewVersion",
    )
    document.override_logical_id(f"{name}Document")
    return document
