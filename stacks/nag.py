"""The security gate: cdk-nag's AWS Solutions and NIST 800-53 rev 5 packs on every synth.

cdk-nag 3 runs as a CDK policy-validation plugin: synth fails on any finding that is not
acknowledged. Acknowledgments live next to the resource they cover (in the stack files), each
naming the finding and why it does not apply; the helper here only shortens that call.
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


def acknowledge(construct: IConstruct | None, rule_ids: str | Iterable[str], reason: str) -> None:
    """Acknowledge findings on `construct` (and the resources under it) with one reason."""
    assert construct is not None, "acknowledge() needs a construct"
    ids = [rule_ids] if isinstance(rule_ids, str) else list(rule_ids)
    cdk.Validations.of(construct).acknowledge(
        *(cdk.Acknowledgment(id=rule_id, reason=reason) for rule_id in ids)
    )
