"""The node's Neuron software against the releases this project trains on.

    neuron_release.py check --venv /opt/aws_neuronx_venv_pytorch_2_9
    neuron_release.py versions --venv /opt/aws_neuronx_venv_pytorch_2_9
    neuron_release.py image --region us-east-1      (an operator's machine, with credentials)

Reads the five components that make a Neuron release on a node, each the way Neuron
documents it: torch-neuronx, neuronx-cc and libneuronxla from the Neuron venv's package
metadata (what `pip list` shows, here through importlib.metadata over the venv's
site-packages), the runtime from its Debian package (aws-neuronx-runtime-lib; `dpkg-query`,
the upstream version without the Debian revision: "2.31.24.0-6f1e6c0cc" is 2.31.24.0) and
the driver from the loaded module (/sys/module/neuron/version, the MODULE_VERSION of
aws-neuron-driver's neuron_module.c, which is the aws-neuronx-dkms version; `modinfo` would
read the file on disk, which after a failed reload is not the driver that runs: Neuron
runtime troubleshooting guide).

`check` prints one line and exits 0 when every component lies within the versions of the
releases marked `training` in neuron_releases.json (beside this file; its sources are listed
there), else 1 with one line naming the versions found and the supported range. `versions`
prints the components as one word (`torch-neuronx:2.9.0.2.13.26312,...`) for preflight's
software agreement. Standard library only: bootstrap runs it with the system python3.
TRAINIUM_SYS_MODULE redirects /sys/module (the tests).

`image` finds the image to pin in a region: the table's DLAMI of its image release, by name and
by the SDK version in its description (EC2 DescribeImages, as the Neuron DLAMI User Guide's
"Finding a DLAMI for a specific Neuron SDK version" does: Neuron publishes SSM parameters for
the latest DLAMI only), the newest if several; it prints `ami=ami-...` and what the image is
(boto3, imported there only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("neuron_releases.json")
#: The components in the order the lines name them, with their short names.
COMPONENTS = (
    ("torch-neuronx", "torch-neuronx"),
    ("neuronx-cc", "neuronx-cc"),
    ("libneuronxla", "libneuronxla"),
    ("aws-neuronx-runtime-lib", "runtime"),
    ("aws-neuronx-dkms", "driver"),
)
PIP_PACKAGES = ("torch-neuronx", "neuronx-cc", "libneuronxla")
RUNTIME_PACKAGE = "aws-neuronx-runtime-lib"
NONE = "none"


def load_table(path: Path = TABLE) -> dict[str, Any]:
    table: dict[str, Any] = json.loads(path.read_text())
    return table


def version_key(version: str) -> tuple[int, ...]:
    """'2.9.0.2.13.26312' -> (2, 9, 0, 2, 13, 26312); a local part (+cpu) is ignored."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+", 1)[0]))


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_versions(venv: Path) -> dict[str, str]:
    """The Neuron venv's torch-neuronx, neuronx-cc and libneuronxla versions ('none' where
    absent), from the package metadata in its site-packages."""
    paths = [str(p) for p in sorted(venv.glob("lib/python3*/site-packages"))]
    found: dict[str, str] = {}
    if paths:
        for dist in metadata.distributions(path=paths):
            name = _normalize(dist.metadata["Name"] or "")
            if name in PIP_PACKAGES and name not in found:
                found[name] = dist.version
    return {name: found.get(name, NONE) for name in PIP_PACKAGES}


def runtime_version() -> str:
    """aws-neuronx-runtime-lib's upstream version from dpkg (rpm on Amazon Linux)."""
    commands = (
        ["dpkg-query", "-W", "-f=${Version}", RUNTIME_PACKAGE],
        ["rpm", "-q", "--qf", "%{VERSION}", RUNTIME_PACKAGE],
    )
    for command in commands:
        if shutil.which(command[0]) is None:
            continue
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        version = result.stdout.strip()
        if result.returncode == 0 and version:
            # Debian: [epoch:]upstream[-revision].
            return version.split(":", 1)[-1].rsplit("-", 1)[0]
        return NONE
    return NONE


def driver_version() -> str:
    """The loaded Neuron driver's version ('none' when the module is not loaded)."""
    path = Path(os.environ.get("TRAINIUM_SYS_MODULE", "/sys/module")) / "neuron" / "version"
    try:
        return path.read_text().strip() or NONE
    except OSError:
        return NONE


def node_versions(venv: Path) -> dict[str, str]:
    return {
        **pip_versions(venv),
        RUNTIME_PACKAGE: runtime_version(),
        "aws-neuronx-dkms": driver_version(),
    }


