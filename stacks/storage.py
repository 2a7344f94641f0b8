"""Storage stack: S3 buckets for data, checkpoints and the Neuron compile cache; FSx for Lustre.

The data and checkpoint buckets hold what a training run cannot recreate. They are retained
on `cdk destroy` unless `retain_data=false`; the access-log bucket that audits them always is
(access logs can arrive after it was emptied), and its lifecycle rule expires the logs.
The compile cache is a cache: it is emptied and deleted with the stack, and its lifecycle rule
expires old entries because the Neuron compiler never cleans its cache itself.

FSx for Lustre is the nodes' shared /fsx. Data repository associations link /fsx/data to the
data bucket and /fsx/jobs to the checkpoint bucket, so checkpoints written under /fsx/jobs reach
S3 with no extra code, and a new file system sees the jobs of an old one. A third links
/fsx/neuron-compile-cache to the compile-cache bucket's prefix: the jobs' Neuron persistent cache
is that directory, so each node's Lustre client serves its ranks' look-ups and S3 holds only the
durable copy, reached by the file system (an import per file, an export per new file), never by
the ranks (stacks/start_limits.py).
"""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_ec2 as ec2
from aws_cdk import aws_fsx as fsx
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3
from constructs import Construct

from stacks.config import ClusterConfig
from stacks.nag import acknowledge
from stacks.start_limits import metadata_configuration

COMPILE_CACHE_PREFIX = "neuron-compile-cache/"
FSX_MOUNT_POINT = "/fsx"
DATA_PATH = "/data"  # /fsx/data on the nodes
JOBS_PATH = "/jobs"  # /fsx/jobs on the nodes
COMPILE_CACHE_PATH = "/neuron-compile-cache"  # /fsx/neuron-compile-cache on the nodes
LUSTRE_VERSION = "2.15"


