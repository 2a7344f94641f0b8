"""The file system's metadata configuration: created valid for every (node_count,
fsx_storage_gib), and updated in place when the cluster grows from 2 to 1,024 nodes.

The rule-holders: FSx's API model in botocore (the Iops values, the modes, "You can't
provision fewer Metadata IOPS than AUTOMATIC mode provisions", what UpdateFileSystem can
change); the FSx for Lustre user guide ("Managing metadata performance": a metadata
configuration cannot be added to a file system created without one, IOPS only go up, not
together with a storage increase; "File system metadata performance": Automatic mode's IOPS
per storage capacity, GUIDE_AUTOMATIC_IOPS); cfn-lint's resource provider schema of
AWS::FSx::FileSystem (createOnlyProperties: changing one replaces the file system).
https://docs.aws.amazon.com/fsx/latest/LustreGuide/managing-metadata-performance.html
https://docs.aws.amazon.com/fsx/latest/LustreGuide/performance.html#dne-metadata-performance
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any

import aws_cdk as cdk
import botocore.session
import pytest
from aws_cdk import aws_ec2 as ec2
from cfnlint.schema.manager import PROVIDER_SCHEMA_MANAGER

from stacks import start_limits as limits
from stacks.config import ClusterConfig
from stacks.storage import StorageStack
from tests.cdk_support import CDK_CONTEXT, Synth, only_resource, resources, synth

FSX = botocore.session.get_session().get_service_model("fsx")
#: The FSx for Lustre user guide's table, "File system metadata performance": SSD storage
#: capacity (GiB) -> Metadata IOPS in Automatic mode (1,200 -> 1,500; 2,400 -> 3,000;
#: 4,800-9,600 -> 6,000; 12,000-45,600 -> 12,000; from 48,000: 12,000 per 24,000 GiB).
GUIDE_AUTOMATIC_IOPS = {
    1_200: 1_500,
    2_400: 3_000,
    4_800: 6_000,
    9_600: 6_000,
    12_000: 12_000,
    45_600: 12_000,
    48_000: 24_000,
    72_000: 36_000,
    96_000: 48_000,
}
NODE_COUNTS = (1, 2, 64, 256, 281, 282, 512, 562, 563, 1_024)
STORAGE_GIB = (1_200, 2_400, 4_800, 9_600, 12_000, 45_600, 48_000, 96_000, 480_000)


def _plain(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", "", html))


def botocore_ssd_iops_values() -> set[int]:
    """The SSD Metadata IOPS values as botocore's fsx model words them: "valid values are 1500,
    3000, 6000, 12000, and multiples of 12000 up to a maximum of 192000"."""
    iops = FSX.shape_for("CreateFileSystemLustreMetadataConfiguration").members["Iops"]
    text = _plain(iops.documentation)
    found = re.search(
        r"For SSD file systems, valid values are ([\d, ]+), and multiples of (\d+) up to a "
        r"maximum of (\d+)",
        text,
    )
    assert found, text
    listed = {int(v) for v in found.group(1).split(",")}
    step, top = int(found.group(2)), int(found.group(3))
    assert iops.metadata == {"min": min(listed), "max": top}
    return listed | set(range(step, top + 1, step))


def test_the_iops_values_and_the_automatic_table_are_the_platforms() -> None:
    assert set(limits.FSX_METADATA_IOPS_VALUES) == botocore_ssd_iops_values()
    assert {g: limits.automatic_metadata_iops(g) for g in GUIDE_AUTOMATIC_IOPS} == (
        GUIDE_AUTOMATIC_IOPS
    )
    assert limits.automatic_metadata_iops(480_000) == 192_000  # the largest value FSx offers
    modes = FSX.shape_for("MetadataConfigurationMode").enum
    assert {limits.AUTOMATIC, limits.USER_PROVISIONED} == set(modes)
    # Iops is refused in Automatic mode ("you cannot specify a value").
    iops_doc = _plain(
        FSX.shape_for("CreateFileSystemLustreMetadataConfiguration").members["Iops"].documentation
    )
    assert "If you're using AUTOMATIC mode, you cannot specify a value" in iops_doc
    assert "You can't provision fewer Metadata IOPS than AUTOMATIC mode provisions" in iops_doc


