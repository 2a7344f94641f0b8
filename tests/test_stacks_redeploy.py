"""A cluster can be destroyed and deployed again under the same name.

What `cdk destroy` keeps (DeletionPolicy Retain or RetainExceptOnCreate) stays in the account;
if such a resource's physical name is fixed by the template, the next create of the stack asks
for the same name and CloudFormation fails it (AlreadyExists) and rolls the stack back. The
name that collides is the resource's primary identifier as CloudFormation's resource provider
schema declares it (`primaryIdentifier`, read from cfn-lint's copy of the schemas): a
LogGroupName, a BucketName, a TableName set in the template.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from cfnlint.schema import PROVIDER_SCHEMA_MANAGER

from stacks.config import ClusterConfig, ConfigError
from tests.cdk_support import (
    ADOPTED_BUCKETS_SETTINGS,
    cfn_lint,
    matrix_settings,
    only_resource,
    resources,
    synth,
)

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


# Deploying again with the kept buckets: data_bucket_name and checkpoint_bucket_name.


def test_adopted_buckets_are_linked_granted_and_named_in_the_outputs() -> None:
    """The storage stack imports the kept buckets instead of creating new ones, and everything
    that used the created ones uses them: the data repository associations (/fsx/data,
    /fsx/jobs: FSx API Reference, DataRepositoryPath s3://bucket-name/), the nodes' policy, the
    nodes' cluster.env, the outputs the CLI reads; the synth passes cdk-nag (it raises
    otherwise) and cfn-lint finds nothing."""
    data = ADOPTED_BUCKETS_SETTINGS["data_bucket_name"]
    checkpoints = ADOPTED_BUCKETS_SETTINGS["checkpoint_bucket_name"]
    synthesized = synth(**ADOPTED_BUCKETS_SETTINGS)
    storage = synthesized.templates["storage"]
    created = resources(storage, "AWS::S3::Bucket")
    assert sorted(created) == [
        "BucketsAccessLogBucket0E24AD7A",
        "BucketsCompileCacheBucket997F2BDC",
    ]
    paths = {
        r["Properties"]["FileSystemPath"]: r["Properties"]["DataRepositoryPath"]
        for r in resources(storage, "AWS::FSx::DataRepositoryAssociation").values()
    }
    assert paths["/data"] == f"s3://{data}"
    assert paths["/jobs"] == f"s3://{checkpoints}"
    policy = only_resource(storage, "AWS::IAM::ManagedPolicy")["Properties"]["PolicyDocument"]
    by_sid = {s["Sid"]: s["Resource"] for s in policy["Statement"]}
    assert by_sid["ReadTrainingData"] == f"arn:aws:s3:::{data}/*"
    assert by_sid["ReadWriteCheckpoints"] == f"arn:aws:s3:::{checkpoints}/*"
    # The TLS-only policy that went with the old stack is written again (AwsSolutions-S10).
    tls_only = {
        r["Properties"]["Bucket"]: r["Properties"]["PolicyDocument"]["Statement"]
        for r in resources(storage, "AWS::S3::BucketPolicy").values()
        if isinstance(r["Properties"]["Bucket"], str)
    }
    for name in (data, checkpoints):
        (statement,) = tls_only[name]
        assert statement["Effect"] == "Deny"
        assert statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
    outputs = synthesized.templates["operations"]["Outputs"]
    assert outputs["DataBucketName"]["Value"] == data
    assert outputs["CheckpointBucketName"]["Value"] == checkpoints
    user_data = json.dumps(synthesized.templates["compute"])  # cluster.env, newlines escaped
    assert f"DATA_BUCKET={data}\\nCHECKPOINT_BUCKET={checkpoints}\\n" in user_data
    region = synthesized.config.region
    assert cfn_lint(synthesized.template_paths(), region=region) == []


def test_a_cluster_without_adoption_creates_its_buckets() -> None:
    created = resources(synth().templates["storage"], "AWS::S3::Bucket")
    assert len(created) == 4
    assert [r["DeletionPolicy"] for k, r in created.items() if "Data" in k] == ["Retain"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"data_bucket_name": "My_Bucket"},
            "data_bucket_name='My_Bucket' is not 3-63 lowercase letters",
        ),
        (
            {"checkpoint_bucket_name": "192.168.10.20"},
            "checkpoint_bucket_name='192.168.10.20' is formatted as an IP address",
        ),
        ({"data_bucket_name": "data..bucket"}, "two adjacent periods"),
        ({"data_bucket_name": "kept-s3alias"}, "-s3alias is a reserved suffix"),
        (
            {"data_bucket_name": "kept-bucket", "checkpoint_bucket_name": "kept-bucket"},
            "data_bucket_name and checkpoint_bucket_name are both kept-bucket",
        ),
    ],
)
def test_a_bucket_name_s3_refuses_is_refused_in_one_line(
    settings: dict[str, str], message: str
) -> None:
    """S3 user guide, "General purpose bucket naming rules"."""
    with pytest.raises(ConfigError) as raised:
        ClusterConfig.from_context(settings.get, settings)
    text = str(raised.value)
    assert message in text and "\n" not in text
    assert "allowed:" in text or "both" in text
