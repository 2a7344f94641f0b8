"""What a job runs and reads: its code snapshot, its entry point and its data, made ready
before any node is touched.

`train` and `precompile` pack the code directory (code.py), check the entry point against
the snapshot, upload the snapshot once to the data bucket, and check the data: an
`s3://<data bucket>/<prefix>` URI must name the cluster's data bucket (the stack output
DataBucketName) and a prefix that holds at least one object (ListObjectsV2, MaxKeys 1); the
data repository association links that bucket to /fsx/data, so the job reads
/fsx/data/<prefix>. A path under /fsx/data is checked the same way; another /fsx path is
passed on as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.arguments import S3_URI, UsageError, entry_point
from scripts.cluster_lib.clients import aws_errors
from scripts.cluster_lib.code import Snapshot, reference_snapshot, snapshot, upload

#: Where the data repository association puts the data bucket on the nodes
#: (stacks/storage.py DATA_PATH under FSX_MOUNT_POINT).
DATA_MOUNT = "/fsx/data"


@dataclass(frozen=True)
class JobInputs:
    """The job's document parameters for its code and data (stacks/ssm_documents/)."""

    code: str
    entry: str
    data: str = ""

    def parameters(self) -> dict[str, str]:
        return {"CodeSnapshot": self.code, "EntryPoint": self.entry, "DataPath": self.data}


def pack(code: Path | None, script: str | None, module: str | None) -> tuple[Snapshot, str]:
    """The snapshot of `code` (by default the reference workload) and the entry point."""
    packed = reference_snapshot() if code is None else snapshot(code)
    try:
        entry = entry_point(script, module, packed.names)
    except UsageError as error:
        raise ClusterError(str(error)) from None
    return packed, entry


def data_path(s3: Any, bucket: str, value: str | None) -> str:
    """The DataPath parameter for `--data`: "" without it, else the path on the nodes, once
    the data is found in the cluster's data bucket."""
    if not value:
        return ""
    prefix: str | None = None
    if value.startswith("s3://"):
        match = S3_URI.fullmatch(value)
        if match is None:
            raise ClusterError(f"--data {value!r} is not an S3 URI: use s3://<bucket>/<prefix>")
        if match[1] != bucket:
            raise ClusterError(
                f"--data {value}: bucket {match[1]} is not this cluster's data bucket "
                f"{bucket}, the one linked to {DATA_MOUNT}: copy the data there "
                f"(aws s3 cp --recursive <folder> s3://{bucket}/<prefix>)"
            )
        prefix = (match[3] or "").strip("/")
    elif value.rstrip("/") == DATA_MOUNT or value.startswith(DATA_MOUNT + "/"):
        prefix = value[len(DATA_MOUNT) :].strip("/")
    if prefix is None:
        return value.rstrip("/")
    listed_prefix = f"{prefix}/" if prefix else ""
    with aws_errors(f"looking for the data in s3://{bucket}/{listed_prefix}"):
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=listed_prefix, MaxKeys=1)
    if not listed.get("KeyCount") and not listed.get("Contents"):
        raise ClusterError(
            f"--data {value}: nothing in s3://{bucket}/{listed_prefix}: upload the data first "
            f"(aws s3 cp --recursive <folder> s3://{bucket}/{listed_prefix})"
        )
    return f"{DATA_MOUNT}/{prefix}" if prefix else DATA_MOUNT


def prepare(
    s3: Any,
    bucket: str,
    *,
    code: Path | None,
    script: str | None,
    module: str | None,
    data: str | None,
    out: Any,
) -> JobInputs:
    """Packs and checks everything, then uploads the snapshot (once: its name is its hash)."""
    packed, entry = pack(code, script, module)
    path = data_path(s3, bucket, data)
    uploaded = upload(s3, bucket, packed)
    where = f"s3://{bucket}/{packed.key}"
    out(f"{packed.describe()}: {'uploaded to' if uploaded else 'already in'} {where}")
    return JobInputs(packed.sha256, entry, path)
