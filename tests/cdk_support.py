"""Synthesizing the cluster in-process for the stack tests, once per configuration.

A synth with both cdk-nag packs takes 10+ seconds, so each configuration is synthesized once per
test session and shared by every test module that asks for it. The app gets the same context as
`npx cdk synth` (cdk.json), so what the tests see is what the CLI deploys.
"""

from __future__ import annotations

import atexit
import functools
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk.assertions import Template

from stacks.cluster import Cluster, build_cluster
from stacks.config import ClusterConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
CDK_CONTEXT: dict[str, Any] = json.loads((REPO_ROOT / "cdk.json").read_text())["context"]
STACK_PARTS = ("network", "storage", "operations", "compute")

_OUT_ROOT = Path(tempfile.mkdtemp(prefix="cdk-synth-"))
atexit.register(shutil.rmtree, _OUT_ROOT, ignore_errors=True)


@dataclass(frozen=True)
class Synth:
    """One synthesized cluster: its config, stacks, template files and parsed templates."""

    config: ClusterConfig
    cluster: Cluster
    outdir: Path
    templates: dict[str, dict[str, Any]]  # by stack part: "network", "storage", ...

    def template(self, part: str) -> Template:
        return Template.from_json(self.templates[part])

    def template_paths(self) -> list[Path]:
        return [
            self.outdir / f"{self.config.cluster_name}-{part}.template.json" for part in STACK_PARTS
        ]


def synth(**overrides: Any) -> Synth:
    """The cluster synthesized with cdk.json's context plus `overrides` (cached per overrides).
    An override that repeats cdk.json's value (`node_count="2"` where cdk.json says 2) is
    dropped from the cache key: the same settings are synthesized once."""
    return _synth(synth_key(**overrides))


def synth_key(**overrides: Any) -> tuple[tuple[str, Any], ...]:
    changed = {k: v for k, v in overrides.items() if k not in CDK_CONTEXT or not _same(k, v)}
    return tuple(sorted(changed.items()))


def _same(key: str, value: Any) -> bool:
    """Whether `value` (a `-c` string or a JSON value) is what cdk.json already sets."""
    default = CDK_CONTEXT[key]
    if isinstance(default, bool):
        return isinstance(value, bool | str) and str(value).lower() == str(default).lower()
    return str(value) == str(default)


@functools.cache
def _synth(overrides: tuple[tuple[str, Any], ...]) -> Synth:
    outdir = _OUT_ROOT / f"synth-{len(list(_OUT_ROOT.iterdir()))}"
    app = cdk.App(context={**CDK_CONTEXT, **dict(overrides)}, outdir=str(outdir))
    config = ClusterConfig.from_context(app.node.try_get_context, app.node.get_all_context())
    cluster = build_cluster(app, config)
    assembly = app.synth()  # runs both cdk-nag packs; raises on an unacknowledged finding
    templates = {
        part: assembly.get_stack_by_name(f"{config.cluster_name}-{part}").template
        for part in STACK_PARTS
    }
    return Synth(config=config, cluster=cluster, outdir=outdir, templates=templates)


