"""One JSON snapshot per synthesized stack of the default cluster.

A change to any template shows up as a snapshot diff to review; accept it with
`pytest tests/test_stacks_snapshots.py --snapshot-update`. Asset hashes and the software version
built from them are masked (they change with every edit of scripts/node or workload/), and so is
the SSM documents' content, which
belongs to stacks/ssm_documents/ and is compared with the YAML files in test_stacks_operations.
"""

from __future__ import annotations

import pytest
from syrupy.assertion import SnapshotAssertion
from syrupy.extensions.json import JSONSnapshotExtension

from tests.cdk_support import STACK_PARTS, synth, volatile_matcher


@pytest.fixture
def snapshot_json(snapshot: SnapshotAssertion) -> SnapshotAssertion:
    return snapshot.use_extension(JSONSnapshotExtension)


@pytest.mark.parametrize("part", STACK_PARTS)
def test_stack_template_matches_snapshot(part: str, snapshot_json: SnapshotAssertion) -> None:
    templates = synth().templates
    assert templates[part] == snapshot_json(matcher=volatile_matcher(templates))
