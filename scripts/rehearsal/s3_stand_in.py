"""S3 for the rehearsal's data bucket, as the data repository association makes it: the
bucket's objects are the files under the rehearsal's /fsx/data.

The cluster links its data bucket to /fsx/data with automatic import (stacks/storage.py: a
data repository association with AutoImportPolicy NEW, CHANGED, DELETED), so an object put
there appears on every node under /fsx/data/<key>; the rehearsal's /fsx is its output folder
(FSX_MOUNT_POINT in the nodes' cluster.env, instances.py), so an object put here is written to
<output>/data/<key> (whole, by a rename: FSx shows an object once S3 has all of it). Served:
HeadObject, PutObject, ListObjectsV2 on that one bucket; another bucket is NoSuchBucket. The
answers pass the stand-in's check against botocore's output shapes like every other
(aws_stand_in.validate_answer).
"""

from __future__ import annotations

import base64
import hashlib
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from scripts.rehearsal.ssm_stand_in import LocalError


class S3StandIn:
    """The data bucket `bucket`, whose objects are the files under `root`."""

    def __init__(self, bucket: str, root: Path) -> None:
        self.bucket = bucket
        self.root = root

    def _path(self, params: dict[str, Any]) -> Path:
        if params.get("Bucket") != self.bucket:
            raise LocalError("NoSuchBucket", "The specified bucket does not exist", status=404)
        key = str(params.get("Key", ""))
        parts = PurePosixPath(key).parts
        if not key or ".." in parts or key.startswith("/"):
            raise LocalError("InvalidArgument", f"the rehearsal does not store key {key!r}")
        return self.root.joinpath(*parts)

    @staticmethod
    def _etag(content: bytes) -> str:
        return '"' + hashlib.md5(content, usedforsecurity=False).hexdigest() + '"'

    def _s3_HeadObject(self, params: dict[str, Any]) -> dict[str, Any]:
        path = self._path(params)
        if not path.is_file():
            # A HEAD has no body: S3 answers a missing key with the bare status (botocore
            # reads the code "404").
            raise LocalError("404", "Not Found", status=404)
        stat = path.stat()
        return {
            "ContentLength": stat.st_size,
            "ETag": self._etag(path.read_bytes()),
            "LastModified": datetime.fromtimestamp(stat.st_mtime, UTC),
        }

    def _s3_PutObject(self, params: dict[str, Any]) -> dict[str, Any]:
        path = self._path(params)
        body = params.get("Body", b"")
        content = body.read() if hasattr(body, "read") else bytes(body)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(handle, "wb") as file:
            file.write(content)
        staging = Path(name)
        staging.chmod(0o644)
        staging.replace(path)
        answer: dict[str, Any] = {"ETag": self._etag(content)}
        if params.get("ChecksumAlgorithm") == "SHA256":
            answer["ChecksumSHA256"] = base64.b64encode(hashlib.sha256(content).digest()).decode()
        return answer

    def _s3_ListObjectsV2(self, params: dict[str, Any]) -> dict[str, Any]:
        if params.get("Bucket") != self.bucket:
            raise LocalError("NoSuchBucket", "The specified bucket does not exist", status=404)
        prefix = str(params.get("Prefix", ""))
        most = int(params.get("MaxKeys", 1000))
        keys = sorted(
            path.relative_to(self.root).as_posix()
            for path in self.root.rglob("*")
            if path.is_file()
            and not any(part.startswith(".") for part in path.relative_to(self.root).parts)
        )
        matching = [k for k in keys if k.startswith(prefix)]
        page = matching[:most]
        contents = []
        for key in page:
            stat = (self.root / key).stat()
            contents.append(
                {
                    "Key": key,
                    "Size": stat.st_size,
                    "LastModified": datetime.fromtimestamp(stat.st_mtime, UTC),
                    "StorageClass": "STANDARD",
                }
            )
        answer: dict[str, Any] = {
            "Name": self.bucket,
            "Prefix": prefix,
            "MaxKeys": most,
            "KeyCount": len(page),
            "IsTruncated": len(matching) > len(page),
        }
        if answer["IsTruncated"]:
            answer["NextContinuationToken"] = page[-1] if page else prefix
        if contents:
            answer["Contents"] = contents
        return answer