def test_the_update_rules_are_the_ones_botocore_states() -> None:
    """update_refusals() encodes these sentences of FSx's model (UpdateFileSystem)."""
    metadata = FSX.shape_for("UpdateFileSystemLustreMetadataConfiguration").members
    iops, mode = _plain(metadata["Iops"].documentation), _plain(metadata["Mode"].documentation)
    assert "must be greater than or equal to the current number of Metadata IOPS" in iops
    assert "You can't provision fewer Metadata IOPS than AUTOMATIC mode provisions" in iops
    assert (
        "rejects a switch to AUTOMATIC mode when your current Metadata IOPS value is greater "
        "than what AUTOMATIC mode provisions"
    ) in mode
    storage = FSX.operation_model("UpdateFileSystem").input_shape.members["StorageCapacity"]
    text = _plain(storage.documentation)
    assert "PERSISTENT_2 SSD deployment types, valid values are in multiples of 2400 GiB" in text
    assert "The value must be greater than the current storage capacity" in text


@functools.cache
def _storage_templates() -> dict[tuple[int, int], dict[str, Any]]:
    """The storage stack alone (no cdk-nag: the full synths check that) for every pair of
    NODE_COUNTS and STORAGE_GIB, in one app synthesized once."""
    app = cdk.App(context=dict(CDK_CONTEXT))
    imports = cdk.Stack(app, "Imports", env=cdk.Environment(region="us-east-1"))
    subnet = ec2.Subnet.from_subnet_attributes(
        imports, "Subnet", subnet_id="subnet-0123456789abcdef0", availability_zone="us-east-1a"
    )
    group = ec2.SecurityGroup.from_security_group_id(imports, "Fsx", "sg-0123456789abcdef0")
    cdk.CfnWaitConditionHandle(imports, "Placeholder")  # a stack needs one resource
    names = {}
    for nodes in NODE_COUNTS:
        for gib in STORAGE_GIB:
            context = {**CDK_CONTEXT, "node_count": nodes, "fsx_storage_gib": gib}
            config = ClusterConfig.from_context(context.get)
            name = f"Storage{nodes}x{gib}"
            StorageStack(app, name, config=config, subnet=subnet, fsx_security_group=group)
            names[nodes, gib] = name
    assembly = app.synth()
    return {key: assembly.get_stack_by_name(name).template for key, name in names.items()}


def file_system(template: dict[str, Any]) -> dict[str, Any]:
    return dict(only_resource(template, "AWS::FSx::FileSystem")["Properties"])


def _metadata(properties: dict[str, Any]) -> dict[str, Any] | None:
    return properties["LustreConfiguration"].get("MetadataConfiguration")


def _iops(properties: dict[str, Any]) -> int:
    """The Metadata IOPS a file system with these properties has."""
    metadata = _metadata(properties)
    assert metadata is not None
    if metadata["Mode"] == limits.AUTOMATIC:
        return limits.automatic_metadata_iops(properties["StorageCapacity"])
    return int(metadata["Iops"])


