"""The job supervisor's executions, as Step Functions lists and describes them.

Each job runs as executions of the operations stack's state machine (stacks/supervisor.py,
output `JobStateMachineArn`), named after the job and the time it started. An execution that
nears its history limit hands the job over to a new one (ContinuedAs in its output,
ContinuedFrom in the new one's input): one job, a chain of executions. Read here: the running
executions, an execution's history, the chains of the newest jobs, and the counters (attempts,
retries, legs) an execution carries.
"""

from __future__ import annotations

import contextlib
import json
import re
from datetime import UTC, datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import aws_errors
from scripts.cluster_lib.outputs import Stack

#: The operations stack's output naming the state machine.
JOB_STATE_MACHINE_OUTPUT = "JobStateMachineArn"
#: Execution names are the job ID and the start time. StartExecution's name: "Length
#: Constraints: Minimum length of 1. Maximum length of 80." (Step Functions API reference);
#: a 64-character job ID, "-" and the 15-character stamp make exactly 80. Names stay unique
#: for 90 days per state machine, so a job resumed later gets a new execution.
EXECUTION_STAMP = "%Y%m%d-%H%M%S"
EXECUTION_NAME = re.compile(r"^(?P<job>.+)-[0-9]{8}-[0-9]{6}$")
#: `jobs` reads at most this many executions to put the newest jobs' chains together.
MAX_LISTED = 1000
#: Errors that leave a field of `jobs` at "-" (AWS cannot tell it; the listing goes on).
UNKNOWN_FIELD = (ClientError, BotoCoreError, ClusterError, KeyError, ValueError)

#: An execution as ListExecutions lists it, and as DescribeExecution describes it.
Pair = tuple[dict[str, Any], dict[str, Any]]


def execution_name(job_id: str, now: datetime) -> str:
    return f"{job_id}-{now.astimezone(UTC):{EXECUTION_STAMP}}"


def job_of(name: str) -> str:
    """The job ID of an execution name (one started by hand may be the job ID itself)."""
    match = EXECUTION_NAME.match(name)
    return match.group("job") if match else name


def _json_field(text: str | None, key: str) -> str | None:
    """`key` of the JSON object `text` (an execution's input or output), if set."""
    try:
        found = json.loads(text or "{}")
    except ValueError:
        return None
    value = found.get(key) if isinstance(found, dict) else None
    return str(value) if value else None


def continued_from(described: dict[str, Any]) -> str | None:
    """The ARN of the execution that handed its job over to this one, if one did."""
    return _json_field(described.get("input"), "ContinuedFrom")


def continued_as(described: dict[str, Any]) -> str | None:
    """The name of the execution a SUCCEEDED execution handed its job over to, if it did."""
    if described.get("status") != "SUCCEEDED":
        return None
    return _json_field(described.get("output"), "ContinuedAs")


class Executions:
    """The state machine's executions."""

    def __init__(self, sfn: Any, stack: Stack) -> None:
        self.sfn = sfn
        self.stack = stack

    @property
    def state_machine(self) -> str:
        outputs = self.stack.outputs()
        arn = outputs.values.get(JOB_STATE_MACHINE_OUTPUT)
        if not arn:
            raise ClusterError(
                f"stack {outputs.stack_name} has no {JOB_STATE_MACHINE_OUTPUT} output (the job "
                "supervisor): redeploy the operations stack from this version of the project"
            )
        return arn

    def running(self, job_id: str | None = None) -> list[dict[str, Any]]:
        """The state machine's running executions (of `job_id`), newest first."""
        found: list[dict[str, Any]] = []
        with aws_errors("listing the cluster's jobs"):
            for page in self.sfn.get_paginator("list_executions").paginate(
                stateMachineArn=self.state_machine, statusFilter="RUNNING"
            ):
                found.extend(page["executions"])
        return [e for e in found if job_id is None or job_of(e["name"]) == job_id]

    def of_job(self, job_id: str) -> dict[str, Any] | None:
        """The newest execution of `job_id` in any status (ListExecutions, newest first), or
        None; at most MAX_LISTED executions are read (Step Functions keeps a closed execution
        for 90 days: quotas, execution history retention)."""
        read = 0
        with aws_errors("listing the cluster's jobs"):
            pages = self.sfn.get_paginator("list_executions").paginate(
                stateMachineArn=self.state_machine
            )
            for page in pages:
                for execution in page["executions"]:
                    if job_of(execution["name"]) == job_id:
                        return dict(execution)
                    read += 1
                    if read >= MAX_LISTED:
                        return None
        return None

    def history(self, arn: str, after: int = 0, *, newest: int | None = None) -> list[dict]:
        """The execution's events with an ID above `after`, oldest first. They are asked for
        newest first (reverseOrder), so that following a long execution costs one call per
        poll; the order the pages come in is not relied on (the IDs are). `newest` keeps only
        that many of the newest."""
        found: dict[int, dict[str, Any]] = {}
        kwargs: dict[str, Any] = {"executionArn": arn, "reverseOrder": True, "maxResults": 100}
        while True:
            page = self.sfn.get_execution_history(**kwargs)
            reached = False
            for event in page["events"]:
                if event["id"] <= after:
                    reached = True
                else:
                    found[event["id"]] = event
            if reached or "nextToken" not in page or (newest and len(found) >= newest):
                break
            kwargs["nextToken"] = page["nextToken"]
        events = [found[i] for i in sorted(found)]
        return events[-newest:] if newest else events

    def chains(self, limit: int = 10) -> list[list[Pair]]:
        """The newest `limit` jobs, each the chain of executions that ran it, newest first
        (an execution that handed its job over, ContinuedAs, joins the chain of the one it
        started), as (listed, described) pairs. At most MAX_LISTED executions are read."""
        chains: list[list[Pair]] = []
        # The chain of an execution that continued another, by its name, until that other
        # one is read.
        waiting: dict[str, list[Pair]] = {}
        read = 0
        with aws_errors("listing the cluster's jobs"):
            pages = self.sfn.get_paginator("list_executions").paginate(
                stateMachineArn=self.state_machine
            )
            for page in pages:
                for execution in page["executions"]:
                    if (len(chains) >= limit and not waiting) or read >= MAX_LISTED:
                        return chains
                    read += 1
                    described: dict[str, Any] = {}
                    with contextlib.suppress(*UNKNOWN_FIELD):
                        arn = execution["executionArn"]
                        described = self.sfn.describe_execution(executionArn=arn)
                    successor = continued_as(described)
                    chain = waiting.pop(successor, None) if successor else None
                    if chain is None:
                        if len(chains) >= limit:
                            continue  # an older job's execution
                        chain = []
                        chains.append(chain)
                    chain.append((execution, described))
                    if continued_from(described):
                        waiting[execution["name"]] = chain
        return chains

    def counters(self, arn: str) -> dict[str, Any] | None:
        """The attempt, retry and leg counters as the execution last carried them."""
        for event in reversed(self.history(arn, newest=100)):
            for key in ("stateExitedEventDetails", "stateEnteredEventDetails"):
                details = event.get(key) or {}
                text = details.get("output") or details.get("input")
                if not text or '"Counters"' not in text:
                    continue
                try:
                    counters = json.loads(text).get("Counters")
                except ValueError:
                    continue
                if isinstance(counters, dict):
                    return counters
        return None
