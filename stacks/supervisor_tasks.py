"""The CDK plumbing the job supervisor's states are built with.

`SupervisorTasks` holds the construct the states are made in, the cluster's settings and the
resources they name (the SSM documents, the training log group, the topic, the state machine's
role and ARN), and makes the kinds of task the workflow uses: an AWS SDK call that retries
throttling and brief outages (`sdk`) and a message on the cluster's topic (`notify`); it also
writes the ARNs the role's statements name. stacks/supervisor.py makes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_ssm as ssm
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from stacks.config import ClusterConfig


@dataclass(frozen=True)
class SupervisorTasks:
    """What the supervisor's states are made in and with, and its two kinds of SDK task."""

    #: The construct every state is made in: a state's construct ID is its name in the definition.
    scope: Construct
    config: ClusterConfig
    documents: dict[str, ssm.CfnDocument]
    training_log_group: logs.ILogGroup
    topic: sns.ITopic
    role: iam.Role
    #: The state machine's own ARN, known before it exists (the role names it without a cycle).
    state_machine_arn: str

    @property
    def job_id(self) -> str:
        """The job ID, as a path into the state's input."""
        return sfn.JsonPath.string_at("$.Job.JobId")

    def document_name(self, name: str) -> str:
        """The deployed name of the SSM document `name` (RunTraining, Preflight, StopTraining)."""
        return self.documents[name].ref

    def document_arn(self, name: str) -> str:
        return cdk.Stack.of(self.scope).format_arn(
            service="ssm", resource="document", resource_name=self.document_name(name)
        )

    def instances_arn(self) -> str:
        return cdk.Stack.of(self.scope).format_arn(
            service="ec2", resource="instance", resource_name="*"
        )

    def group_arn(self) -> str:
        # arn:aws:autoscaling:region:account:autoScalingGroup:<uuid>:autoScalingGroupName/<name>
        # (Service Authorization Reference, Amazon EC2 Auto Scaling resource types).
        return cdk.Stack.of(self.scope).format_arn(
            service="autoscaling",
            resource="autoScalingGroup",
            resource_name=f"*:autoScalingGroupName/{self.config.auto_scaling_group_name}",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )

    def sdk(
        self,
        construct_id: str,
        service: str,
        action: str,
        parameters: dict[str, Any],
        resources: list[str],
        *,
        iam_action: str | None = None,
        result_selector: dict[str, Any] | None = None,
        result_path: str | None = None,
    ) -> tasks.CallAwsService:
        """An AWS SDK call; its result is discarded unless `result_path` says where it goes."""
        task = tasks.CallAwsService(
            self.scope,
            construct_id,
            service=service,
            action=action,
            parameters=parameters,
            iam_resources=resources,
            iam_action=iam_action,
            additional_iam_statements=[],
            result_selector=result_selector,
            result_path=result_path if result_path is not None else sfn.JsonPath.DISCARD,
        )
        # Throttling and brief outages must not end a job that runs for days.
        task.add_retry(
            errors=["States.TaskFailed", "States.Timeout"],
            interval=cdk.Duration.seconds(5),
            max_attempts=6,
            backoff_rate=2,
            max_delay=cdk.Duration.minutes(2),
        )
        return task

    def notify(
        self, construct_id: str, subject: str, message: str, *values: str
    ) -> tasks.CallAwsService:
        """Publishes to the cluster's topic; `message` is a States.Format template."""
        return self.sdk(
            construct_id,
            "sns",
            "publish",
            {
                "TopicArn": self.topic.topic_arn,
                "Subject": sfn.JsonPath.format(
                    f"{self.config.cluster_name}: job {{}} {subject}", self.job_id
                ),
                "Message": sfn.JsonPath.format(message, *values),
            },
            [self.topic.topic_arn],
            iam_action="sns:Publish",
        )
