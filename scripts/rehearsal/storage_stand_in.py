"""An account's S3 buckets and FSx for Lustre file systems, made and removed as CloudFormation
does from a synthesized storage template: the rehearsal of destroy and deploy again.

Buckets are folders under `<root>/s3/<bucket name>`; a file system is a folder that is the
nodes' /fsx (FSX_MOUNT_POINT). What each step does comes from the template, never from the
test: the S3 buckets it creates (AWS::S3::Bucket, named as CloudFormation names a bucket without
a BucketName: the stack, the logical ID and a random suffix), the buckets its data repository
associations link (a literal `s3://name` for an adopted bucket, a bucket of the stack by `Ref`),
and on delete each bucket's DeletionPolicy (`Retain` keeps it with its objects).

FSx's rules as the FSx for Lustre user guide states them ("Linking your file system to an S3
bucket", data repository associations): an association whose BatchImportMetaDataOnCreate is
true imports the listing of the linked bucket or prefix into its file system path when it is
created, so the files of a kept bucket appear on a new file system; files written under the
path are exported to S3 by the association's automatic export (NEW, CHANGED) or by an export
data repository task (`trainium-cluster export` before a destroy); a file system's own files
go with it when it is deleted. An association naming a bucket that does not exist fails.
"""

from __future__ import annotations

import itertools
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KEPT = ("Retain", "RetainExceptOnCreate")


class StandInError(RuntimeError):
    """What CloudFormation or FSx would refuse, in their words."""


@dataclass
class Association:
    file_system_path: str  # "/jobs"
    bucket: str
    prefix: str  # "" or "neuron-compile-cache/"
    export_events: list[str]


@dataclass
class FileSystem:
    mount: Path  # the nodes' /fsx
    associations: list[Association] = field(default_factory=list)

    def path(self, file_system_path: str) -> Path:
        return self.mount / file_system_path.lstrip("/")


@dataclass
class DeployedStorage:
    stack_name: str
    template: dict[str, Any]
    buckets: dict[str, str]  # logical ID -> bucket name
    file_system: FileSystem


class Account:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.s3 = root / "s3"
        self.s3.mkdir(parents=True, exist_ok=True)
        #: Each bucket's tags, as CloudFormation tags what it creates (aws:cloudformation:*).
        self.bucket_tags: dict[str, dict[str, str]] = {}
        self._file_systems = itertools.count(1)

    def bucket(self, name: str) -> Path:
        return self.s3 / name

    # ------------------------------------------------------------- CloudFormation
    def create_storage(self, stack_name: str, template: dict[str, Any]) -> DeployedStorage:
        resources = template["Resources"]
        buckets = {}
        for logical_id, resource in resources.items():
            if resource["Type"] != "AWS::S3::Bucket":
                continue
            name = f"{stack_name}-{logical_id}-{secrets.token_hex(6)}".lower()[:63]
            self.bucket(name).mkdir()
            buckets[logical_id] = name
            tags = {t["Key"]: t["Value"] for t in resource.get("Properties", {}).get("Tags", [])}
            self.bucket_tags[name] = {
                **tags,
                "aws:cloudformation:stack-name": stack_name,
                "aws:cloudformation:logical-id": logical_id,
            }
        (fs_id,) = [k for k, r in resources.items() if r["Type"] == "AWS::FSx::FileSystem"]
        mount = self.root / f"fsx-{next(self._file_systems)}"
        mount.mkdir()
        file_system = FileSystem(mount)
        for resource in resources.values():
            if resource["Type"] != "AWS::FSx::DataRepositoryAssociation":
                continue
            props = resource["Properties"]
            assert props["FileSystemId"] == {"Ref": fs_id}
            location = _resolve(props["DataRepositoryPath"], buckets).removeprefix("s3://")
            bucket, _, prefix = location.partition("/")
            if not self.bucket(bucket).is_dir():
                raise StandInError(
                    f"data repository association {props['FileSystemPath']}: the S3 bucket "
                    f"{bucket} does not exist"
                )
            association = Association(
                props["FileSystemPath"], bucket, prefix, props["S3"]["AutoExportPolicy"]["Events"]
            )
            file_system.associations.append(association)
            target = file_system.path(association.file_system_path)
            target.mkdir(parents=True, exist_ok=True)
            if props.get("BatchImportMetaDataOnCreate"):
                source = self.bucket(bucket) / prefix
                if source.is_dir():
                    shutil.copytree(source, target, dirs_exist_ok=True)
        return DeployedStorage(stack_name, template, buckets, file_system)

    def export(self, storage: DeployedStorage) -> None:
        """An export data repository task on every association (`trainium-cluster export`):
        new and changed files reach their bucket."""
        for association in storage.file_system.associations:
            source = storage.file_system.path(association.file_system_path)
            target = self.bucket(association.bucket) / association.prefix
            shutil.copytree(source, target, dirs_exist_ok=True)

    def delete_storage(self, storage: DeployedStorage) -> None:
        """`cdk destroy` of the storage stack: the file system goes, each bucket by its
        DeletionPolicy (an adopted bucket is no resource of the stack and stays)."""
        shutil.rmtree(storage.file_system.mount)
        resources = storage.template["Resources"]
        for logical_id, name in storage.buckets.items():
            if resources[logical_id].get("DeletionPolicy") not in KEPT:
                shutil.rmtree(self.bucket(name))
                del self.bucket_tags[name]

    def buckets_tagged(self, key: str, value: str) -> list[tuple[str, str]]:
        """(CloudFormation logical ID, bucket name) of the buckets with this tag: what
        `aws resourcegroupstaggingapi get-resources --tag-filters` finds after a destroy."""
        return [
            (tags["aws:cloudformation:logical-id"], name)
            for name, tags in self.bucket_tags.items()
            if tags.get(key) == value and self.bucket(name).is_dir()
        ]


def _resolve(value: Any, buckets: dict[str, str]) -> str:
    """A DataRepositoryPath: literal text, or Fn::Join over text and a bucket's Ref."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) == {"Ref"}:
        return buckets[value["Ref"]]
    if isinstance(value, dict) and set(value) == {"Fn::Join"}:
        separator, parts = value["Fn::Join"]
        return str(separator).join(_resolve(part, buckets) for part in parts)
    raise StandInError(f"cannot resolve {value!r} without an account")
