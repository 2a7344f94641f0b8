"""scripts/node/neuron_release.py: the table of Neuron releases and the image to pin.

What bootstrap and preflight do with a node's versions is in tests/test_bootstrap.py and
tests/test_preflight.py; here, the table itself and the `image` look-up, whose EC2 call a botocore
Stubber checks against botocore's ec2 model (request parameters and answer shapes).
"""

from __future__ import annotations

from typing import Any

import boto3
import pytest
from botocore.stub import Stubber

from scripts.node.neuron_release import (
    COMPONENTS,
    find_image,
    image_filters,
    load_table,
    main,
    verdict,
    version_key,
)

TABLE = load_table()


def test_the_table_trains_up_to_2_29_and_the_image_is_its_last_release() -> None:
    """Neuron's announcement: PyTorch/XLA training is no longer supported from Neuron 2.30.0;
    torch-neuronx 2.9 first ships in 2.27.0 (n2-manifest.json). The image to launch is the
    last release that trains."""
    training = [row["neuron"] for row in TABLE["releases"] if row["training"]]
    after = [row["neuron"] for row in TABLE["releases"] if not row["training"]]
    assert training == ["2.27.0", "2.27.1", "2.28.0", "2.28.1", "2.29.0", "2.29.1"]
    assert after == ["2.30.0", "2.31.0", "2.31.1"]
    assert TABLE["image"]["neuron"] == training[-1]
    assert TABLE["image"]["description_filter"] == f"*Neuron SDK {training[-1]}*"
    for row in TABLE["releases"]:
        assert set(row["packages"]) == {name for name, _ in COMPONENTS}
        assert row["packages"]["torch-neuronx"].startswith("2.9.0.")
    # Every component's version grows with the release: the range check's premise.
    for name, _ in COMPONENTS:
        keys = [version_key(row["packages"][name]) for row in TABLE["releases"]]
        assert keys == sorted(keys), name


def image(image_id: str, created: str) -> dict[str, Any]:
    return {
        "ImageId": image_id,
        "Name": f"Deep Learning AMI Neuron PyTorch 2.9 (Ubuntu 24.04) {created[:10]}",
        "Description": "Supported EC2 instances: Inf2, Trn1, Trn1n, Trn2, Trn3. Neuron SDK 2.29.1",
        "CreationDate": created,
        "State": "available",
        "Architecture": "x86_64",
    }


def stubbed(images: list[dict[str, Any]]) -> tuple[Any, Stubber]:
    ec2 = boto3.client(
        "ec2", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    stubber = Stubber(ec2)
    stubber.add_response(
        "describe_images",
        {"Images": images},
        {"Owners": ["amazon"], "Filters": image_filters(TABLE)},
    )
    stubber.activate()
    return ec2, stubber


def test_the_image_is_the_newest_of_the_release_in_the_region() -> None:
    ec2, stubber = stubbed(
        [
            image("ami-0aaaaaaaaaaaaaaaa", "2026-04-10T10:00:00.000Z"),
            image("ami-0bbbbbbbbbbbbbbbb", "2026-04-24T10:00:00.000Z"),
        ]
    )
    ok, line = find_image(ec2, TABLE, "us-east-1")
    stubber.assert_no_pending_responses()
    assert ok
    assert line == (
        "ami=ami-0bbbbbbbbbbbbbbbb  # Deep Learning AMI Neuron PyTorch 2.9 (Ubuntu 24.04) "
        "2026-04-24: Supported EC2 instances: Inf2, Trn1, Trn1n, Trn2, Trn3. Neuron SDK 2.29.1"
    )


def test_a_region_without_the_image_gets_one_line() -> None:
    ec2, _ = stubbed([])
    ok, line = find_image(ec2, TABLE, "ap-south-2")
    assert not ok
    assert line == (
        "no image of Neuron 2.29.1 in ap-south-2: DescribeImages found no Deep Learning AMI "
        "Neuron PyTorch 2.9 (Ubuntu 24.04)* owned by amazon whose description matches "
        "*Neuron SDK 2.29.1*; pin an ami-... of a supported release yourself (docs/deploy.md)"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["image"], "image needs --region"),
        (["check"], "check needs --venv"),
        (["versions"], "versions needs --venv"),
    ],
)
def test_missing_arguments_are_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as ended:
        main(argv)
    assert ended.value.code == 2
    assert message in capsys.readouterr().err


def test_each_component_is_checked_against_its_own_range() -> None:
    """Versions of two releases that train pass (a driver of 2.28.1 under 2.29.1's packages:
    the driver stays compatible with older runtimes, Neuron runtime troubleshooting guide);
    one component past the range fails the node, named in the line."""
    packages = {row["neuron"]: row["packages"] for row in TABLE["releases"]}
    mixed = {**packages["2.29.1"], "aws-neuronx-dkms": packages["2.28.1"]["aws-neuronx-dkms"]}
    ok, line = verdict(mixed, TABLE)
    assert ok, line
    assert line.startswith(
        "Neuron software within the supported range (versions of several Neuron releases): "
    )
    newer = {**packages["2.29.1"], "aws-neuronx-runtime-lib": "2.32.31.0"}
    ok, line = verdict(newer, TABLE)
    assert not ok
    assert "runtime 2.32.31.0, driver 2.27.4.0 (versions of several Neuron releases)" in line
    missing = {**packages["2.29.1"], "torch-neuronx": "none"}
    assert not verdict(missing, TABLE)[0]
