"""The SSM Command documents in stacks/ssm_documents/, as the CLI sees them.

The operations stack deploys these files; the CLI reads the same files to check parameter
values against each document's allowedPattern (and minChars/maxChars) before sending
anything, so a bad value gets a one-line error here instead of a failed invocation on every
node. The agent matches with Go's regexp `MatchString`, unanchored (see
scripts/rehearsal/ssm_agent/): `re.search` is the same call for the patterns the documents
use, every one of which is anchored and checked against Go by tests/test_ssm_documents.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from scripts.cluster_lib import REPO_ROOT, ClusterError

DOCUMENTS_DIR = REPO_ROOT / "stacks" / "ssm_documents"
DOCUMENT_NAMES = ("RunTraining", "Preflight", "Precompile", "StopTraining")
#: What the CLI calls each parameter it takes from its own options, in its one-line errors.
CLI_LABELS = {
    "JobId": "--job-id",
    "MasterPort": "--master-port",
    "NprocPerNode": "--nproc-per-node",
    "Steps": "--steps",
    "TrainArgs": "train arguments",
    "CodeSnapshot": "the code snapshot's sha256",
    "EntryPoint": "--entry/--module",
    "DataPath": "--data",
}


@dataclass(frozen=True)
class Parameter:
    name: str
    description: str
    allowed_pattern: str
    default: str | None
    min_chars: int | None = None
    max_chars: int | None = None

    def check(self, value: str, label: str) -> None:
        """Raises ClusterError unless value passes the parameter's allowedPattern and length."""
        if self.max_chars is not None and len(value) > self.max_chars:
            raise ClusterError(
                f"{label} is {len(value)} characters long: at most {self.max_chars} are allowed"
            )
        if self.min_chars is not None and len(value) < self.min_chars:
            raise ClusterError(
                f"{label} {value!r} is too short: at least {self.min_chars} characters"
            )
        if "\n" in value or "\r" in value or not re.search(self.allowed_pattern, value):
            raise ClusterError(f"{label} {value!r} is not allowed: {self.description}")


@dataclass(frozen=True)
class Document:
    name: str
    path: Path
    content: dict[str, Any]
    parameters: dict[str, Parameter]

    @property
    def run_command(self) -> list[str]:
        commands: list[str] = self.content["mainSteps"][0]["inputs"]["runCommand"]
        return commands

    @property
    def step_name(self) -> str:
        name: str = self.content["mainSteps"][0]["name"]
        return name

    def check(self, values: dict[str, str], labels: dict[str, str] | None = None) -> None:
        labels = labels or {}
        unknown = set(values) - set(self.parameters)
        if unknown:
            raise ClusterError(f"{self.name} has no parameter {', '.join(sorted(unknown))}")
        for name, value in values.items():
            self.parameters[name].check(value, labels.get(name, name))


@cache
def load(name: str) -> Document:
    path = DOCUMENTS_DIR / f"{name}.yaml"
    content = yaml.safe_load(path.read_text())
    parameters = {
        key: Parameter(
            name=key,
            description=" ".join(str(spec.get("description", "")).split()),
            allowed_pattern=spec["allowedPattern"],
            default=spec.get("default"),
            min_chars=int(spec["minChars"]) if "minChars" in spec else None,
            max_chars=int(spec["maxChars"]) if "maxChars" in spec else None,
        )
        for key, spec in content.get("parameters", {}).items()
    }
    return Document(name=name, path=path, content=content, parameters=parameters)


def job_parameters(
    job_id: str, train_args: list[str], *, master_port: str, nproc_per_node: str, **extra: str
) -> dict[str, str]:
    """The parameters a job's documents (RunTraining, Precompile) share, `extra` before
    TrainArgs."""
    return {
        "JobId": job_id,
        "MasterPort": master_port,
        "NprocPerNode": nproc_per_node,
        **extra,
        "TrainArgs": join_train_args(train_args),
    }


def join_train_args(args: list[str]) -> str:
    """Joins train.py arguments into the TrainArgs parameter (one space-separated string)."""
    for arg in args:
        if not arg or any(ch.isspace() for ch in arg):
            raise ClusterError(
                f"train argument {arg!r} is empty or contains whitespace: SSM passes the "
                "arguments as one space-separated string"
            )
    return " ".join(args)