class ClusterBuckets(Construct):
    """Access-log, data, checkpoint and compile-cache buckets."""

    def __init__(self, scope: Construct, construct_id: str, *, config: ClusterConfig) -> None:
        super().__init__(scope, construct_id)
        keep = config.retain_data
        removal = cdk.RemovalPolicy.RETAIN if keep else cdk.RemovalPolicy.DESTROY

        self.access_log_bucket = s3.Bucket(
            self,
            "AccessLogBucket",
            # S3 server access logging can only deliver to SSE-S3 buckets.
            encryption=s3.BucketEncryption.S3_MANAGED,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            enforce_ssl=True,
            lifecycle_rules=[
                s3.LifecycleRule(
                    id="ExpireAccessLogs",
                    expiration=cdk.Duration.days(config.log_retention_days),
                    abort_incomplete_multipart_upload_after=cdk.Duration.days(7),
                )
            ],
            # Kept on `cdk destroy` even with retain_data=false, and never emptied by the
            # stack. S3 delivers server access logs best effort, "most log records ... within a
            # few hours" (S3 user guide, server access logging, best-effort log delivery), so
            # the records of the other buckets' last requests (the auto-delete handler
            # emptying them) can arrive after this bucket was emptied, and deleting it fails
            # with BucketNotEmpty (aws/aws-cdk issues #16332 and #21776). Deleting it after the
            # others does not help, nor does turning their logging off first (a change of
            # logging status takes up to an hour to reach delivery, same guide); CDK samples
            # retain the log bucket (aws-samples/generative-ai-cdk-constructs-samples PR #10).
            # Its expiry rule above empties it; docs/deploy.md says how to remove it by hand.
            removal_policy=cdk.RemovalPolicy.RETAIN,
        )
        acknowledge(
            self.access_log_bucket,
            ["AwsSolutions-S1", "NIST.800.53.R5-S3BucketLoggingEnabled"],
            "This is the server access log bucket; logging it into itself would loop.",
        )
        acknowledge(
            self.access_log_bucket,
            "NIST.800.53.R5-S3DefaultEncryptionKMS",
            "S3 server access logs can only be delivered to a bucket encrypted with SSE-S3.",
        )
        acknowledge(
            self.access_log_bucket,
            "NIST.800.53.R5-S3BucketVersioningEnabled",
            "Log objects are written once by the S3 logging service and never overwritten.",
        )

        self.data_bucket: s3.IBucket = (
            self._adopt("DataBucket", config.data_bucket_name)
            if config.data_bucket_name
            else self._bucket(
                "DataBucket",
                config=config,
                log_prefix="data/",
                versioned=True,
                noncurrent_days=30,
                removal=removal,
            )
        )
        self.checkpoint_bucket: s3.IBucket = (
            self._adopt("CheckpointBucket", config.checkpoint_bucket_name)
            if config.checkpoint_bucket_name
            else self._bucket(
                "CheckpointBucket",
                config=config,
                log_prefix="checkpoints/",
                versioned=True,
                noncurrent_days=14,
                removal=removal,
            )
        )
        # A cache: rebuilt by compiling again, so neither versioned nor kept on destroy. The
        # nodes never use it directly: it is the durable copy behind /fsx/neuron-compile-cache
        # (LustreFileSystem's CompileCacheRepositoryAssociation). Its expiry bounds what S3
        # keeps: the Neuron compiler never deletes an entry.
        self.compile_cache_bucket = self._bucket(
            "CompileCacheBucket",
            config=config,
            log_prefix="compile-cache/",
            versioned=False,
            noncurrent_days=None,
            removal=cdk.RemovalPolicy.DESTROY,
            expire_days=90,
        )
        acknowledge(
            self.compile_cache_bucket,
            "NIST.800.53.R5-S3BucketVersioningEnabled",
            "The Neuron compile cache is rebuilt by compiling again; old versions of cache "
            "entries have no value.",
        )
        for bucket in (
            self.access_log_bucket,
            self.data_bucket,
            self.checkpoint_bucket,
            self.compile_cache_bucket,
        ):
            if not isinstance(bucket, s3.Bucket):
                continue  # adopted: not this stack's resource
            acknowledge(
                bucket,
                "NIST.800.53.R5-S3BucketReplicationEnabled",
                "Training data, checkpoints and caches live in the cluster's region only; "
                "cross-region replication would double storage cost for data that is "
                "reproducible from its source.",
            )
        # The access-log bucket outlives the stack, and so does its policy: TLS only, and the
        # S3 logging service's permission to deliver the logs that still arrive.
        log_policy = self.access_log_bucket.policy
        assert log_policy is not None  # enforce_ssl made it
        log_policy.apply_removal_policy(cdk.RemovalPolicy.RETAIN)

    def _adopt(self, construct_id: str, bucket_name: str) -> s3.IBucket:
        """A bucket that a destroyed cluster kept (data_bucket_name, checkpoint_bucket_name),
        imported by name: the stack neither creates nor deletes it, whatever retain_data says,
        and its contents, versioning, lifecycle rules and access logging stay as the stack that
        created it left them. Its bucket policy went with that stack (the policy is no kept
        resource), so this stack writes the same TLS-only policy again (`enforce_ssl`'s
        statement); it replaces any policy the bucket has."""
        bucket = s3.Bucket.from_bucket_name(self, construct_id, bucket_name)
        policy = s3.BucketPolicy(self, f"{construct_id}Policy", bucket=bucket)
        policy.document.add_statements(
            iam.PolicyStatement(
                effect=iam.Effect.DENY,
                principals=[iam.AnyPrincipal()],
                actions=["s3:*"],
                resources=[bucket.bucket_arn, bucket.arn_for_objects("*")],
                conditions={"Bool": {"aws:SecureTransport": "false"}},
            )
        )
        return bucket

    def _bucket(
        self,
        construct_id: str,
        *,
        config: ClusterConfig,
        log_prefix: str,
        versioned: bool,
        noncurrent_days: int | None,
        removal: cdk.RemovalPolicy,
        expire_days: int | None = None,
    ) -> s3.Bucket:
        rules = [
            s3.LifecycleRule(
                id="AbortIncompleteUploads",
                abort_incomplete_multipart_upload_after=cdk.Duration.days(7),
            )
        ]
        if noncurrent_days is not None:
            rules.append(
                s3.LifecycleRule(
                    id="ExpireOldVersions",
                    noncurrent_version_expiration=cdk.Duration.days(noncurrent_days),
                    expired_object_delete_marker=True,
                )
            )
        if expire_days is not None:
            rules.append(
                s3.LifecycleRule(
                    id="ExpireOldCacheEntries",
                    prefix=COMPILE_CACHE_PREFIX,
                    expiration=cdk.Duration.days(expire_days),
                )
            )
        return s3.Bucket(
            self,
            construct_id,
            # SSE-KMS with the AWS managed key: FSx data repository associations can read and
            # write it without a per-file-system key policy.
            encryption=s3.BucketEncryption.KMS_MANAGED,
            bucket_key_enabled=True,
            block_public_access=s3.BlockPublicAccess.BLOCK_ALL,
            object_ownership=s3.ObjectOwnership.BUCKET_OWNER_ENFORCED,
            enforce_ssl=True,
            versioned=versioned,
            lifecycle_rules=rules,
            server_access_logs_bucket=self.access_log_bucket,
            server_access_logs_prefix=log_prefix,
            removal_policy=removal,
            auto_delete_objects=removal == cdk.RemovalPolicy.DESTROY,
        )


