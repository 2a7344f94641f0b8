"""The commands SSM has run with the stack's documents, as SSM ListCommands lists them.

A command sent to more than 50 nodes is several commands, one per batch (commands.py), that
share a comment: `<comment> #<token> part i/k`. An *attempt* is those batches together; a job's
latest attempt is what `logs`, `jobs` and `train` read. `roll` and `stop` look for commands that
still run.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import Patience, aws_errors
from scripts.cluster_lib.outputs import Stack

#: Command (not invocation) statuses of SSM ListCommands that mean it still runs somewhere.
ACTIVE_COMMAND = {"Pending", "InProgress", "Cancelling"}
#: The documents whose commands `status` lists.
LISTED_DOCUMENTS = ("RunTraining", "Preflight", "Precompile", "StopTraining")


def attempt_of(command: dict[str, Any]) -> str:
    """The comment a command's batches share (the comment but for the ` part i/k` suffix)."""
    return str(command.get("Comment", "")).rsplit(" part ", 1)[0]


def newest(commands: list[dict[str, Any]]) -> dict[str, Any]:
    """The command SSM received last."""
    oldest = datetime.min.replace(tzinfo=UTC)
    return max(commands, key=lambda c: c.get("RequestedDateTime") or oldest)


def latest_attempt(mine: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest command and the other batches sent with it (same comment, token included,
    but for the ` part i/k` suffix)."""
    last = newest(mine)
    if " part " not in str(last.get("Comment", "")):
        return [last]
    return [c for c in mine if attempt_of(c) == attempt_of(last)]


class CommandHistory:
    """The stack's commands: the ones still running, the recent ones, each job's latest."""

    def __init__(self, ssm: Any, stack: Stack, patience: Patience) -> None:
        self.ssm = ssm
        self.stack = stack
        self.patience = patience

    def active_commands(
        self,
        *,
        job_id: str | None = None,
        documents: tuple[str, ...] = ("RunTraining", "Precompile"),
    ) -> list[dict[str, Any]]:
        """RunTraining and Precompile commands SSM still runs (of job_id, when given). An
        invocation runs for at most 48 hours, so only the last 49 hours are searched."""
        outputs = self.stack.outputs()
        since = (datetime.now(UTC) - timedelta(hours=49)).strftime("%Y-%m-%dT%H:%M:%SZ")
        found: list[dict[str, Any]] = []
        with aws_errors("listing running commands"):
            paginator = self.ssm.get_paginator("list_commands")
            for name in documents:
                for page in paginator.paginate(
                    Filters=[
                        {"key": "DocumentName", "value": outputs.document(name)},
                        {"key": "InvokedAfter", "value": since},
                    ]
                ):
                    for command in page["Commands"]:
                        if command.get("Status") not in ACTIVE_COMMAND:
                            continue
                        job = command.get("Parameters", {}).get("JobId", [""])[0]
                        if job_id is None or job == job_id:
                            found.append({**command, "Document": name, "JobId": job})
        return found

    def recent_commands(self, limit: int = 8) -> list[dict[str, Any]]:
        """The newest `limit` commands of the stack's documents, newest first."""
        outputs = self.stack.outputs()
        commands: list[dict[str, Any]] = []
        with aws_errors("listing recent commands"):
            for name in LISTED_DOCUMENTS:
                response = self.ssm.list_commands(
                    Filters=[{"key": "DocumentName", "value": outputs.document(name)}],
                    MaxResults=limit,
                )
                for command in response["Commands"]:
                    commands.append({**command, "Document": name})
        commands.sort(
            key=lambda c: c.get("RequestedDateTime") or datetime.min.replace(tzinfo=UTC),
            reverse=True,
        )
        return commands[:limit]

    def commands(self, document: str) -> list[dict[str, Any]]:
        """Every command of one of the stack's documents (ListCommands, all pages)."""
        return self._commands(document)

    def command(self, command_id: str) -> dict[str, Any]:
        """One command as ListCommands gives it, with `Document`: the name of the stack's
        document it ran ("RunTraining", ...), or its own name for another document."""
        with aws_errors("reading the command"):
            found = self.ssm.list_commands(CommandId=command_id)["Commands"]
        if not found:
            raise ClusterError(f"no command {command_id} found")
        outputs = self.stack.outputs()
        names = {outputs.document(n): n for n in LISTED_DOCUMENTS}
        return {**found[0], "Document": names.get(found[0].get("DocumentName", ""), "")}

    def _commands(self, document: str) -> list[dict[str, Any]]:
        with aws_errors("listing commands"):
            paginator = self.ssm.get_paginator("list_commands")
            return [
                command
                for page in paginator.paginate(
                    Filters=[
                        {"key": "DocumentName", "value": self.stack.outputs().document(document)}
                    ]
                )
                for command in page["Commands"]
            ]

    def latest_command_details(
        self, job_id: str, document: str = "RunTraining"
    ) -> list[dict[str, Any]]:
        """The commands (every batch) of the job's latest attempt, as ListCommands gives them."""
        mine = [
            c for c in self._commands(document) if c.get("Parameters", {}).get("JobId") == [job_id]
        ]
        if not mine:
            raise ClusterError(f"no {document} command found for job {job_id}")
        return latest_attempt(mine)

    def latest_commands(self, job_id: str, document: str = "RunTraining") -> list[str]:
        """The command IDs of the job's latest attempt (every batch of it)."""
        return [c["CommandId"] for c in self.latest_command_details(job_id, document)]

    def latest_commands_by_job(self, document: str = "RunTraining") -> dict[str, dict[str, Any]]:
        """Each job's newest command (the first batch of its latest attempt)."""
        by_job: dict[str, list[dict[str, Any]]] = {}
        for command in self._commands(document):
            job = command.get("Parameters", {}).get("JobId", [""])[0]
            by_job.setdefault(job, []).append(command)
        return {job: latest_attempt(mine)[0] for job, mine in by_job.items() if job}

    def commands_ended(self, command_ids: list[str]) -> dict[str, str] | None:
        """Each command's status when all have ended, else None (also on a transient error)."""
        statuses: dict[str, str] = {}
        for command_id in command_ids:
            response = self.patience.patiently(
                "reading the command's status",
                functools.partial(self.ssm.list_commands, CommandId=command_id),
            )
            if response is None or not response["Commands"]:
                return None
            statuses[command_id] = response["Commands"][0].get("Status", "")
        if all(status not in ACTIVE_COMMAND for status in statuses.values()):
            return statuses
        return None
