"""A cluster can be destroyed and deployed again under the same name.

What `cdk destroy` keeps (DeletionPolicy Retain or RetainExceptOnCreate) stays in the account;
if such a resource's physical name is fixed by the template, the next create of the stack asks
for the same name and CloudFormation fails it (AlreadyExists) and rolls the stack back. The
name that collides is the resource's primary identifier as CloudFormation's resource provider
schema declares it (`primaryIdentifier`, read from cfn-lint's copy of the schemas): a
LogGroupName, a BucketName, a TableName set in the template.
"""

from __future__ import annotations

from typing import Any

import pytest
from cfnlint.schema import PROVIDER_SCHEMA_MANAGER

from tests.cdk_support import matrix_settings, synth

KEPT = ("Retain", "RetainExceptOnCreate")


def _fixed(value: Any, resources: dict[str, Any]) -> bool:
    """Whether a template value is the same at every create of the stack: literal text and
    pseudo parameters such as AWS::Region, but not another resource's Ref or attribute, nor
    the stack's ID (new at every create)."""
    if isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list):
        return all(_fixed(item, resources) for item in value)
    if isinstance(value, dict):
        if "Fn::GetAtt" in value or "Fn::ImportValue" in value or "Fn::GetStackOutput" in value:
            return False
        if "Ref" in value:
            return value["Ref"] not in resources and value["Ref"] != "AWS::StackId"
        return all(_fixed(item, resources) for item in value.values())
    return True


def kept_fixed_names(template: dict[str, Any], region: str) -> list[str]:
    """'logical ID: property' for each kept resource whose primary identifier is a property
    the template sets to a value fixed across creates."""
    found = []
    resources = template["Resources"]
    for logical_id, resource in resources.items():
        if resource.get("DeletionPolicy") not in KEPT or "::" not in resource["Type"]:
            continue
        if resource["Type"].startswith("Custom::"):
            continue
        schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema(region, resource["Type"]).schema
        read_only = set(schema.get("readOnlyProperties", []))
        for pointer in schema.get("primaryIdentifier", []):
            if pointer in read_only:
                continue  # assigned by the service: never the template's
            name = pointer.removeprefix("/properties/")
            value = resource.get("Properties", {}).get(name)
            if value is not None and _fixed(value, resources):
                found.append(f"{logical_id}: {name}={value!r}")
    return found


def test_the_check_sees_a_kept_fixed_name() -> None:
    resources = {
        "Named": {
            "Type": "AWS::Logs::LogGroup",
            "DeletionPolicy": "Retain",
            "Properties": {"LogGroupName": "/aws/vendedlogs/states/trainium-jobs"},
        },
        "Generated": {"Type": "AWS::S3::Bucket", "DeletionPolicy": "Retain"},
        "PerCreate": {
            "Type": "AWS::Logs::LogGroup",
            "DeletionPolicy": "Retain",
            "Properties": {
                "LogGroupName": {
                    "Fn::Join": [
                        "",
                        [
                            "/aws/vendedlogs/states/trainium-jobs-",
                            {"Fn::Select": [2, {"Fn::Split": ["/", {"Ref": "AWS::StackId"}]}]},
                        ],
                    ]
                }
            },
        },
        "Deleted": {
            "Type": "AWS::DynamoDB::GlobalTable",
            "DeletionPolicy": "Delete",
            "Properties": {"TableName": "trainium-queue"},
        },
    }
    assert kept_fixed_names({"Resources": resources}, "us-east-1") == [
        "Named: LogGroupName='/aws/vendedlogs/states/trainium-jobs'"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(matrix_settings()))
def test_no_kept_resource_has_a_fixed_name(name: str) -> None:
    synthesized = synth(**matrix_settings()[name])
    found = {
        part: kept_fixed_names(template, synthesized.config.region)
        for part, template in synthesized.templates.items()
    }
    assert {part: names for part, names in found.items() if names} == {}