def creation_refusals(properties: dict[str, Any], nodes: int) -> list[str]:
    """What is wrong with a new file system's metadata configuration for ``nodes`` nodes."""
    metadata = _metadata(properties)
    if metadata is None:
        return ["no metadata configuration: one can never be added later"]
    # "a PERSISTENT_2 deployment type" (botocore); "Enhanced metadata is available only for
    # 2.15 file systems" (the guide's note).
    refusals = []
    if properties["LustreConfiguration"]["DeploymentType"] != "PERSISTENT_2":
        refusals.append("a metadata configuration needs PERSISTENT_2")
    if properties["FileSystemTypeVersion"] != "2.15":
        refusals.append("a metadata configuration needs Lustre 2.15")
    mode = metadata.get("Mode")
    automatic = limits.automatic_metadata_iops(properties["StorageCapacity"])
    if mode not in FSX.shape_for("MetadataConfigurationMode").enum:
        refusals.append(f"Mode {mode!r} is not one of botocore's")
    elif mode == limits.AUTOMATIC and "Iops" in metadata:
        refusals.append("Iops given in AUTOMATIC mode")
    elif mode == limits.USER_PROVISIONED:
        iops = metadata.get("Iops")
        if iops not in botocore_ssd_iops_values():
            refusals.append(f"Iops {iops} is not an SSD value")
        elif iops < automatic:
            refusals.append(f"Iops {iops} below AUTOMATIC's {automatic}")
    if not refusals:
        metadata_figures = [a for a in limits.ACCESSES if "metadata" in a.service]
        slow = [
            a.name
            for a in metadata_figures
            if not a.figure(nodes, limits.RANKS_PER_NODE, _iops(properties)).within
        ]
        if slow:
            refusals.append(f"{_iops(properties)} Metadata IOPS do not serve {nodes}: {slow}")
    return refusals


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_every_size_creates_a_file_system_with_a_metadata_configuration_fsx_accepts(
    nodes: int,
) -> None:
    for gib in STORAGE_GIB:
        properties = file_system(_storage_templates()[nodes, gib])
        assert properties["StorageCapacity"] == gib
        assert creation_refusals(properties, nodes) == [], (nodes, gib)


def test_automatic_mode_wherever_its_iops_serve_the_nodes() -> None:
    for (nodes, gib), template in _storage_templates().items():
        metadata = _metadata(file_system(template))
        needed = limits.metadata_iops_needed(nodes)
        if needed <= GUIDE_AUTOMATIC_IOPS.get(gib, limits.automatic_metadata_iops(gib)):
            assert metadata == {"Mode": "AUTOMATIC"}, (nodes, gib)
        else:
            assert metadata == {"Mode": "USER_PROVISIONED", "Iops": needed}, (nodes, gib)


# -- updates -------------------------------------------------------------------------------


def _create_only() -> list[tuple[str, ...]]:
    schema = PROVIDER_SCHEMA_MANAGER.get_resource_schema("us-east-1", "AWS::FSx::FileSystem")
    pointers = schema.schema["createOnlyProperties"]
    return [tuple(p.split("/")[2:]) for p in pointers]


