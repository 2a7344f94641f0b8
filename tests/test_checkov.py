"""checkov, the scanner users run on CloudFormation templates, finds nothing without a reason.

Every finding the project acknowledges for cdk-nag that checkov makes too carries the same
reason in checkov's own skip metadata (stacks/nag.py, CHECKOV_EQUIVALENTS): checkov reads
`Metadata.checkov.skip` (checkov/cloudformation/context_parser.py, collect_skip_comments).
checkov runs from its own virtual environment (.venv-checkov, `make setup`), offline
(--skip-download).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.cdk_support import REPO_ROOT, matrix_settings, synth

CHECKOV = REPO_ROOT / ".venv-checkov" / "bin" / "checkov"
#: The default cluster, the alternative settings (a Capacity Block, data not retained: the
#: buckets' auto-delete handler) and the largest cluster.
CONFIGURATIONS = ("default", "capacity-block-endpoints", "trn2-1024")


def _templates() -> dict[str, dict[str, Any]]:
    """Every template of every configuration, by a file name that says which."""
    settings = matrix_settings()
    found = {}
    for name in CONFIGURATIONS:
        for part, template in synth(**settings[name]).templates.items():
            found[f"{name}-{part}.template.json"] = template
    return found


def _checkov(templates: dict[str, dict[str, Any]], directory: Path) -> list[dict[str, Any]]:
    """checkov's CloudFormation report on these templates, one process for all of them."""
    assert CHECKOV.exists(), f"{CHECKOV} is missing: run `make setup`"
    directory.mkdir()
    for file_name, template in templates.items():
        (directory / file_name).write_text(json.dumps(template))
    result = subprocess.run(
        [
            str(CHECKOV),
            *("--directory", str(directory), "--framework", "cloudformation"),
            *("--skip-download", "--output", "json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # Exit status 1 means failed checks; anything else but 0 is checkov's own error.
    assert result.returncode in (0, 1), result.stderr[-2000:]
    report = json.loads(result.stdout)
    reports = report if isinstance(report, list) else [report]
    (cloudformation,) = [r for r in reports if r["check_type"] == "cloudformation"]
    assert cloudformation["summary"]["resource_count"] > 100, cloudformation["summary"]
    assert cloudformation["summary"]["parsing_errors"] == 0
    results: dict[str, list[dict[str, Any]]] = cloudformation["results"]
    return [dict(r, outcome=kind) for kind, rows in results.items() for r in rows]


def _findings(rows: list[dict[str, Any]], outcome: str) -> set[tuple[str, str, str]]:
    return {
        (Path(r["file_path"]).name, r["resource"].split(".", 1)[1], r["check_id"])
        for r in rows
        if r["outcome"] == outcome
    }


@pytest.fixture(scope="module")
def templates() -> dict[str, dict[str, Any]]:
    return _templates()


@pytest.fixture(scope="module")
def report(
    templates: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    return _checkov(templates, tmp_path_factory.mktemp("checkov") / "templates")


@pytest.mark.slow
def test_checkov_finds_nothing_without_a_stated_reason(
    templates: dict[str, dict[str, Any]], report: list[dict[str, Any]]
) -> None:
    rows = report
    assert _findings(rows, "failed_checks") == set()
    skipped = [r for r in rows if r["outcome"] == "skipped_checks"]
    assert skipped, "nothing is skipped: the skip metadata did not reach the templates"
    for row in skipped:
        file_name = Path(row["file_path"]).name
        logical_id = row["resource"].split(".", 1)[1]
        reasons = {
            rule["reason"]
            for rule in templates[file_name]["Resources"][logical_id]["Metadata"]["cdk_nag"][
                "rules_to_suppress"
            ]
        }
        # The reason checkov prints is one the cdk-nag acknowledgment gives.
        assert row["check_result"]["suppress_comment"] in reasons, row["check_id"]


@pytest.mark.slow
def test_every_checkov_skip_stands_for_a_finding(
    templates: dict[str, dict[str, Any]], report: list[dict[str, Any]], tmp_path: Path
) -> None:
    """Without the skip metadata, checkov fails exactly what the skips cover: no skip is stale,
    and the skips are what keeps the templates clean."""
    stripped = copy.deepcopy(templates)
    for template in stripped.values():
        for resource in template["Resources"].values():
            resource.get("Metadata", {}).pop("checkov", None)
    skipped = _findings(report, "skipped_checks")
    failed = _findings(_checkov(stripped, tmp_path / "without"), "failed_checks")
    assert failed == skipped
    assert {check for _, _, check in failed} == {
        "CKV_AWS_18", "CKV_AWS_21", "CKV_AWS_115", "CKV_AWS_116", "CKV_AWS_117",
    }  # fmt: skip
