"""The cdk-nag gate: it fails a synth on an unacknowledged finding, and every acknowledgment in
the cluster names one finding and says why."""

from __future__ import annotations

import re
import tempfile

import aws_cdk as cdk
import pytest
from aws_cdk import aws_sns as sns

from stacks.nag import add_security_checks
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