def describe(versions: dict[str, str]) -> str:
    return ", ".join(f"{short} {versions[name]}" for name, short in COMPONENTS)


def as_word(versions: dict[str, str]) -> str:
    return ",".join(f"{short}:{versions[name]}" for name, short in COMPONENTS)


def supported_range(table: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Each component's lowest and highest version over the releases marked training."""
    rows = [row["packages"] for row in table["releases"] if row["training"]]
    return {
        name: (min((r[name] for r in rows), key=version_key),
               max((r[name] for r in rows), key=version_key))
        for name, _ in COMPONENTS
    }  # fmt: skip


def within(version: str, low: str, high: str) -> bool:
    return version_key(low) <= version_key(version) <= version_key(high)


def releases_of(versions: dict[str, str], table: dict[str, Any]) -> list[dict[str, Any]]:
    """The releases whose five versions are exactly these."""
    return [row for row in table["releases"] if row["packages"] == versions]


def verdict(versions: dict[str, str], table: dict[str, Any]) -> tuple[bool, str]:
    """Whether the node may train, and the one line that says so."""
    span = supported_range(table)
    supported = [row["neuron"] for row in table["releases"] if row["training"]]
    outside = [
        name
        for name, _ in COMPONENTS
        if versions[name] == NONE or not within(versions[name], *span[name])
    ]
    names = [row["neuron"] for row in releases_of(versions, table)]
    release = f"Neuron {' or '.join(names)}" if names else "versions of several Neuron releases"
    if not outside:
        return True, f"Neuron software within the supported range ({release}): {describe(versions)}"
    ranges = ", ".join(f"{short} {span[name][0]} to {span[name][1]}" for name, short in COMPONENTS)
    image = table["image"]
    return False, (
        f"Neuron software outside the supported range: found {describe(versions)} ({release}); "
        f"supported: Neuron {supported[0]} to {supported[-1]}, the releases that train with "
        f"PyTorch/XLA ({ranges}); launch an image of Neuron {image['neuron']} ({image['name']}, "
        "see docs/deploy.md)"
    )


def image_filters(table: dict[str, Any]) -> list[dict[str, Any]]:
    """DescribeImages filters for the table's image (botocore's ec2 model: Name, Values)."""
    image = table["image"]
    return [
        {"Name": "name", "Values": [image["name_filter"]]},
        {"Name": "description", "Values": [image["description_filter"]]},
        {"Name": "architecture", "Values": ["x86_64"]},
        {"Name": "state", "Values": ["available"]},
    ]


def find_image(ec2: Any, table: dict[str, Any], region: str) -> tuple[bool, str]:
    """The image to pin in `region` as `ami=...` and what it is, or one line saying why not."""
    image = table["image"]
    answer = ec2.describe_images(Owners=[image["owner"]], Filters=image_filters(table))
    images = sorted(answer.get("Images", []), key=lambda i: i.get("CreationDate", ""))
    if not images:
        return False, (
            f"no image of Neuron {image['neuron']} in {region}: DescribeImages found no "
            f"{image['name_filter']} owned by {image['owner']} whose description matches "
            f"{image['description_filter']}; pin an ami-... of a supported release yourself "
            "(docs/deploy.md)"
        )
    newest = images[-1]
    return True, (
        f"ami={newest['ImageId']}  # {newest.get('Name', '')}: {newest.get('Description', '')}"
    )


def image_main(region: str, table: dict[str, Any]) -> int:
    import boto3
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        ok, line = find_image(boto3.client("ec2", region_name=region), table, region)
    except (BotoCoreError, ClientError) as error:
        ok, line = False, f"could not look the image up in {region}: {error}"
    print(line)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("check", "versions", "image"))
    parser.add_argument("--venv", type=Path, help="the Neuron venv (check, versions)")
    parser.add_argument("--region", help="the region to find the image in (image)")
    args = parser.parse_args(argv)
    try:
        table = load_table()
    except (OSError, ValueError) as error:
        print(f"cannot read the Neuron release table {TABLE}: {error}")
        return 2
    if args.action == "image":
        if not args.region:
            parser.error("image needs --region, e.g. --region us-east-1")
        return image_main(args.region, table)
    if args.venv is None:
        parser.error(f"{args.action} needs --venv, the Neuron venv")
    versions = node_versions(args.venv)
    if args.action == "versions":
        print(as_word(versions))
        return 0
    ok, line = verdict(versions, table)
    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