def _metadata_configuration(
    config: ClusterConfig,
) -> fsx.CfnFileSystem.MetadataConfigurationProperty:
    """Always a metadata configuration: one cannot be added to a file system created without
    one (FSx for Lustre user guide, Managing metadata performance), so a cluster created small
    could never grow. AUTOMATIC where the IOPS that Automatic mode gives the storage capacity
    serve every rank's opens at start; otherwise USER_PROVISIONED at the smallest value that
    serves them, which is above Automatic mode's (FSx refuses fewer). See
    stacks/start_limits.py metadata_configuration, and docs/deploy.md for growing a cluster."""
    chosen = metadata_configuration(config.node_count, config.fsx_storage_gib)
    props = chosen.properties
    return fsx.CfnFileSystem.MetadataConfigurationProperty(
        mode=str(props["Mode"]), iops=int(props["Iops"]) if "Iops" in props else None
    )


class LustreFileSystem(Construct):
    """FSx for Lustre PERSISTENT_2 with LZ4, linked to the data, checkpoint and compile-cache
    buckets."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        subnet: ec2.ISubnet,
        security_group: ec2.ISecurityGroup,
        data_bucket: s3.IBucket,
        checkpoint_bucket: s3.IBucket,
        compile_cache_bucket: s3.IBucket,
    ) -> None:
        super().__init__(scope, construct_id)
        self.key = kms.Key(
            self,
            "Key",
            description=f"{config.cluster_name}: encrypts the FSx for Lustre file system",
            enable_key_rotation=True,
            # The file system (no backups: S3 holds the durable copy) goes with the stack, and
            # so does its key.
            removal_policy=cdk.RemovalPolicy.DESTROY,
            pending_window=cdk.Duration.days(7),
        )
        # The L1 resource: the L2 LustreFileSystem adds security group rules of its own and has
        # no data repository associations.
        self.file_system = fsx.CfnFileSystem(
            self,
            "FileSystem",
            file_system_type="LUSTRE",
            file_system_type_version=LUSTRE_VERSION,
            storage_type="SSD",
            storage_capacity=config.fsx_storage_gib,
            subnet_ids=[subnet.subnet_id],
            security_group_ids=[security_group.security_group_id],
            kms_key_id=self.key.key_id,
            lustre_configuration=fsx.CfnFileSystem.LustreConfigurationProperty(
                deployment_type="PERSISTENT_2",
                per_unit_storage_throughput=config.fsx_throughput_per_tib,
                data_compression_type="LZ4",
                # Sunday 03:00 UTC; the S3 buckets hold the durable copy, so no FSx backups.
                weekly_maintenance_start_time="7:03:00",
                automatic_backup_retention_days=0,
                metadata_configuration=_metadata_configuration(config),
            ),
        )
        # Training data flows in from S3; files written to /fsx/data (by a data preparation
        # job, say) flow back, but deleting a file on /fsx never deletes the source object.
        self.data_association = self._associate(
            "DataRepositoryAssociation",
            path=DATA_PATH,
            bucket=data_bucket,
            export_events=["NEW", "CHANGED"],
        )
        # Checkpoints flow out to S3 as they are written, and pruned ones are removed there
        # too (bucket versioning keeps them for a while); a new file system imports old jobs.
        self.jobs_association = self._associate(
            "JobsRepositoryAssociation",
            path=JOBS_PATH,
            bucket=checkpoint_bucket,
            export_events=["NEW", "CHANGED", "DELETED"],
        )
        # The Neuron persistent cache of every job (NEURON_COMPILE_CACHE_URL, the nodes'
        # /fsx/neuron-compile-cache: compile_cache_url). A local directory is the cache's own
        # kind of URL, and the default one (/var/tmp/neuron-compile-cache): the cache is
        # "on-disk", an s3:// URL the one other kind ("Neuron Persistent Cache", AWS Neuron
        # documentation). Many processes share it by locking each entry while one compiles it
        # (the model.hlo_module.pb.lock beside model.neff in each MODULE_<hash> directory of the
        # cache, as aws-neuron/optimum-neuron-cache's listing and optimum-neuron's cache guide
        # show): across nodes that takes locks coherent on every client, which Lustre gives
        # with the `flock` mount option only ("-o flock: locks are coherent across all
        # clients", Lustre Operations Manual, Flock Feature), as scripts/node/bootstrap.sh
        # mounts /fsx. New entries flow out to S3 (deletions too: a failed entry removed on
        # /fsx, or a stale lock, must not come back into a new file system); entries in S3
        # that the file system lacks (a new file system's, or another cluster's) are imported
        # as metadata, their contents loaded from S3 once, on the first read.
        self.compile_cache_association = self._associate(
            "CompileCacheRepositoryAssociation",
            path=COMPILE_CACHE_PATH,
            bucket=compile_cache_bucket,
            prefix=COMPILE_CACHE_PREFIX,
            export_events=["NEW", "CHANGED", "DELETED"],
        )
        # One after the other: FSx can fail associations created on one file system at the same
        # time ("does not have the required permissions for the S3 bucket").
        self.jobs_association.add_resource_dependency(self.data_association)
        self.compile_cache_association.add_resource_dependency(self.jobs_association)
        #: What outlives the stack: the `export` command exports these before a destroy. The
        #: compile cache's bucket goes with the stack, so exporting it then would be for nothing.
        self.associations = [self.data_association, self.jobs_association]

    def _associate(
        self,
        construct_id: str,
        *,
        path: str,
        bucket: s3.IBucket,
        export_events: list[str],
        prefix: str = "",
    ) -> fsx.CfnDataRepositoryAssociation:
        # DataRepositoryPath: "an S3 bucket or prefix in the format s3://bucket-name/prefix/
        # (where prefix is optional)" (FSx API Reference, DataRepositoryAssociation).
        return fsx.CfnDataRepositoryAssociation(
            self,
            construct_id,
            file_system_id=self.file_system.ref,
            file_system_path=path,
            data_repository_path=f"s3://{bucket.bucket_name}" + (f"/{prefix}" if prefix else ""),
            batch_import_meta_data_on_create=True,
            s3=fsx.CfnDataRepositoryAssociation.S3Property(
                auto_import_policy=fsx.CfnDataRepositoryAssociation.AutoImportPolicyProperty(
                    events=["NEW", "CHANGED", "DELETED"]
                ),
                auto_export_policy=fsx.CfnDataRepositoryAssociation.AutoExportPolicyProperty(
                    events=export_events
                ),
            ),
        )


class StorageStack(cdk.Stack):
    """Buckets and the shared file system: the data that outlives any set of nodes."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        subnet: ec2.ISubnet,
        fsx_security_group: ec2.ISecurityGroup,
        **kwargs: Any,
    ) -> None:
        super().__init__(scope, construct_id, **kwargs)
        buckets = ClusterBuckets(self, "Buckets", config=config)
        self.access_log_bucket = buckets.access_log_bucket
        self.data_bucket = buckets.data_bucket
        self.checkpoint_bucket = buckets.checkpoint_bucket
        self.compile_cache_bucket = buckets.compile_cache_bucket
        lustre = LustreFileSystem(
            self,
            "Lustre",
            config=config,
            subnet=subnet,
            security_group=fsx_security_group,
            data_bucket=self.data_bucket,
            checkpoint_bucket=self.checkpoint_bucket,
            compile_cache_bucket=self.compile_cache_bucket,
        )
        self.file_system = lustre.file_system
        #: The file-system paths linked to S3 (/data, /jobs; on the nodes under /fsx), relative
        #: to the file system's root as data repository tasks take them.
        self.export_paths = [str(a.file_system_path) for a in lustre.associations]
        self.node_access_policy = self._node_access_policy(config)

    def _node_access_policy(self, config: ClusterConfig) -> iam.ManagedPolicy:
        """What the training nodes may do with the buckets: read data, read and write
        checkpoints. The compute stack attaches it to the node role. The compile-cache bucket
        is not in it: the nodes reach the cache through /fsx, and only FSx (the association,
        with its own service-linked role) reads and writes the bucket."""
        policy = iam.ManagedPolicy(
            self,
            "NodeAccessPolicy",
            description=f"{config.cluster_name} nodes: read data, read/write checkpoints",
            statements=[
                iam.PolicyStatement(
                    sid="ListClusterBuckets",
                    actions=["s3:ListBucket", "s3:GetBucketLocation"],
                    resources=[self.data_bucket.bucket_arn, self.checkpoint_bucket.bucket_arn],
                ),
                iam.PolicyStatement(
                    sid="ReadTrainingData",
                    actions=["s3:GetObject"],
                    resources=[self.data_bucket.arn_for_objects("*")],
                ),
                iam.PolicyStatement(
                    sid="ReadWriteCheckpoints",
                    actions=[
                        "s3:GetObject",
                        "s3:PutObject",
                        "s3:DeleteObject",
                        "s3:AbortMultipartUpload",
                    ],
                    resources=[self.checkpoint_bucket.arn_for_objects("*")],
                ),
            ],
        )
        reasons = {
            self.data_bucket: "Nodes read any object of this cluster's data bucket: "
            "training data sets are chosen per job.",
            self.checkpoint_bucket: "Nodes write and prune checkpoints of any job in "
            "this cluster's checkpoint bucket; job IDs are chosen at run time.",
        }
        for bucket, reason in reasons.items():
            cfn_bucket = bucket.node.default_child
            if isinstance(cfn_bucket, s3.CfnBucket):
                resource = f"<{self.get_logical_id(cfn_bucket)}.Arn>/*"
            else:  # adopted: its ARN is literal text (the region's partition resolved)
                resource = str(self.resolve(bucket.arn_for_objects("*")))
            acknowledge(policy, f"AwsSolutions-IAM5[Resource::{resource}]", reason)
        return policy

    @property
    def compile_cache_url(self) -> str:
        """NEURON_COMPILE_CACHE_URL on the nodes: the compile cache's directory on /fsx."""
        return f"{FSX_MOUNT_POINT}{COMPILE_CACHE_PATH}"
