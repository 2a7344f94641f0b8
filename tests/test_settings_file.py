"""A cluster's settings file (stacks/settings_file.py), as the CDK app and the CLI read it.

CDK stores no context given with `-c` (NOTES.md; CDK developer guide, "Context values": only
cdk.json, cdk.context.json and the command line supply it), so a later deploy without the `-c`
values synthesizes cdk.json's defaults. The file is where a cluster's settings stick.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from scripts.cluster import settings_region
from scripts.cluster_lib import ClusterError
from stacks.config import ConfigError
from stacks.settings_file import config_from_app_context, settings_record
from tests.cdk_support import CDK_CONTEXT, REPO_ROOT

BLOCK_FILE = """\
# A Capacity Block of 4 x trn1.32xlarge, 1-8 December
az_id: use1-az6
node_count: 4
capacity_reservation_id: cr-0123456789abcdef0
capacity_block: true
capacity_block_start: "2026-12-01T11:30:00Z"
capacity_block_end: "2026-12-08T11:30:00Z"
"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    shutil.copy(REPO_ROOT / "cdk.json", tmp_path / "cdk.json")
    (tmp_path / "clusters").mkdir()
    return tmp_path


def app_config(root: Path, command_line: dict[str, str] | None = None, **environ: str) -> Any:
    """What app.py builds: cdk.json's context plus `-c` values (strings, as the CLI passes)."""
    context: dict[str, Any] = {**CDK_CONTEXT, **(command_line or {})}
    return config_from_app_context(context.get, context, root=root, environ=environ)


def one_line(error: pytest.ExceptionInfo[Exception]) -> str:
    text = str(error.value)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_the_blocks_settings_stick_without_any_c(root: Path) -> None:
    (root / "clusters" / "trainium.yaml").write_text(BLOCK_FILE)
    config = app_config(root)  # a bare `npx cdk deploy --all`
    assert (config.node_count, config.capacity_block, config.capacity_reservation_id) == (
        4,
        True,
        "cr-0123456789abcdef0",
    )
    assert config.capacity_block_end == "2026-12-08T11:30:00Z"
    assert config.instance_type == CDK_CONTEXT["instance_type"]  # not in the file: cdk.json's
    record = json.loads(settings_record(config))
    assert record["capacity_block"] is True and record["node_count"] == 4


def test_an_unquoted_time_is_the_same_time(root: Path) -> None:
    """YAML 1.1 (PyYAML) reads 2026-12-01T11:30:00Z unquoted as a timestamp, not a string."""
    (root / "clusters" / "trainium.yaml").write_text(BLOCK_FILE.replace('"', ""))
    assert app_config(root).capacity_block_start == "2026-12-01T11:30:00Z"
    (root / "clusters" / "trainium.yaml").write_text(
        BLOCK_FILE.replace('"2026-12-01T11:30:00Z"', "2026-12-01")
    )
    with pytest.raises(ConfigError) as error:
        app_config(root)
    assert "capacity_block_start has no single value" in one_line(error)


def test_the_cluster_is_picked_by_c_cluster_or_the_environment(root: Path) -> None:
    (root / "clusters" / "research.yaml").write_text("node_count: 8\n")
    assert app_config(root, {"cluster": "research"}).cluster_name == "research"
    assert app_config(root, TRAINIUM_CLUSTER_NAME="research").node_count == 8
    assert app_config(root).cluster_name == "trainium"  # no file: cdk.json, as before


def test_without_a_file_cdk_json_and_c_work_as_before(root: Path) -> None:
    assert app_config(root, {"node_count": "6"}).node_count == 6


