"""A Standard state machine of the operations stack with what each of them has: its own role
(Step Functions' service principal), an encrypted execution log group with every event and the
execution data, and X-Ray tracing. The job queue's dispatcher and the Capacity Block's drain use
it (the role first, so that the definition can add the grants its tasks need); the supervisor
(stacks/supervisor.py) sets up its own, with its own limits."""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_stepfunctions as sfn
from constructs import Construct

from stacks.config import ClusterConfig
from stacks.log_groups import execution_log_group


def role_and_log_group(
    scope: Construct, name: str, *, description: str, config: ClusterConfig, key: kms.IKey
) -> tuple[iam.Role, logs.LogGroup]:
    """The execution log group of the state machine `name` and its role (construct "Role")."""
    log_group = execution_log_group(scope, name, config=config, key=key)
    role = iam.Role(
        scope,
        "Role",
        assumed_by=iam.ServicePrincipal("states.amazonaws.com"),
        description=description,
    )
    return role, log_group


def logged_state_machine(
    scope: Construct,
    name: str,
    definition: sfn.IChainable,
    *,
    role: iam.Role,
    log_group: logs.LogGroup,
    comment: str,
    timeout: cdk.Duration | None = None,
) -> sfn.StateMachine:
    """The Standard state machine `name` (construct "StateMachine"): every event logged with
    the execution data, traced. aws-cdk-lib makes it depend on its role and the role's policy,
    and also reads the role's ARN: cfn-lint W3005 calls the first dependency redundant. It is
    harmless, and the policy dependency (which no GetAtt gives) must stay, so the check is
    turned off on this resource only."""
    machine = sfn.StateMachine(
        scope,
        "StateMachine",
        state_machine_name=name,
        state_machine_type=sfn.StateMachineType.STANDARD,
        definition_body=sfn.DefinitionBody.from_chainable(definition),
        role=role,
        logs=sfn.LogOptions(
            destination=log_group, level=sfn.LogLevel.ALL, include_execution_data=True
        ),
        tracing_enabled=True,
        timeout=timeout,
        comment=comment,
    )
    resource = machine.node.default_child
    assert isinstance(resource, cdk.CfnResource)
    resource.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3005"]}})
    return machine
