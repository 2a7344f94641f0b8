"""`trainium-cluster deploy`: the settings file against what is deployed, on synthesized stacks.

The deployed cluster is a synthesized one: CloudFormation's DescribeStacks is answered from its
templates (scripts/rehearsal/stacks_stand_in.py, checked against botocore's output shape), so
the settings `deploy` compares with are the ones the operations stack records (its `Settings`
output). Which changes are refused is stacks/settings_changes.py's table, itself checked
against the templates (tests/test_settings_changes.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from scripts import cluster as cli
from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.deploy import KEPT_MARKER, cluster_settings, deploy
from scripts.rehearsal.stacks_stand_in import DeployedStacks
from tests.cdk_support import REPO_ROOT, Synth, synth

BLOCK = {
    "az_id": "use1-az6",
    "node_count": "4",
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "capacity_block": "true",
    "capacity_block_start": "2026-12-01T11:30:00Z",
    "capacity_block_end": "2026-12-08T11:30:00Z",
}


def deployed(synthesized: Synth, **kwargs: Any) -> DeployedStacks:
    name = synthesized.config.cluster_name
    return DeployedStacks(
        {f"{name}-{part}": t for part, t in synthesized.templates.items()}, **kwargs
    )


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copy(REPO_ROOT / "cdk.json", tmp_path / "cdk.json")
    (tmp_path / "clusters").mkdir()
    return tmp_path


class Runs:
    """`npx cdk deploy`, recorded; with `creates`, the stacks it leaves deployed."""

    def __init__(self, stacks: DeployedStacks, creates: Synth | None = None) -> None:
        self.commands: list[tuple[list[str], Path]] = []
        self.stacks, self.creates = stacks, creates

    def __call__(self, command: Sequence[str], root: Path) -> int:
        self.commands.append((list(command), root))
        if self.creates is not None:
            self.stacks.templates.update(deployed(self.creates).templates)
        return 0


def run_deploy(
    stacks: DeployedStacks, root: Path, creates: Synth | None = None, **options: Any
) -> tuple[int, list[str], Runs]:
    lines: list[str] = []
    runs = Runs(stacks, creates)
    cloudformation = stacks.session().client("cloudformation")
    status = deploy(
        cloudformation,
        "trainium",
        allow_disruption=options.get("allow_disruption", False),
        dry_run=options.get("dry_run", False),
        out=lines.append,
        root=root,
        run=runs,
    )
    return status, lines, runs


def write_block_file(root: Path) -> None:
    (root / "clusters" / "trainium.yaml").write_text(
        "".join(f"{key}: {value!r}\n" for key, value in BLOCK.items())
        .replace("'4'", "4")
        .replace("'true'", "true")
    )


def test_a_deploy_without_the_blocks_settings_is_refused_in_one_line(
    root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cluster was deployed for a Capacity Block; a deploy from cdk.json's defaults (no
    settings file: what a bare `npx cdk deploy --all` synthesized) would scale it to 2 On-Demand
    nodes and end the block's job. Through the CLI's own entry point."""
    monkeypatch.chdir(root)  # a checkout: cdk.json, no clusters/trainium.yaml
    stacks = deployed(synth(**BLOCK))
    status = cli.main(["deploy"], session=stacks.session())
    captured = capsys.readouterr()
    assert status == 1
    (line,) = captured.err.splitlines()
    assert line.startswith("error: deploy refused: node_count 4 -> 2, capacity_reservation_id")
    for key in ("capacity_block true -> false", "capacity_block_start", "capacity_block_end"):
        assert key in line
    assert line.endswith(
        "stop the cluster's jobs first and deploy with --allow-disruption, or write the "
        "deployed settings into clusters/trainium.yaml"
    )
    assert "node_count: 4 -> 2 (Auto Scaling terminates the nodes above the new count)" in (
        captured.out
    )
    assert stacks.calls == ["cloudformation.DescribeStacks"]


