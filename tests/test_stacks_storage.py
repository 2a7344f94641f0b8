"""Storage stack: encrypted, TLS-only buckets; FSx for Lustre linked to S3; data kept on destroy."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.cdk_support import Synth, alternative, flatten, only_resource, resources, synth

KEPT_BUCKETS = ("DataBucket", "CheckpointBucket", "AccessLogBucket")


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def _bucket_id(template: dict[str, Any], name: str) -> str:
    (logical_id,) = [i for i in resources(template, "AWS::S3::Bucket") if name in i]
    return logical_id


def _arn(logical_id: str) -> str:
    return json.dumps({"Fn::GetAtt": [logical_id, "Arn"]}, sort_keys=True)


def test_four_buckets_all_encrypted_and_private(default: Synth) -> None:
    buckets = resources(default.templates["storage"], "AWS::S3::Bucket")
    assert len(buckets) == 4
    for logical_id, bucket in buckets.items():
        props = bucket["Properties"]
        rule = props["BucketEncryption"]["ServerSideEncryptionConfiguration"][0]
        algorithm = rule["ServerSideEncryptionByDefault"]["SSEAlgorithm"]
        # Server access logs can only be delivered to an SSE-S3 bucket; the rest use KMS.
        expected = "AES256" if "AccessLog" in logical_id else "aws:kms"
        assert algorithm == expected, logical_id
        assert props["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True,
            "BlockPublicPolicy": True,
            "IgnorePublicAcls": True,
            "RestrictPublicBuckets": True,
        }


def test_every_bucket_policy_refuses_requests_without_tls(default: Synth) -> None:
    template = default.templates["storage"]
    policies = resources(template, "AWS::S3::BucketPolicy").values()
    protected = set()
    for policy in policies:
        for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
            if (
                statement["Effect"] == "Deny"
                and statement["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
                and statement["Principal"] == {"AWS": "*"}
            ):
                protected.add(policy["Properties"]["Bucket"]["Ref"])
    assert protected == set(resources(template, "AWS::S3::Bucket"))


def test_data_and_checkpoints_are_versioned_and_logged(default: Synth) -> None:
    template = default.templates["storage"]
    for name in ("DataBucket", "CheckpointBucket"):
        props = template["Resources"][_bucket_id(template, name)]["Properties"]
        assert props["VersioningConfiguration"] == {"Status": "Enabled"}
        assert props["LoggingConfiguration"]["DestinationBucketName"] == {
            "Ref": _bucket_id(template, "AccessLogBucket")
        }
        rules = {r["Id"]: r for r in props["LifecycleConfiguration"]["Rules"]}
        assert "NoncurrentVersionExpiration" in rules["ExpireOldVersions"]
        assert "AbortIncompleteMultipartUpload" in rules["AbortIncompleteUploads"]


def test_compile_cache_expires_old_entries(default: Synth) -> None:
    template = default.templates["storage"]
    props = template["Resources"][_bucket_id(template, "CompileCacheBucket")]["Properties"]
    rules = {r["Id"]: r for r in props["LifecycleConfiguration"]["Rules"]}
    assert rules["ExpireOldCacheEntries"]["Prefix"] == "neuron-compile-cache/"
    assert rules["ExpireOldCacheEntries"]["ExpirationInDays"] == 90


def test_data_survives_destroy_by_default(default: Synth) -> None:
    template = default.templates["storage"]
    for name in KEPT_BUCKETS:
        assert template["Resources"][_bucket_id(template, name)]["DeletionPolicy"] == "Retain"
    cache = template["Resources"][_bucket_id(template, "CompileCacheBucket")]
    assert cache["DeletionPolicy"] == "Delete"


def test_retain_data_false_deletes_the_buckets_on_destroy() -> None:
    template = alternative().templates["storage"]
    for name in ("DataBucket", "CheckpointBucket", "CompileCacheBucket"):
        assert template["Resources"][_bucket_id(template, name)]["DeletionPolicy"] == "Delete"
    emptied = {
        r["Properties"]["BucketName"]["Ref"]
        for r in resources(template, "Custom::S3AutoDeleteObjects").values()
    }
    deleted = {
        i
        for i, r in resources(template, "AWS::S3::Bucket").items()
        if r["DeletionPolicy"] == "Delete"
    }
    assert emptied == deleted


@pytest.mark.parametrize("which", ["default", "alternative"])
def test_destroy_never_deletes_a_bucket_that_server_access_logs_may_still_reach(
    which: str,
) -> None:
    """S3 delivers server access logs best effort, most "within a few hours" (S3 user guide,
    server access logging): the records of a logged bucket's last requests, the auto-delete
    handler's deletes among them, can reach the log bucket after its own auto-delete emptied
    it, and CloudFormation's delete then fails with BucketNotEmpty (aws/aws-cdk issues #16332,
    #21776). So every bucket that is a log destination outlives the stack, kept and never
    emptied by a custom resource, its lifecycle rule expiring the logs."""
    template = (synth() if which == "default" else alternative()).templates["storage"]
    buckets = resources(template, "AWS::S3::Bucket")
    destinations = {
        b["Properties"]["LoggingConfiguration"]["DestinationBucketName"]["Ref"]
        for b in buckets.values()
        if "LoggingConfiguration" in b["Properties"]
    }
    assert destinations == {_bucket_id(template, "AccessLogBucket")}
    emptied = {
        r["Properties"]["BucketName"]["Ref"]
        for r in resources(template, "Custom::S3AutoDeleteObjects").values()
    }
    policies = {
        r["Properties"]["Bucket"]["Ref"]: r
        for r in resources(template, "AWS::S3::BucketPolicy").values()
    }
    for logical_id in destinations:
        assert buckets[logical_id]["DeletionPolicy"] == "Retain"
        # Its policy stays with it: TLS only, and the logging service's permission to deliver.
        assert policies[logical_id]["DeletionPolicy"] == "Retain"
        statements = policies[logical_id]["Properties"]["PolicyDocument"]["Statement"]
        assert {"Service": "logging.s3.amazonaws.com"} in [s["Principal"] for s in statements]
        assert buckets[logical_id]["UpdateReplacePolicy"] == "Retain"
        assert logical_id not in emptied
        rules = buckets[logical_id]["Properties"]["LifecycleConfiguration"]["Rules"]
        assert [r["ExpirationInDays"] for r in rules if r["Status"] == "Enabled"] == [365]


def test_each_emptied_bucket_is_emptied_before_its_policy_goes() -> None:
    """CloudFormation deletes in reverse dependency order: each auto-delete custom resource
    depends on its bucket's policy, so the handler still may empty the bucket when it runs,
    and the bucket waits for it (it is the handler's Ref)."""
    template = alternative().templates["storage"]
    policies = {
        r["Properties"]["Bucket"]["Ref"]: i
        for i, r in resources(template, "AWS::S3::BucketPolicy").items()
    }
    custom = resources(template, "Custom::S3AutoDeleteObjects")
    assert len(custom) == 3
    for resource in custom.values():
        bucket = resource["Properties"]["BucketName"]["Ref"]
        assert policies[bucket] in resource["DependsOn"]


def test_lustre_is_persistent_2_lz4_encrypted_in_the_cluster_subnet(default: Synth) -> None:
    file_system = only_resource(default.templates["storage"], "AWS::FSx::FileSystem")
    props = file_system["Properties"]
    assert props["FileSystemType"] == "LUSTRE"
    assert props["StorageCapacity"] == 1200
    assert "LustreKey" in props["KmsKeyId"]["Ref"]  # the stack's own rotating key
    lustre = props["LustreConfiguration"]
    assert lustre["DeploymentType"] == "PERSISTENT_2"
    assert lustre["DataCompressionType"] == "LZ4"
    assert lustre["PerUnitStorageThroughput"] == 250
    assert len(props["SubnetIds"]) == 1
    assert "ClusterSubnet" in flatten(props["SubnetIds"][0])


def test_data_repository_associations_link_data_jobs_and_the_compile_cache(
    default: Synth,
) -> None:
    template = default.templates["storage"]
    links = {
        r["Properties"]["FileSystemPath"]: r["Properties"]
        for r in resources(template, "AWS::FSx::DataRepositoryAssociation").values()
    }
    assert set(links) == {"/data", "/jobs", "/neuron-compile-cache"}
    assert flatten(links["/data"]["DataRepositoryPath"]) == (
        's3://{"Ref": "' + _bucket_id(template, "DataBucket") + '"}'
    )
    assert flatten(links["/jobs"]["DataRepositoryPath"]) == (
        's3://{"Ref": "' + _bucket_id(template, "CheckpointBucket") + '"}'
    )
    # Checkpoints reach S3 as they are written, deletions included (versioning keeps them).
    assert links["/jobs"]["S3"]["AutoExportPolicy"]["Events"] == ["NEW", "CHANGED", "DELETED"]
    assert "DELETED" not in links["/data"]["S3"]["AutoExportPolicy"]["Events"]
    # The compile cache: the bucket's cache prefix (the one its lifecycle rule expires), a
    # bucket-or-prefix path as the FSx API takes it ("s3://bucket-name/prefix/").
    cache = links["/neuron-compile-cache"]
    assert flatten(cache["DataRepositoryPath"]) == (
        's3://{"Ref": "' + _bucket_id(template, "CompileCacheBucket") + '"}/neuron-compile-cache/'
    )
    # New entries go to S3, a removed (failed) entry or a stale lock leaves it too; S3's
    # entries come in as metadata at creation and on change, their contents on first read.
    assert cache["S3"]["AutoExportPolicy"]["Events"] == ["NEW", "CHANGED", "DELETED"]
    assert cache["S3"]["AutoImportPolicy"]["Events"] == ["NEW", "CHANGED", "DELETED"]
    assert cache["BatchImportMetaDataOnCreate"] is True


def test_node_access_policy_names_each_bucket_the_nodes_use(default: Synth) -> None:
    template = default.templates["storage"]
    policy = only_resource(template, "AWS::IAM::ManagedPolicy")
    statements = {s["Sid"]: s for s in policy["Properties"]["PolicyDocument"]["Statement"]}
    data, checkpoints, cache = (
        _bucket_id(template, n) for n in ("DataBucket", "CheckpointBucket", "CompileCacheBucket")
    )
    assert flatten(statements["ReadTrainingData"]["Resource"]) == (_arn(data) + "/*")
    assert statements["ReadTrainingData"]["Action"] == "s3:GetObject"
    assert flatten(statements["ReadWriteCheckpoints"]["Resource"]) == (_arn(checkpoints) + "/*")
    for statement in statements.values():
        assert statement["Resource"] != "*"
    # The nodes reach the compile cache through /fsx only: no statement names its bucket.
    assert set(statements) == {"ListClusterBuckets", "ReadTrainingData", "ReadWriteCheckpoints"}
    assert cache not in json.dumps(policy)


def _creation_order(template: dict[str, Any], logical_ids: list[str]) -> list[list[str]]:
    """CloudFormation's creation waves for `logical_ids`: each wave holds the resources whose
    dependencies among `logical_ids` (DependsOn, Ref, GetAtt) are all in earlier waves; the
    resources of one wave are created at the same time."""
    deps = {}
    for logical_id in logical_ids:
        resource = template["Resources"][logical_id]
        text = json.dumps(resource)
        depends = resource.get("DependsOn", [])
        depends = [depends] if isinstance(depends, str) else depends
        deps[logical_id] = {
            other
            for other in logical_ids
            if other != logical_id and (other in depends or f'"{other}"' in text)
        }
    waves: list[list[str]] = []
    done: set[str] = set()
    while len(done) < len(logical_ids):
        wave = sorted(i for i in logical_ids if i not in done and deps[i] <= done)
        assert wave, f"dependency cycle among {logical_ids}"
        waves.append(wave)
        done.update(wave)
    return waves


@pytest.mark.parametrize("which", ["default", "alternative"])
def test_data_repository_associations_are_created_one_after_the_other(which: str) -> None:
    template = (synth() if which == "default" else alternative()).templates["storage"]
    associations = list(resources(template, "AWS::FSx::DataRepositoryAssociation"))
    waves = _creation_order(template, associations)
    assert [len(wave) for wave in waves] == [1] * len(associations), waves
    paths = [template["Resources"][w[0]]["Properties"]["FileSystemPath"] for w in waves]
    assert paths == ["/data", "/jobs", "/neuron-compile-cache"]


def test_metadata_iops_are_provisioned_for_the_opens_of_a_large_cluster(default: Synth) -> None:
    """Every rank opens the token cache at start: from 282 nodes the automatic 1,500 Metadata
    IOPS of 1,200 GiB do not serve them within the start budget (stacks/start_limits.py), so
    the file system gets the value that does, provisioned; a small cluster gets Automatic mode.
    Either way it has a metadata configuration, without which it could never get one
    (tests/test_stacks_storage_growth.py checks every size and the growth path)."""

    def metadata(synthesized: Synth) -> Any:
        fs = only_resource(synthesized.templates["storage"], "AWS::FSx::FileSystem")
        return fs["Properties"]["LustreConfiguration"].get("MetadataConfiguration")

    assert metadata(default) == {"Mode": "AUTOMATIC"}
    assert metadata(synth(node_count="1024")) == {"Mode": "USER_PROVISIONED", "Iops": 6000}
