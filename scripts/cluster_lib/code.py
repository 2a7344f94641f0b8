"""A job's code: a directory snapshotted by content, uploaded once, run by every node.

`snapshot` packs a directory into a deterministic gzipped tarball (names sorted, mtime 0,
uid/gid 0, no user or group names, modes 0644 or 0755, the gzip header's mtime 0 and no file
name), so the same files give the same bytes and the same sha256 on any machine, whatever
their mtimes, owners, umask or creation order. Left out: `.git`, virtual environments (a
folder holding `pyvenv.cfg`), `__pycache__`, `*.pyc`, the tools' caches, `node_modules`, and,
when the directory is in a git work tree, what its `.gitignore` files ignore (git itself
lists the files: `git ls-files --cached --others --exclude-standard`). A snapshot holds at
most MAX_BYTES compressed.

`upload` puts it at `s3://<data bucket>/code/<sha256>.tar.gz` unless an object is there
already (HeadObject first: the name is the content's hash). The data repository association
links the bucket to /fsx/data, where the nodes find it (scripts/node/lib.sh, fetch_code).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from scripts.cluster_lib import REPO_ROOT, ClusterError
from scripts.cluster_lib.clients import aws_errors, cluster_error, error_code

#: The largest snapshot, compressed: 100 MiB. Code, not data or checkpoints.
MAX_BYTES = 100 * 1024 * 1024
#: Folder names never packed, at any depth.
EXCLUDED_DIRS = frozenset(
    {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", "node_modules"}
)
EXCLUDED_SUFFIXES = (".pyc",)
#: Where the snapshots live in the data bucket, and so under /fsx/data on the nodes.
KEY_PREFIX = "code/"
#: The reference workload: the default job's code, packed as the `workload/` package.
REFERENCE_WORKLOAD = REPO_ROOT / "workload"
DEFAULT_ENTRY = "-m workload.train"


@dataclass(frozen=True)
class Snapshot:
    """A packed code directory: its tarball's bytes, their sha256 and how many files."""

    source: Path
    data: bytes
    sha256: str
    #: The files' names in the tarball, sorted.
    names: tuple[str, ...]

    @property
    def files(self) -> int:
        return len(self.names)

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def key(self) -> str:
        return f"{KEY_PREFIX}{self.sha256}.tar.gz"

    def describe(self) -> str:
        return (
            f"code snapshot {self.sha256} ({self.files} files, {human(self.size)} compressed) "
            f"of {self.source}"
        )


def human(size: int) -> str:
    for unit, scale in (("MiB", 1024**2), ("KiB", 1024)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def _excluded(relative: PurePosixPath, root: Path) -> bool:
    if relative.name.endswith(EXCLUDED_SUFFIXES):
        return True
    for depth, part in enumerate(relative.parts[:-1]):
        if part in EXCLUDED_DIRS:
            return True
        # A virtual environment: a folder with pyvenv.cfg (PEP 405).
        if (root.joinpath(*relative.parts[: depth + 1]) / "pyvenv.cfg").is_file():
            return True
    return False


def _walk(root: Path) -> Iterator[PurePosixPath]:
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [
            d for d in dirs if d not in EXCLUDED_DIRS and not (here / d / "pyvenv.cfg").is_file()
        ]
        for name in files:
            yield PurePosixPath((here / name).relative_to(root).as_posix())


def _git_files(root: Path) -> list[PurePosixPath] | None:
    """The files git lists under `root` (tracked and untracked, less what .gitignore
    ignores), or None when `root` is not in a git work tree."""
    try:
        inside = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--is-inside-work-tree"],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return None
    listed = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True, check=False, timeout=300,
    )  # fmt: skip
    if listed.returncode != 0:
        raise ClusterError(
            f"git could not list the files of {root}: "
            f"{listed.stderr.decode(errors='replace').strip()[:300]}"
        )
    names = [n for n in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if n]
    return [PurePosixPath(n) for n in names]


def files_of(root: Path) -> list[PurePosixPath]:
    """The files a snapshot of `root` holds, relative to it, sorted."""
    listed = _git_files(root)
    candidates = _walk(root) if listed is None else iter(listed)
    kept = {
        p
        for p in candidates
        if not _excluded(p, root) and (root / p).is_file() and not (root / p).is_symlink()
    }
    return sorted(kept, key=lambda p: p.as_posix())


class _Limited(io.RawIOBase):
    """Collects the compressed bytes; stops at `limit`."""

    def __init__(self, limit: int) -> None:
        self.buffer = bytearray()
        self.limit = limit

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.buffer += data
        if len(self.buffer) > self.limit:
            raise _TooLarge
        return len(data)


class _TooLarge(Exception):
    pass


def snapshot(directory: Path, *, under: str = "", limit: int = MAX_BYTES) -> Snapshot:
    """Packs `directory` (its files under `under/` in the tarball when given)."""
    root = directory.resolve()
    if not root.is_dir():
        raise ClusterError(f"--code {directory} is not a directory")
    names = files_of(root)
    if not names:
        raise ClusterError(
            f"--code {directory} holds no files to run (after leaving out .git, virtual "
            "environments, caches and what .gitignore ignores)"
        )
    sink = _Limited(limit)
    try:
        with (
            gzip.GzipFile(filename="", mode="wb", fileobj=sink, mtime=0) as zipped,
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for name in names:
                path = root / name
                content = path.read_bytes()
                info = tarfile.TarInfo(str(PurePosixPath(under) / name) if under else str(name))
                info.size = len(content)
                info.mode = 0o755 if path.stat().st_mode & 0o100 else 0o644
                info.mtime = 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(content))
    except _TooLarge:
        total = sum((root / n).stat().st_size for n in names)
        raise ClusterError(
            f"--code {directory}: its {len(names)} files ({human(total)}) come to more than "
            f"{human(limit)} compressed, the limit of a code snapshot: leave data, "
            "checkpoints and environments out of the code directory (or list them in its "
            ".gitignore)"
        ) from None
    data = bytes(sink.buffer)
    packed = tuple(str(PurePosixPath(under) / n) if under else str(n) for n in names)
    return Snapshot(directory, data, hashlib.sha256(data).hexdigest(), packed)


def reference_snapshot() -> Snapshot:
    """The default job's code: the reference workload as the `workload/` package."""
    return snapshot(REFERENCE_WORKLOAD, under="workload")


def upload(s3: Any, bucket: str, packed: Snapshot) -> bool:
    """Puts the snapshot in the data bucket unless it is there; True when it uploaded."""
    try:
        s3.head_object(Bucket=bucket, Key=packed.key)
        return False
    except ClientError as error:
        # HeadObject has no body: a missing key is the bare HTTP status (S3 API reference).
        if error_code(error) not in ("404", "NoSuchKey", "NotFound"):
            raise cluster_error(f"looking for s3://{bucket}/{packed.key}", error) from None
    except BotoCoreError as error:
        raise cluster_error(f"looking for s3://{bucket}/{packed.key}", error) from None
    with aws_errors(f"uploading the code snapshot to s3://{bucket}/{packed.key}"):
        s3.put_object(
            Bucket=bucket,
            Key=packed.key,
            Body=packed.data,
            ContentType="application/gzip",
            ChecksumAlgorithm="SHA256",
        )
    return True
