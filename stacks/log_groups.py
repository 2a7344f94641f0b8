"""Encrypted CloudWatch log groups: the key policy CloudWatch Logs needs, and retention."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from constructs import Construct

from stacks.config import ClusterConfig


def allow_cloudwatch_logs(key: kms.Key) -> None:
    """Let CloudWatch Logs use `key` for the log groups of this account and region."""
    stack = cdk.Stack.of(key)
    key.add_to_resource_policy(
        iam.PolicyStatement(
            sid="AllowCloudWatchLogs",
            principals=[iam.ServicePrincipal(f"logs.{stack.region}.amazonaws.com")],
            actions=[
                "kms:Encrypt*",
                "kms:Decrypt*",
                "kms:ReEncrypt*",
                "kms:GenerateDataKey*",
                "kms:Describe*",
            ],
            resources=["*"],  # in a key policy, "*" means this key
            conditions={
                "ArnLike": {
                    "kms:EncryptionContext:aws:logs:arn": stack.format_arn(
                        service="logs",
                        resource="log-group",
                        resource_name="*",
                        arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
                    )
                }
            },
        )
    )


_RETENTION = {
    1: logs.RetentionDays.ONE_DAY,
    3: logs.RetentionDays.THREE_DAYS,
    5: logs.RetentionDays.FIVE_DAYS,
    7: logs.RetentionDays.ONE_WEEK,
    14: logs.RetentionDays.TWO_WEEKS,
    30: logs.RetentionDays.ONE_MONTH,
    60: logs.RetentionDays.TWO_MONTHS,
    90: logs.RetentionDays.THREE_MONTHS,
    120: logs.RetentionDays.FOUR_MONTHS,
    150: logs.RetentionDays.FIVE_MONTHS,
    180: logs.RetentionDays.SIX_MONTHS,
    365: logs.RetentionDays.ONE_YEAR,
    400: logs.RetentionDays.THIRTEEN_MONTHS,
    545: logs.RetentionDays.EIGHTEEN_MONTHS,
    731: logs.RetentionDays.TWO_YEARS,
    1096: logs.RetentionDays.THREE_YEARS,
    1827: logs.RetentionDays.FIVE_YEARS,
    2192: logs.RetentionDays.SIX_YEARS,
    2557: logs.RetentionDays.SEVEN_YEARS,
    2922: logs.RetentionDays.EIGHT_YEARS,
    3288: logs.RetentionDays.NINE_YEARS,
    3653: logs.RetentionDays.TEN_YEARS,
}


def retention(days: int) -> logs.RetentionDays:
    """The RetentionDays member for a number of days (ClusterConfig allows only these)."""
    return _RETENTION[days]


def execution_log_group(
    scope: Construct, state_machine_name: str, *, config: ClusterConfig, key: kms.IKey
) -> logs.LogGroup:
    """A state machine's execution log group (construct ID ExecutionLogGroup).

    Its name keeps the `/aws/vendedlogs/states/` prefix: Step Functions adds each log group it
    logs to into the account's CloudWatch Logs resource policy, which is limited to 5,120
    characters, unless the name starts with /aws/vendedlogs/ (Step Functions developer guide,
    "Avoiding Amazon CloudWatch Logs resource policy size restrictions", bp-cwl.html). The
    group is kept on destroy with retain_data (the executions' record outlives the cluster), so
    its name must differ between deploys of the same cluster: a kept group with a fixed name
    makes the next create of the stack fail (AlreadyExists; LogGroupName is the primary
    identifier of AWS::Logs::LogGroup). The suffix is the UUID of the stack's ID, new at every
    create of the stack and the same across its updates."""
    stack_uuid = cdk.Fn.select(2, cdk.Fn.split("/", cdk.Aws.STACK_ID))
    return logs.LogGroup(
        scope,
        "ExecutionLogGroup",
        log_group_name=f"/aws/vendedlogs/states/{state_machine_name}-{stack_uuid}",
        retention=retention(config.log_retention_days),
        encryption_key=key,
        removal_policy=cdk.RemovalPolicy.RETAIN
        if config.retain_data
        else cdk.RemovalPolicy.DESTROY,
    )