def _leaves(value: Any, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    if isinstance(value, dict) and not any(k.startswith("Fn::") or k == "Ref" for k in value):
        found: dict[tuple[str, ...], Any] = {}
        for key, item in value.items():
            found.update(_leaves(item, (*path, key)))
        return found
    return {path: value}


#: Which botocore shape of UpdateFileSystem can change a property at each depth.
_UPDATE_SHAPES = {
    (): "UpdateFileSystemRequest",
    ("LustreConfiguration",): "UpdateFileSystemLustreConfiguration",
    ("LustreConfiguration", "MetadataConfiguration"): "UpdateFileSystemLustreMetadataConfiguration",
}


def update_refusals(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why CloudFormation would replace the file system, or FSx refuse UpdateFileSystem, going
    from properties ``old`` to ``new``; empty: updated in place."""
    before, after = _leaves(old), _leaves(new)
    changed = {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}
    refusals = []
    for path in sorted(changed):
        if any(path[: len(c)] == c for c in _create_only()):
            refusals.append(f"{'/'.join(path)} is createOnly: the file system is replaced")
            continue
        shape = _UPDATE_SHAPES.get(path[:-1])
        if shape is None or path[-1] not in FSX.shape_for(shape).members:
            refusals.append(f"{'/'.join(path)} is not something UpdateFileSystem changes")
    old_meta, new_meta = _metadata(old), _metadata(new)
    if old_meta is None:
        return [*refusals, "no metadata configuration to update (it cannot be added)"]
    if new_meta is None:
        return [*refusals, "the metadata configuration cannot be removed"]
    old_gib, new_gib = old["StorageCapacity"], new["StorageCapacity"]
    if new_gib < old_gib:
        refusals.append(f"storage {old_gib} -> {new_gib} GiB: it only grows")
    if old_meta != new_meta:
        if new_gib != old_gib:
            refusals.append("metadata and storage capacity change in one update")
        if new_meta["Mode"] == limits.USER_PROVISIONED and new_meta["Iops"] < _iops(old):
            refusals.append(f"Iops {_iops(old)} -> {new_meta['Iops']}: only increases")
        if (
            old_meta["Mode"] == limits.USER_PROVISIONED
            and new_meta["Mode"] == limits.AUTOMATIC
            and old_meta["Iops"] > limits.automatic_metadata_iops(old_gib)
        ):
            refusals.append(f"to AUTOMATIC from {old_meta['Iops']} above its figure")
    return refusals


@pytest.mark.parametrize("gib", STORAGE_GIB)
def test_growing_from_2_to_1024_nodes_updates_the_file_system_in_place(gib: int) -> None:
    """Every step of the growth path, node count only (as docs/deploy.md says to grow)."""
    path = [n for n in NODE_COUNTS if n >= 2]
    templates = _storage_templates()
    for small, large in itertools.pairwise(path):
        old, new = file_system(templates[small, gib]), file_system(templates[large, gib])
        assert update_refusals(old, new) == [], (small, large, gib)
    # The whole way in one deploy, too.
    assert update_refusals(file_system(templates[2, gib]), file_system(templates[1024, gib])) == []


@pytest.mark.parametrize("nodes", NODE_COUNTS)
def test_storage_grows_in_place_while_the_metadata_mode_is_automatic(nodes: int) -> None:
    """Automatic mode follows the storage capacity on its own, so a storage increase leaves its
    metadata configuration alone. A provisioned one that more storage would turn AUTOMATIC
    cannot change together with the storage: docs/deploy.md says to grow storage first."""
    templates = _storage_templates()
    for small, large in itertools.pairwise(STORAGE_GIB):
        old, new = file_system(templates[nodes, small]), file_system(templates[nodes, large])
        refusals = update_refusals(old, new)
        if _metadata(old) == {"Mode": "AUTOMATIC"} or _metadata(old) == _metadata(new):
            assert _metadata(old) == _metadata(new)
            assert refusals == [], (nodes, small, large)
        else:
            assert _metadata(new) == {"Mode": "AUTOMATIC"}
            assert "metadata and storage capacity change in one update" in refusals


def test_shrinking_a_grown_cluster_is_refused_by_fsx() -> None:
    """Metadata IOPS never go down: a cluster grown past 562 nodes at 1,200 GiB keeps its
    6,000 (docs/deploy.md); a stack update back to 2 nodes would fail and roll back."""
    templates = _storage_templates()
    refusals = update_refusals(file_system(templates[1024, 1200]), file_system(templates[2, 1200]))
    assert refusals == ["to AUTOMATIC from 6000 above its figure"]


@pytest.fixture(scope="module")
def large() -> Synth:
    return synth(node_count="1024")


def test_the_deployed_cluster_grows_from_2_to_1024_nodes_without_replacing_storage(
    large: Synth,
) -> None:
    """The whole app as `cdk deploy` synthesizes it: the file system keeps its logical ID and
    every createOnly property; the rest is what UpdateFileSystem changes, as FSx allows."""
    small_template, large_template = synth().templates["storage"], large.templates["storage"]
    (small_id,) = resources(small_template, "AWS::FSx::FileSystem")
    (large_id,) = resources(large_template, "AWS::FSx::FileSystem")
    assert small_id == large_id
    old, new = file_system(small_template), file_system(large_template)
    assert _metadata(old) == {"Mode": "AUTOMATIC"}
    assert _metadata(new) == {"Mode": "USER_PROVISIONED", "Iops": 6000}
    assert update_refusals(old, new) == []
    for path in _create_only():
        assert _leaves(old).get(path) == _leaves(new).get(path), path
    # Nothing else in the storage stack changes with the node count.
    for kind in ("AWS::S3::Bucket", "AWS::FSx::DataRepositoryAssociation", "AWS::KMS::Key"):
        assert resources(small_template, kind) == resources(large_template, kind), kind