def cfn_lint(paths: list[Path], *, region: str) -> list[dict[str, Any]]:
    """cfn-lint's findings (all levels) for templates deployed to `region`, as parsed JSON."""
    cfn_lint_bin = Path(sys.executable).parent / "cfn-lint"
    result = subprocess.run(
        [str(cfn_lint_bin), "--format", "json", "--regions", region, "--", *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # Exit status is a bit mask: 2 errors, 4 warnings, 8 informational; 1 means it crashed.
    assert result.returncode & 1 == 0, result.stderr
    findings: list[dict[str, Any]] = json.loads(result.stdout or "[]")
    return findings


@functools.cache
def lint_every_configuration() -> dict[str, list[dict[str, Any]]]:
    """cfn-lint's findings for every configuration's templates (matrix_settings), by file:
    one cfn-lint process a region (its start-up costs seconds), each finding named by its
    file. Every test that lints a template of these configurations reads it from here."""
    by_region: dict[str, list[Path]] = {}
    for settings in matrix_settings().values():
        synthesized = synth(**settings)
        by_region.setdefault(synthesized.config.region, []).extend(synthesized.template_paths())
    findings: dict[str, list[dict[str, Any]]] = {}
    for region, paths in by_region.items():
        for finding in cfn_lint(paths, region=region):
            findings.setdefault(finding["Filename"], []).append(finding)
    return findings


def resources(template: dict[str, Any], resource_type: str) -> dict[str, dict[str, Any]]:
    """The resources of one type in a template, by logical ID."""
    return {
        logical_id: resource
        for logical_id, resource in template["Resources"].items()
        if resource["Type"] == resource_type
    }


def only_resource(template: dict[str, Any], resource_type: str) -> dict[str, Any]:
    found = list(resources(template, resource_type).values())
    assert len(found) == 1, f"expected one {resource_type}, found {len(found)}"
    return found[0]


def machine_of(template: dict[str, Any], construct: str = "JobSupervisor") -> dict[str, Any]:
    """The state machine of one construct in the operations template (JobSupervisor, the job
    supervisor; JobDispatcher, the job queue's dispatcher)."""
    return template["Resources"][machine_id(template, construct)]  # type: ignore[no-any-return]


def machine_id(template: dict[str, Any], construct: str = "JobSupervisor") -> str:
    (found,) = [
        k
        for k in resources(template, "AWS::StepFunctions::StateMachine")
        if k.startswith(f"{construct}StateMachine")
    ]
    return found


def flatten(value: Any) -> str:
    """A CloudFormation value as text, intrinsic functions rendered as JSON (for searching)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and set(value) == {"Fn::Join"}:
        separator, parts = value["Fn::Join"]
        return separator.join(flatten(part) for part in parts)
    if isinstance(value, dict) and set(value) == {"Fn::Base64"}:
        return flatten(value["Fn::Base64"])
    return json.dumps(value, sort_keys=True)


_HASH = re.compile(r"[0-9a-f]{64}")


def volatile_matcher(templates: dict[str, dict[str, Any]]) -> Any:
    """syrupy matcher for one synth's templates: asset hashes (and the S3 keys built from them)
    and the software version (16 hex digits derived from them, stacks.compute.software_version,
    the compute stack's SoftwareVersion output) change with every edit of scripts/node,
    workload/ or aws-cdk-lib's bundled handlers; mask them, and nothing else. The SSM
    documents' content is owned and tested with stacks/ssm_documents/; only its origin is
    snapshotted."""
    version = templates["compute"]["Outputs"]["SoftwareVersion"]["Value"]
    assert re.fullmatch(r"[0-9a-f]{16}", version), version

    def mask(*, data: Any, path: Any) -> Any:
        if isinstance(data, str):
            return _HASH.sub("<asset-hash>", data).replace(version, "<software-version>")
        keys = [str(name) for name, _ in path]
        if (
            len(keys) >= 3
            and keys[-2:] == ["Properties", "Content"]
            and keys[-3].endswith("Document")
        ):
            return f"<stacks/ssm_documents/{keys[-3].removesuffix('Document')}.yaml>"
        return data

    return mask


#: One synth that flips every switch away from its default, shared by the stack tests: no NAT
#: (so a pinned AMI), data not retained, a Capacity Block.
ALTERNATIVE_SETTINGS: dict[str, str] = {
    "cluster_name": "research",
    "region": "us-west-2",
    "az_id": "usw2-az4",
    "internet_egress": "endpoints",
    "retain_data": "false",
    "capacity_reservation_id": "cr-0123456789abcdef0",
    "capacity_block": "true",
    "capacity_block_start": "2026-12-01T11:30:00Z",
    "capacity_block_end": "2026-12-08T11:30:00Z",
    "capacity_block_drain_minutes": "90",
    "ami": "ami-0123456789abcdef0",
    "alarm_email": "ops@example.com",
    "node_count": "4",
}

#: An On-Demand Capacity Reservation made in an existing cluster placement group.
ODCR_SETTINGS: dict[str, str] = {
    "instance_type": "trn1n.32xlarge",
    "az_id": "use1-az6",
    "capacity_reservation_id": "cr-0fedcba9876543210",
    "placement_group_name": "trn1n-odcr-group",
    "node_count": "8",
}


#: A cluster deployed again after a destroy: it adopts the data and checkpoint buckets the
#: earlier cluster of the same name kept (names as CloudFormation generates them).
ADOPTED_BUCKETS_SETTINGS: dict[str, str] = {
    "data_bucket_name": "trainium-storage-bucketsdatabucket44451dc7-1a2b3c4d5e6f",
    "checkpoint_bucket_name": "trainium-storage-bucketscheckpointbucket6455f5c4-6f5e4d3c2b1a",
}


def alternative() -> Synth:
    return synth(**ALTERNATIVE_SETTINGS)


def odcr() -> Synth:
    return synth(**ODCR_SETTINGS)


def matrix_settings() -> dict[str, dict[str, str]]:
    """Every configuration the stack tests synthesize, by name, with the same overrides (and so
    the same cached synth) as tests/test_stacks_matrix.py: each cluster instance type in the
    first region that offers it, the default, the alternative and ODCR modes, a cluster that
    adopts kept buckets, the largest."""
    from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES

    settings: dict[str, dict[str, str]] = {
        "default": {},
        "capacity-block-endpoints": ALTERNATIVE_SETTINGS,
        "odcr-placement-group": ODCR_SETTINGS,
        "adopted-buckets": ADOPTED_BUCKETS_SETTINGS,
    }
    for name in CLUSTER_INSTANCE_TYPES:
        spec = INSTANCE_TYPES[name]
        case = {
            "instance_type": name,
            "node_count": "2" if spec.supports_multi_node else "1",
            "region": spec.regions[0],
        }
        # The case that cdk.json's defaults already are is the default synth, made once.
        is_default = all(str(CDK_CONTEXT[key]) == value for key, value in case.items())
        settings[name] = {} if is_default else case
    settings["trn1-1024"] = {"node_count": "1024"}
    settings["trn2-1024"] = {
        "node_count": "1024",
        "instance_type": "trn2.48xlarge",
        "region": "us-east-2",
        "az_id": "use2-az3",
    }
    return settings
