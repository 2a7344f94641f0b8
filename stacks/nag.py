"""The security gate: cdk-nag's AWS Solutions and NIST 800-53 rev 5 packs on every synth.

cdk-nag 3 runs as a CDK policy-validation plugin: synth fails on any finding that is not
acknowledged. Acknowledgments live next to the resource they cover (in the stack files), each
naming the finding and why it does not apply; the helper here only shortens that call, and writes
the same reason where checkov, the scanner users most often run on templates, reads it (its own
skip metadata on the resource), for the findings both tools make (CHECKOV_EQUIVALENTS).
"""

from __future__ import annotations

from collections.abc import Iterable

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks, NIST80053R5Checks
from constructs import IConstruct


def add_security_checks(app: cdk.App) -> None:
    """Attach both rule packs to the app; they run when the app synthesizes."""
    # The acknowledgments are also written into each resource's template metadata (cdk_nag), so
    # a reviewer of the template sees the reasons.
    cdk.Validations.of(app).add_plugins(
        AwsSolutionsChecks(app, write_suppressions_to_cloud_formation=True),
        NIST80053R5Checks(app, write_suppressions_to_cloud_formation=True),
    )


#: What aws-cdk-lib's own custom-resource handlers (emptying a bucket on delete, removing the
#: default security group's rules) would be flagged for if cdk-nag inspected them: it does not,
#: because aws-cdk-lib writes them as plain CfnResources, but any scanner reading the template
#: sees a Lambda function and a role. The reasons go into the template either way.
CDK_HANDLER_RULES = (
    "AwsSolutions-IAM4[Policy::arn:<AWS::Partition>:iam::aws:policy/service-role/"
    "AWSLambdaBasicExecutionRole]",
    "AwsSolutions-L1",
    "NIST.800.53.R5-IAMNoInlinePolicy",
    "NIST.800.53.R5-LambdaConcurrency",
    "NIST.800.53.R5-LambdaDLQ",
    "NIST.800.53.R5-LambdaInsideVPC",
)
CDK_HANDLER_REASON = (
    "A handler that aws-cdk-lib ships for its own custom resource and runs only while "
    "CloudFormation deploys or deletes the stack: its runtime, its role (the AWS managed "
    "AWSLambdaBasicExecutionRole for its logs, plus the few actions on this stack's resources "
    "it needs), no reserved concurrency, no dead-letter queue and no VPC are chosen by "
    "aws-cdk-lib."
)
#: cfn-lint's W3005: the handler has both a DependsOn and a GetAtt on its role.
CDK_HANDLER_LINT = {
    "W3005": "aws-cdk-lib writes both a DependsOn and a GetAtt on the handler's role; the "
    "duplicate dependency is harmless and not ours to edit."
}


def explain_cdk_handlers(scope: IConstruct) -> None:
    """Put the reasons for aws-cdk-lib's custom-resource handlers into their template metadata:
    cdk_nag.rules_to_suppress (rule and reason) and cfn-lint's ignore_checks."""
    for construct in scope.node.find_all():
        if not isinstance(construct, cdk.CustomResourceProviderBase):
            continue
        acknowledge(construct, CDK_HANDLER_RULES, CDK_HANDLER_REASON)
        for check, reason in CDK_HANDLER_LINT.items():
            acknowledge(construct, f"CloudFormation-Validate::{check}", reason)
        handler = construct.node.try_find_child("Handler")
        assert isinstance(handler, cdk.CfnResource), construct.node.path
        handler.add_metadata("cfn-lint", {"config": {"ignore_checks": list(CDK_HANDLER_LINT)}})


#: cdk-nag findings and the checkov check that makes the same finding, on the resource type it
#: inspects (checkov 3.3's CloudFormation checks: CKV_AWS_18 "S3 bucket has access logging",
#: CKV_AWS_21 "S3 bucket has versioning", CKV_AWS_115 "Lambda function has a concurrency limit",
#: CKV_AWS_116 "Lambda function has a dead-letter queue", CKV_AWS_117 "Lambda function is in a
#: VPC"). tests/test_checkov.py runs checkov on the templates with and without these skips.
CHECKOV_EQUIVALENTS: dict[str, tuple[str, str]] = {
    "AwsSolutions-S1": ("CKV_AWS_18", "AWS::S3::Bucket"),
    "NIST.800.53.R5-S3BucketLoggingEnabled": ("CKV_AWS_18", "AWS::S3::Bucket"),
    "NIST.800.53.R5-S3BucketVersioningEnabled": ("CKV_AWS_21", "AWS::S3::Bucket"),
    "NIST.800.53.R5-LambdaConcurrency": ("CKV_AWS_115", "AWS::Lambda::Function"),
    "NIST.800.53.R5-LambdaDLQ": ("CKV_AWS_116", "AWS::Lambda::Function"),
    "NIST.800.53.R5-LambdaInsideVPC": ("CKV_AWS_117", "AWS::Lambda::Function"),
}


def acknowledge(construct: IConstruct | None, rule_ids: str | Iterable[str], reason: str) -> None:
    """Acknowledge findings on `construct` (and the resources under it) with one reason, for
    cdk-nag and, where checkov makes the same finding, in checkov's skip metadata."""
    assert construct is not None, "acknowledge() needs a construct"
    ids = [rule_ids] if isinstance(rule_ids, str) else list(rule_ids)
    cdk.Validations.of(construct).acknowledge(
        *(cdk.Acknowledgment(id=rule_id, reason=reason) for rule_id in ids)
    )
    for rule_id in ids:
        if rule_id in CHECKOV_EQUIVALENTS:
            check, resource_type = CHECKOV_EQUIVALENTS[rule_id]
            for resource in construct.node.find_all():
                if (
                    isinstance(resource, cdk.CfnResource)
                    and resource.cfn_resource_type == resource_type
                ):
                    _skip_checkov(resource, check, reason)


def _skip_checkov(resource: cdk.CfnResource, check: str, reason: str) -> None:
    """Add `check` to the resource's checkov skips (Metadata.checkov.skip: id and comment)."""
    metadata = resource.get_metadata("checkov") or {"skip": []}
    if all(skip["id"] != check for skip in metadata["skip"]):
        metadata["skip"].append({"id": check, "comment": reason})
    resource.add_metadata("checkov", metadata)
