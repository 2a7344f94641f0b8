"""Destroy, deploy again with the kept buckets, `train --resume` the old job: it resumes from its
last checkpoint, not from step 0.

The account is scripts/rehearsal/storage_stand_in.py: buckets and file systems made and removed
as the synthesized storage templates say (the buckets each creates, what its data repository
associations link, each bucket's DeletionPolicy), with FSx's import of a linked bucket when an
association is created. The job's node is tests/node_support.py's FakeNode, its /fsx the
redeployed cluster's file system, and what it starts from is launch.sh's own decision (--dry-run:
the line it logs and TRAINIUM_RESUME). `train --resume JOB` on the new cluster starts the job
without looking for it among the new supervisor's executions
(tests/test_cluster_resume.py::test_resume_resumes_the_job_without_looking_for_it).
"""

from __future__ import annotations

from pathlib import Path

from scripts.rehearsal.storage_stand_in import Account, DeployedStorage
from stacks.config import CLUSTER_TAG_KEY
from tests.cdk_support import synth
from tests.node_support import FakeNode

JOB = "bert-1"


def save(storage: DeployedStorage, step: int) -> None:
    """A checkpoint of JOB in the reference trainer's layout (workload/checkpoint.py), written
    where the nodes write it: /fsx/jobs/<job>/checkpoints/step_<8 digits>/."""
    path = storage.file_system.path("/jobs") / JOB / "checkpoints" / f"step_{step:08d}"
    path.mkdir(parents=True)
    for name in ("model.safetensors", "trainer_state.pt", "config.json"):
        (path / name).write_bytes(b"saved")


def resume_on(storage: DeployedStorage, root: Path) -> tuple[str, str]:
    """What launch.sh on a node of this cluster says the resumed job starts from."""
    root.mkdir()
    node = FakeNode(root)
    node.settings["FSX_MOUNT_POINT"] = str(storage.file_system.mount)
    node.write_env()
    result = node.run("launch.sh", "--hosts", "10.1.0.12", "--job-id", JOB,
                      "--nproc-per-node", "1", "--resume", "resume", "--dry-run")  # fmt: skip
    assert result.returncode == 0, result.stderr
    (said,) = [line for line in result.stderr.splitlines() if f"job {JOB}: " in line]
    (flag,) = [line for line in result.stdout.splitlines() if line.startswith("TRAINIUM_RESUME=")]
    return said.split(f"job {JOB}: ", 1)[1], flag


def test_a_job_resumes_on_the_cluster_deployed_again_with_the_kept_buckets(
    tmp_path: Path,
) -> None:
    account = Account(tmp_path / "account")
    first = synth()
    stack = f"{first.config.cluster_name}-storage"
    cluster = account.create_storage(stack, first.templates["storage"])
    save(cluster, 100)
    save(cluster, 200)
    # docs/deploy.md, "Destroying the cluster": export, then destroy.
    account.export(cluster)
    account.delete_storage(cluster)
    assert not cluster.file_system.mount.exists()

    # docs/deploy.md, "Deploying again after a destroy": the kept buckets, found by the
    # cluster's tag; the compile cache's bucket went with the stack.
    kept = account.buckets_tagged(CLUSTER_TAG_KEY, first.config.cluster_name)
    data = next(name for logical_id, name in kept if "DataBucket" in logical_id)
    checkpoints = next(name for logical_id, name in kept if "CheckpointBucket" in logical_id)
    assert not [name for logical_id, name in kept if "CompileCache" in logical_id]
    again = synth(data_bucket_name=data, checkpoint_bucket_name=checkpoints)
    redeployed = account.create_storage(stack, again.templates["storage"])
    jobs = next(a for a in redeployed.file_system.associations if a.file_system_path == "/jobs")
    assert jobs.bucket == checkpoints  # /fsx/jobs is the kept bucket
    assert [lid for lid in redeployed.buckets if "Data" in lid or "Checkpoint" in lid] == []

    said, flag = resume_on(redeployed, tmp_path / "node")
    expected = redeployed.file_system.path("/jobs") / JOB / "checkpoints" / "step_00000200"
    assert said == f"resuming from step 200 ({expected})"
    assert flag == "TRAINIUM_RESUME=1"


def test_without_the_kept_buckets_the_job_starts_at_step_0(tmp_path: Path) -> None:
    """What a deploy again did before data_bucket_name and checkpoint_bucket_name: new, empty
    buckets, and the old job's resume starts from nothing."""
    account = Account(tmp_path / "account")
    first = synth()
    stack = f"{first.config.cluster_name}-storage"
    cluster = account.create_storage(stack, first.templates["storage"])
    save(cluster, 200)
    account.export(cluster)
    account.delete_storage(cluster)
    redeployed = account.create_storage(stack, first.templates["storage"])
    said, flag = resume_on(redeployed, tmp_path / "node")
    assert said.startswith("resume asked, but") and said.endswith("it starts at step 0")
    assert flag == "TRAINIUM_RESUME=1"
    # The old checkpoints are still in the kept bucket, only not linked.
    kept = account.buckets_tagged(CLUSTER_TAG_KEY, first.config.cluster_name)
    assert len([name for logical_id, name in kept if "CheckpointBucket" in logical_id]) == 2
