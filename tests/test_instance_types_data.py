"""The instance table (stacks/instance_types.py) against EC2's own data about each type.

The rule-holder is EC2's DescribeInstanceTypes and DescribeInstanceTypeOfferings, as moto
(moto/ec2/resources: instance_types.json.gz and instance_type_offerings/, refreshed from the
EC2 API for each moto release) carries them offline. Where the table is right and that data is
wrong or old, KNOWN_DATA_ERRORS says so with the source; such an entry must still disagree with
the data, so it is removed when the data is mended.
"""

from __future__ import annotations

import gzip
import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import moto
import pytest

from stacks.config import DEFAULT_AZ_IDS
from stacks.instance_types import INSTANCE_TYPES, InstanceTypeSpec

RESOURCES = Path(moto.__file__).parent / "ec2" / "resources"

#: (instance type, field): why the table keeps its value against the data.
KNOWN_DATA_ERRORS: dict[tuple[str, str], str] = {
    ("trn2.48xlarge", "accelerator_memory_gib"): (
        "16 Trainium2 chips with 96 GiB of HBM each, 1.5 TiB in all (Amazon EC2 Trn2 page, "
        "https://aws.amazon.com/ec2/instance-types/trn2/, and the Neuron Trn2 architecture "
        "guide); the data moto 5.2.5 carries gives 512 GiB a chip"
    ),
}

#: The logical NeuronCore size the Neuron runtime uses by default (Neuron docs, "Logical
#: NeuronCore configuration": 2 on Trn2, 1 on Trn1): devices = physical cores / LNC.
DEFAULT_LNC = {"trainium": 1, "trainium2": 2}


@cache
def described() -> dict[str, Any]:
    with gzip.open(RESOURCES / "instance_types.json.gz") as f:
        data: dict[str, Any] = json.load(f)
    return data


@cache
def offerings() -> dict[str, dict[str, set[str]]]:
    """instance type -> region -> the zone IDs that offer it."""
    found: dict[str, dict[str, set[str]]] = {}
    for path in sorted((RESOURCES / "instance_type_offerings" / "availability-zone-id").iterdir()):
        region = path.name.removesuffix(".json.gz")
        with gzip.open(path) as f:
            for row in json.load(f):
                zones = found.setdefault(row["InstanceType"], {}).setdefault(region, set())
                zones.add(row["Location"])
    return found


def _network_gbps(performance: str) -> float:
    """ "8x 100 Gigabit" -> 800, "Up to 12.5 Gigabit" -> 12.5, "3200 Gigabit" -> 3200."""
    match = re.fullmatch(r"(?:Up to )?(?:(\d+)x )?([\d.]+) Gigabit", performance)
    assert match, performance
    return int(match.group(1) or 1) * float(match.group(2))


def from_data(spec: InstanceTypeSpec) -> dict[str, Any]:
    """What EC2's data says of each table field it covers."""
    row = described()[spec.name]
    network = row["NetworkInfo"]
    accelerators = (row.get("NeuronInfo") or {}).get("NeuronDevices") or row["GpuInfo"]["Gpus"]
    (accelerator,) = accelerators
    memory_mib = (row.get("NeuronInfo") or {}).get("TotalNeuronDeviceMemoryInMiB") or row[
        "GpuInfo"
    ]["TotalGpuMemoryInMiB"]
    (disks,) = row["InstanceStorageInfo"]["Disks"]
    cards = network["NetworkCards"]
    if "CoreInfo" in accelerator:
        cores = accelerator["Count"] * accelerator["CoreInfo"]["Count"]
        devices = cores // DEFAULT_LNC[spec.accelerator]
    else:
        devices = accelerator["Count"]
    return {
        "accelerators": accelerator["Count"],
        "devices": devices,
        "accelerator_memory_gib": memory_mib // 1024,
        "vcpus": row["VCpuInfo"]["DefaultVCpus"],
        "memory_gib": row["MemoryInfo"]["SizeInMiB"] // 1024,
        "network_gbps": _network_gbps(network["NetworkPerformance"]),
        "efa_interfaces": (network.get("EfaInfo") or {}).get("MaximumEfaInterfaces", 0),
        "efa_only_interfaces": bool(network.get("EfaSupported"))
        and all("efa-only" in card["InterfaceTypes"] for card in cards[1:]),
        "instance_store_volumes": disks["Count"],
        "instance_store_volume_gb": disks["SizeInGB"],
        "regions": set(offerings()[spec.name]),
    }


@pytest.mark.parametrize("name", list(INSTANCE_TYPES))
def test_the_table_agrees_with_ec2s_data(name: str) -> None:
    spec = INSTANCE_TYPES[name]
    disagree = {}
    for field, value in from_data(spec).items():
        ours = set(spec.regions) if field == "regions" else getattr(spec, field)
        if field == "regions" and not spec.regions:
            continue  # the GPU baselines are priced, never deployed
        if ours != value:
            disagree[field] = (ours, value)
    known = {field for (type_name, field) in KNOWN_DATA_ERRORS if type_name == name}
    assert set(disagree) == known, disagree


@pytest.mark.parametrize("region", sorted(DEFAULT_AZ_IDS))
def test_each_default_zone_offers_the_trainium_types_of_its_region(region: str) -> None:
    zone = DEFAULT_AZ_IDS[region]
    offered = [
        name for name, spec in INSTANCE_TYPES.items() if spec.is_trainium and region in spec.regions
    ]
    assert offered
    for name in offered:
        assert zone in offerings()[name][region], (name, zone, sorted(offerings()[name][region]))


def test_the_data_catches_a_wrong_value() -> None:
    """The comparison is not vacuous: a changed field shows up as a disagreement."""
    spec = INSTANCE_TYPES["trn1.32xlarge"]
    data = from_data(spec)
    assert data["efa_interfaces"] == 8 and data["instance_store_volume_gb"] == 1900
    assert data["regions"] >= {"us-east-1", "us-east-2", "us-west-2"}
    assert _network_gbps("16x 200 Gigabit") == 3200
