"""The operator CLI's parts: SSM documents, the AWS side of `cluster.py`, the local rehearsal."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class ClusterError(Exception):
    """A failure the CLI reports as one line (what is wrong and what to do) and exit 1."""
