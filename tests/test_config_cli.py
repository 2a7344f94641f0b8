"""Bad settings as `npx cdk synth -c key=value` gives them to the app.

Each must end with one line from the app naming the key, the value and what is allowed, a
non-zero exit, no Python traceback, and no cloud assembly written. Every case runs app.py's
main in this process, with the context the CLI hands it (cdk.json's "context" block, each
`-c` over it); one case, two `-c` settings, runs the real command, which starts the app in a
Python process of its own (about 10 s on 2 cores: the rest would repeat it nine times).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aws_cdk as cdk
import pytest

import app

REPO_ROOT = Path(__file__).resolve().parent.parent

BAD_SETTINGS = [
    pytest.param(
        ["instance_type=trn9.huge"],
        "error: instance_type='trn9.huge' is not supported; allowed: trn1.2xlarge, "
        "trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge",
        id="unknown-instance-type",
    ),
    pytest.param(
        ["node_count=0"], "error: node_count=0 is out of range; allowed: 1 to 1024", id="zero-nodes"
    ),
    pytest.param(
        ["node_count=abc"],
        "error: node_count='abc' is not a whole number; allowed: 1 to 1024",
        id="nodes-not-a-number",
    ),
    pytest.param(
        ["region=us-east-1", "az_id=usw2-az4"],
        "error: az_id='usw2-az4' is not in region=us-east-1; allowed: a zone ID of us-east-1 "
        "(starting with use1-az), such as use1-az6",
        id="az-of-another-region",
    ),
    pytest.param(
        ["fsx_storage_gib=1000"],
        "error: fsx_storage_gib=1000 is not a size FSx for Lustre PERSISTENT_2 (SSD) allows; "
        "allowed: 1200 or a multiple of 2400 (2400, 4800, ...)",
        id="fsx-size",
    ),
    pytest.param(
        ["ami=ami-12345"],
        "error: ami='ami-12345' is neither neuron-release, an AMI ID nor an SSM parameter path; "
        "allowed: neuron-release (the Neuron DLAMI of scripts/node/neuron_releases.json's "
        "release, found at the first deploy), an AMI ID (ami- and 8 or 17 hex digits) or an SSM "
        "parameter path such as /aws/service/neuron/dlami/pytorch-2.9/ubuntu-24.04/latest/"
        "image_id",
        id="malformed-ami",
    ),
    pytest.param(
        ["instance_type=trn1.2xlarge", "node_count=4"],
        "error: node_count=4 is not allowed with instance_type=trn1.2xlarge: nodes talk over "
        "EFA and trn1.2xlarge has no EFA interface; allowed: node_count=1, or instance_type "
        "trn1.32xlarge, trn1n.32xlarge, trn2.48xlarge",
        id="multi-node-without-efa",
    ),
    pytest.param(
        ["internet_egress=endpoints"],
        "error: internet_egress=endpoints is not allowed with ami=neuron-release: with no "
        "internet the nodes cannot install the Lustre client or Python packages, which the "
        "stock Neuron DLAMI (ami=neuron-release, the default) lacks, and an SSM parameter may "
        "move to another image; allowed: a pinned ami-... that carries all software, or "
        "internet_egress=nat",
        id="endpoints-without-pinned-ami",
    ),
    pytest.param(
        ["capacity_reservation_id=cr-0123456789abcdef0", "az_id=use1-az6"],
        "error: capacity_reservation_id=cr-0123456789abcdef0 needs placement_group_name: an "
        "On-Demand Capacity Reservation for trn capacity is made in a cluster placement group "
        "and serves only instances launched into that group, so a new group would never use "
        "it; allowed: placement_group_name=<the reservation's placement group>",
        id="odcr-without-placement-group",
    ),
]


#: The case that runs the real command: two `-c` settings, both read.
THROUGH_THE_CLI = [case for case in BAD_SETTINGS if case.id == "az-of-another-region"]


def assert_refused(code: int, output: str, message: str, outdir: Path) -> None:
    assert code != 0
    app_lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert app_lines == [message], output
    assert "Traceback" not in output
    # The CLI may create the output folder, but nothing is synthesized into it.
    written = sorted(p.name for p in outdir.iterdir()) if outdir.exists() else []
    assert not [name for name in written if name.endswith((".json", ".template.json"))], written


@pytest.mark.parametrize(("settings", "message"), BAD_SETTINGS)
def test_bad_setting_fails_the_app_with_one_line(
    settings: list[str],
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """app.py's main as the CLI starts it: cdk.json's context with each `-c key=value` over it
    (as strings, as the CLI passes them), the cloud assembly into --output."""
    outdir = tmp_path / "cdk.out"
    context: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
    context.update(setting.split("=", 1) for setting in settings)
    app_class = cdk.App
    monkeypatch.setattr(app.cdk, "App", lambda: app_class(context=context, outdir=str(outdir)))
    code = app.main()
    captured = capsys.readouterr()
    assert_refused(code, captured.out + captured.err, message, outdir)


@pytest.mark.parametrize(("settings", "message"), THROUGH_THE_CLI)
def test_bad_setting_fails_the_synth_with_one_line(
    settings: list[str], message: str, tmp_path: Path
) -> None:
    npx = shutil.which("npx")
    assert npx is not None, "npx not found: run `make setup`"
    outdir = tmp_path / "cdk.out"
    context_args = [arg for setting in settings for arg in ("-c", setting)]
    result = subprocess.run(
        [npx, "--no-install", "cdk", "synth", "--quiet", *context_args, "--output", str(outdir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert_refused(result.returncode, result.stdout + result.stderr, message, outdir)
