"""The operator CLI's parts: one module per thing it talks to (see cluster.py for the map).

The local rehearsal, which stands in for AWS, is scripts/rehearsal; nothing here imports it.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class ClusterError(Exception):
    """A failure the CLI reports as one line (what is wrong and what to do) and exit 1."""