def test_the_same_settings_from_the_file_deploy(root: Path) -> None:
    write_block_file(root)
    stacks = deployed(synth(**BLOCK))
    status, lines, runs = run_deploy(stacks, root)
    assert status == 0
    assert lines[0] == "cluster trainium: clusters/trainium.yaml matches the deployed settings"
    assert runs.commands == [(["npx", "cdk", "deploy", "--all", "-c", "cluster=trainium"], root)]
    # The kept buckets' names, for the deploy after a destroy, as comments in the file.
    data = stacks.bucket_name("trainium-storage", "BucketsDataBucket44451DC7")
    checkpoints = stacks.bucket_name("trainium-storage", "BucketsCheckpointBucket6455F5C4")
    assert lines[1] == (
        f"kept on destroy: data_bucket_name: {data}, checkpoint_bucket_name: {checkpoints} "
        "(noted in trainium.yaml)"
    )
    path = root / "clusters" / "trainium.yaml"
    text = path.read_text()
    assert text.endswith(
        f"{KEPT_MARKER}\n# data_bucket_name: {data}\n# checkpoint_bucket_name: {checkpoints}\n"
    )
    assert run_deploy(stacks, root)[1][0].endswith("matches the deployed settings")
    assert path.read_text() == text  # noted once
    # Uncommented, they adopt the buckets.
    path.write_text(text.replace("# data_bucket_name", "data_bucket_name"))
    assert cluster_settings("trainium", root).data_bucket_name == data


def test_allow_disruption_deploys_what_it_lists(root: Path) -> None:
    status, lines, runs = run_deploy(deployed(synth(**BLOCK)), root, allow_disruption=True)
    assert status == 0 and len(runs.commands) == 1
    assert lines[0].startswith("cluster trainium: cdk.json (no settings file) changes 5")


def test_a_change_that_ends_no_job_deploys(root: Path) -> None:
    write_block_file(root)
    with (root / "clusters" / "trainium.yaml").open("a") as file:
        file.write("alarm_email: ops@example.com\nnode_wait_hours: 48\n")
    status, lines, runs = run_deploy(deployed(synth(**BLOCK)), root)
    assert status == 0 and len(runs.commands) == 1
    assert lines[1:3] == [
        '  alarm_email: "" -> "ops@example.com"',
        "  node_wait_hours: 24 -> 48",
    ]


def test_more_nodes_deploy_fewer_are_refused(root: Path) -> None:
    (root / "clusters" / "trainium.yaml").write_text("node_count: 3\n")
    status, _, runs = run_deploy(deployed(synth()), root)
    assert status == 0 and len(runs.commands) == 1
    with pytest.raises(ClusterError) as error:
        run_deploy(deployed(synth(node_count="4")), root)
    assert str(error.value).startswith("deploy refused: node_count 4 -> 3 would end")


def test_a_new_cluster_deploys_and_a_dry_run_deploys_nothing(root: Path) -> None:
    status, lines, runs = run_deploy(DeployedStacks({}), root, creates=synth())
    assert status == 0 and len(runs.commands) == 1
    assert lines[0] == (
        "cluster trainium is not deployed: a new cluster from cdk.json (no settings file)"
    )
    assert lines[1].startswith("kept on destroy: data_bucket_name: trainium-storage-")
    with pytest.raises(ClusterError):  # a dry run refuses what a deploy refuses
        run_deploy(deployed(synth(**BLOCK)), root, dry_run=True)
    write_block_file(root)
    status, lines, runs = run_deploy(deployed(synth(**BLOCK)), root, dry_run=True)
    assert status == 0 and runs.commands == []
    assert lines[-1] == "dry run: would run npx cdk deploy --all -c cluster=trainium"


def test_a_stack_being_updated_is_refused(root: Path) -> None:
    with pytest.raises(ClusterError) as error:
        run_deploy(deployed(synth(), status="UPDATE_IN_PROGRESS"), root)
    assert str(error.value) == (
        "stack trainium-operations is in state UPDATE_IN_PROGRESS: wait until it ends"
    )
