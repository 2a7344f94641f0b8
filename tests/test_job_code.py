"""A job's own code and data through the cluster's `train` path, on the rehearsal's nodes.

`cluster.py train --code DIR --entry SCRIPT --data s3://<data bucket>/<prefix>` as an
operator types it, against the local stand-in (two network namespaces with a node agent each
running the real SSM documents, the synthesized job supervisor in moto's Step Functions
interpreter, S3 for the data bucket as the data repository association shows it under
/fsx/data): the CLI packs the directory, uploads the snapshot once, and every node fetches
it from /fsx/data/code/, checks its sha256, unpacks it and runs the script under torchrun. The
script, written here, all-reduces a tensor across both hosts (gloo) and writes the sum and a
digest of the code it ran from. The directory changes while the job runs; the nodes still run
the snapshot.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster_lib.code import snapshot
from tests.node_support import unique_job_id
from tests.test_rehearsal import Cli, operations, short_legs, stand_in, wait_for

__all__ = ["operations", "short_legs"]  # fixtures of test_rehearsal, shared here

#: Digest of a code folder's files (names and contents), as the script computes it.
DIGEST = """
def digest(root):
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\\0" + path.read_bytes())
    return h.hexdigest()
"""

SCRIPT = (
    """
import hashlib, json, os, pathlib, sys
import torch
import torch.distributed as dist

VERSION = "original"
"""
    + DIGEST
    + """
dist.init_process_group("gloo")
rank = dist.get_rank()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
code = pathlib.Path(os.environ["TRAINIUM_CODE_DIR"])
data = pathlib.Path(os.environ["TRAINIUM_DATA_DIR"])
output = pathlib.Path(os.environ["TRAINIUM_OUTPUT_DIR"])
output.mkdir(parents=True, exist_ok=True)
(output / f"rank-{rank}.json").write_text(json.dumps({
    "rank": rank, "world": dist.get_world_size(), "sum": total.item(), "version": VERSION,
    "cwd": os.getcwd(), "code_dir": str(code), "code_digest": digest(code),
    "snapshot": os.environ["TRAINIUM_CODE_SNAPSHOT"], "args": sys.argv[1:],
    "data": (data / "lines.txt").read_text().splitlines(),
}))
dist.barrier()
dist.destroy_process_group()
"""
)


def digest(root: Path) -> str:
    namespace: dict[str, Any] = {"hashlib": hashlib}
    exec(DIGEST, namespace)  # the script's own function, run here on the original folder
    result: str = namespace["digest"](root)
    return result


def write_code(root: Path) -> Path:
    (root / "lib").mkdir(parents=True)
    (root / "allreduce.py").write_text(SCRIPT)
    (root / "lib" / "helper.py").write_text("ANSWER = 42\n")
    (root / "notes.log").write_text("left out by .gitignore only in a work tree\n")
    return root


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.usefixtures("short_legs")
def test_train_runs_a_code_directory_snapshot_on_every_node(
    tmp_path: Path,
    operations: tuple[str, dict[str, Any]],
    capfd: pytest.CaptureFixture[str],
) -> None:
    cluster_name, template = operations
    from scripts.rehearsal.supervisor import local_supervisor

    code = write_code(tmp_path / "my-job")
    original = digest(code)
    expected = snapshot(code)
    job = unique_job_id("own-code")
    with (
        stand_in(tmp_path / "cluster", cluster_name=cluster_name) as cloud,
        local_supervisor(cloud, template),
    ):
        s3 = cloud.client("s3")
        s3.put_object(Bucket=cloud.data_bucket, Key="lines/lines.txt", Body=b"one\ntwo\n")
        uploaded = tmp_path / "cluster" / "data" / expected.key

        # Bad data is refused in one line before any node is touched.
        for data, message in (
            (f"s3://{cloud.data_bucket}/missing", f"nothing in s3://{cloud.data_bucket}/missing/"),
            ("s3://another-bucket/lines", "bucket another-bucket is not this cluster's data"),
        ):
            refused = Cli(cloud, "train", "--job-id", "refused", "--code", str(code),
                          "--entry", "allreduce.py", "--data", data)  # fmt: skip
            refused.run()
            captured = capfd.readouterr()
            assert refused.code == 1, captured.out + captured.err
            (line,) = captured.err.splitlines()
            assert message in line, line
        assert not cloud.commands, "a node was sent a command for a job with bad data"
        assert not uploaded.exists()

        train = Cli(cloud, "train", "--job-id", job, "--code", str(code), "--entry",
                    "allreduce.py", "--data", f"s3://{cloud.data_bucket}/lines",
                    "--max-retries", "0", "--check-every", "1", "--failure-grace", "5",
                    "--", "--flag", "1")  # fmt: skip
        changed = threading.Event()

        def change_the_folder() -> None:
            """Once `train` has uploaded the snapshot, the operator edits the folder."""
            wait_for("the snapshot upload", uploaded.is_file, 300, lambda: "")
            (code / "allreduce.py").write_text(SCRIPT.replace('"original"', '"changed"'))
            (code / "lib" / "helper.py").unlink()
            changed.set()

        editor = threading.Thread(target=change_the_folder, daemon=True)
        editor.start()
        train.start()
        train.join(900)
        editor.join(10)
        captured = capfd.readouterr()
        assert train.code == 0, captured.out + captured.err
        assert changed.is_set()
        assert re.search(
            rf"code snapshot {expected.sha256} \(3 files, [0-9.]+ (B|KiB) compressed\) of {code}: "
            rf"uploaded to s3://{cloud.data_bucket}/code/{expected.sha256}\.tar\.gz",
            captured.out,
        ), captured.out
        (command,) = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert command.parameters["CodeSnapshot"] == [expected.sha256]
        assert command.parameters["EntryPoint"] == ["allreduce.py"]
        assert command.parameters["DataPath"] == ["/fsx/data/lines"]

        job_dir = tmp_path / "cluster" / "jobs" / job
        results = [json.loads((job_dir / f"rank-{r}.json").read_text()) for r in (0, 1)]
        for rank, result in enumerate(results):
            assert result["rank"] == rank and result["world"] == 2
            assert result["sum"] == 3.0  # 1 + 2: the all-reduce crossed both hosts
            assert result["version"] == "original"
            assert result["code_digest"] == original, "a node ran other code than the snapshot"
            assert result["snapshot"] == expected.sha256
            assert result["code_dir"].endswith(f"/code/{expected.sha256}")
            assert result["cwd"] == result["code_dir"]
            assert result["args"] == ["--flag", "1"]
            assert result["data"] == ["one", "two"]
        # Each node unpacked the snapshot into its own cache (the nodes' /var is their own).
        caches = [
            node.root / "upper" / "var" / "cache" / "trainium-cluster" / "code" / expected.sha256
            for node in cloud.running()
        ]
        assert all((cache / "lib" / "helper.py").is_file() for cache in caches), caches
