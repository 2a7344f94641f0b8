"""The cdk-nag gate: it fails a synth on an unacknowledged finding, and every acknowledgment in
the cluster names one finding and says why."""

from __future__ import annotations

import re
import tempfile
from typing import Any

import aws_cdk as cdk
import pytest
from aws_cdk import aws_sns as sns

from stacks.nag import CDK_HANDLER_RULES, add_security_checks
from tests.cdk_support import STACK_PARTS, Synth, alternative, synth

PACK_RULE = re.compile(r"^(AwsSolutions|NIST\.800\.53\.R5)-[A-Za-z0-9]+(\[.+\])?$")


def test_an_unacknowledged_finding_fails_the_synth() -> None:
    app = cdk.App(outdir=tempfile.mkdtemp(prefix="nag-gate-"))
    stack = cdk.Stack(app, "Probe")
    sns.Topic(stack, "PlainTopic")  # unencrypted, accepts plain HTTP publishers
    add_security_checks(app)
    with pytest.raises(RuntimeError, match="ValidationFailed") as raised:
        app.synth()
    assert "AwsSolutions-SNS3" in str(raised.value)
    assert "NIST.800.53.R5-SNSEncryptedKMS" in str(raised.value)


@pytest.mark.parametrize("which", ["default", "alternative"])
def test_every_acknowledgment_names_a_finding_and_a_reason(which: str) -> None:
    synthesized: Synth = synth() if which == "default" else alternative()
    seen = set()
    for part in STACK_PARTS:
        for logical_id, resource in synthesized.templates[part]["Resources"].items():
            rules = resource.get("Metadata", {}).get("cdk_nag", {}).get("rules_to_suppress", [])
            for rule in rules:
                if rule["id"].startswith("CloudFormation-Validate::"):
                    continue  # acknowledged by aws-cdk-lib itself for its own constructs
                assert PACK_RULE.match(rule["id"]), (logical_id, rule["id"])
                # A specific reason, not a placeholder.
                assert len(rule["reason"]) >= 60, (logical_id, rule)
                seen.add(rule["id"])
    # Wildcard findings are acknowledged one resource at a time, never as a whole rule.
    assert "AwsSolutions-IAM5" not in seen
    assert any(rule.startswith("AwsSolutions-IAM5[Resource::") for rule in seen)


def _suppressions(resource: dict[str, Any]) -> dict[str, str]:
    rules = resource.get("Metadata", {}).get("cdk_nag", {}).get("rules_to_suppress", [])
    return {rule["id"]: rule["reason"] for rule in rules}


@pytest.mark.parametrize("which", ["default", "alternative"])
def test_cdk_handlers_carry_their_reasons_in_the_template(which: str) -> None:
    """aws-cdk-lib's own custom-resource handlers (a Lambda function and its role) are no
    resources of ours, but a scanner reading the template sees them: the reasons are there,
    for cdk-nag's rules and for cfn-lint's warning alike."""
    synthesized: Synth = synth() if which == "default" else alternative()
    handlers = 0
    for part in STACK_PARTS:
        template = synthesized.templates[part]
        for logical_id, resource in template["Resources"].items():
            if not re.match(r"^Custom.*CustomResourceProvider(Handler|Role)", logical_id):
                continue
            reasons = _suppressions(resource)
            for rule in (*CDK_HANDLER_RULES, "CloudFormation-Validate::W3005"):
                assert len(reasons.get(rule, "")) >= 60, (logical_id, rule)
            if resource["Type"] == "AWS::Lambda::Function":
                handlers += 1
                ignored = resource["Metadata"]["cfn-lint"]["config"]["ignore_checks"]
                assert ignored == ["W3005"]
    assert handlers >= 2  # removing the default security group's rules, emptying buckets


def test_deliberate_bucket_exceptions_are_explained_in_the_template() -> None:
    template = synth().templates["storage"]
    buckets = {i: r for i, r in template["Resources"].items() if r["Type"] == "AWS::S3::Bucket"}
    (access_log,) = [r for i, r in buckets.items() if "AccessLogBucket" in i]
    (cache,) = [r for i, r in buckets.items() if "CompileCacheBucket" in i]
    assert "VersioningConfiguration" not in access_log["Properties"]
    assert "LoggingConfiguration" not in access_log["Properties"]
    for rule in ("AwsSolutions-S1", "NIST.800.53.R5-S3BucketVersioningEnabled"):
        assert rule in _suppressions(access_log)
    assert "VersioningConfiguration" not in cache["Properties"]
    assert "NIST.800.53.R5-S3BucketVersioningEnabled" in _suppressions(cache)


def test_operations_outputs_repeat_imports_on_purpose() -> None:
    metadata = synth().templates["operations"]["Metadata"]
    assert metadata["cfn-lint"] == {"config": {"ignore_checks": ["W6001"]}}
    assert len(metadata["Reasons"]["cfn-lint W6001"]) >= 60