def test_a_named_cluster_without_a_file_is_refused_in_one_line(root: Path) -> None:
    with pytest.raises(ConfigError) as error:
        app_config(root, {"cluster": "research"})
    assert one_line(error).startswith("cluster=research has no settings file clusters/")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node_cout: 4\n", "node_cout is not a setting (did you mean node_count?)"),
        ("node_count: [4]\n", "node_count has no single value"),
        ("node_count: four\n", "node_count='four' is not a whole number"),
        ("- node_count\n", "is not a mapping"),
        ("node_count: 4\n  bad: [\n", "line 2"),
        ("cluster_name: other\n", "says cluster_name: other; allowed: trainium"),
        ("capacity_block: true\n", "capacity_block=true is not allowed without a reservation"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_it(root: Path, text: str, message: str) -> None:
    (root / "clusters" / "trainium.yaml").write_text(text)
    with pytest.raises(ConfigError) as error:
        app_config(root)
    line = one_line(error)
    assert message in line and "trainium.yaml" in line


def test_a_c_value_that_contradicts_the_file_is_refused_in_one_line(root: Path) -> None:
    (root / "clusters" / "trainium.yaml").write_text(BLOCK_FILE)
    with pytest.raises(ConfigError) as error:
        app_config(root, {"node_count": "2"})
    assert one_line(error) == (
        "-c node_count=2 contradicts clusters/trainium.yaml (node_count: 4); allowed: edit the "
        "file, which every later deploy reads (a -c value is not stored)"
    )
    assert app_config(root, {"node_count": "4"}).node_count == 4  # agrees: harmless


def test_the_cli_takes_the_region_from_the_file(root: Path) -> None:
    (root / "clusters" / "west.yaml").write_text("region: us-west-2\n")
    assert settings_region("west", None, root) == "us-west-2"
    assert settings_region("west", "us-west-2", root) == "us-west-2"
    assert settings_region("trainium", "eu-west-1", root) is None  # no file: as before
    with pytest.raises(ClusterError) as error:
        settings_region("west", "us-east-1", root)
    assert one_line(error) == (
        "--region us-east-1 contradicts west.yaml (region: us-west-2); allowed: leave --region "
        "out, or --region us-west-2"
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (["node_count=2"], "error: -c node_count=2 contradicts clusters/{name}.yaml"),
        ([], "error: clusters/{name}.yaml: node_cout is not a setting"),
    ],
)
def test_the_real_synth_reads_the_file(settings: list[str], message: str, tmp_path: Path) -> None:
    """`npx cdk synth -c cluster=<name>` through app.py: the file is read, a contradicting -c
    (or a bad key in the file) ends the synth with the app's one line. Into a folder of its
    own: the CDK CLI refuses a second synth into a cdk.out that one is writing ("Another CLI
    (PID=…) is currently synthing to cdk.out"), and under xdist the two cases can run at once."""
    npx = shutil.which("npx")
    assert npx is not None, "npx not found: run `make setup`"
    name = f"t{os.getpid()}"
    path = REPO_ROOT / "clusters" / f"{name}.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text("node_count: 4\n" + ("node_cout: 4\n" if not settings else ""))
    try:
        context_args = [a for s in [f"cluster={name}", *settings] for a in ("-c", s)]
        out = str(tmp_path / "cdk.out")
        result = subprocess.run(
            [npx, "--no-install", "cdk", "synth", "--quiet", *context_args, "--output", out],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        path.unlink()
        with contextlib.suppress(OSError):
            path.parent.rmdir()  # only if empty: never a user's files
    output = result.stdout + result.stderr
    assert result.returncode != 0
    app_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(app_lines) == 1 and app_lines[0].startswith(message.format(name=name)), output
    assert "Traceback" not in output


def test_the_cli_reads_the_settings_of_the_checkout_it_runs_in(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed `trainium-cluster` run in a checkout (it holds cdk.json) reads that
    checkout's clusters/ folder."""
    (root / "clusters" / "west.yaml").write_text("region: us-west-2\n")
    monkeypatch.chdir(root)
    assert settings_region("west", None) == "us-west-2"
    monkeypatch.chdir(root / "clusters")  # no cdk.json here: the code's own checkout
    assert settings_region("west", None) is None
