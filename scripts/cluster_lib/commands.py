"""SSM Run Command on the cluster's nodes: send a document to every node, follow each node's
invocation to its end, cancel what is left after a failure, and report the result.

A document goes to at most 50 nodes per SendCommand (the API's limit), so a larger cluster gets
one command per batch of 50, every batch with the same parameters (the full host list, so every
node finds its rank). The batches of one send share a comment with a token of their own and a
` part i/k` suffix (command_history.py reads them back together).
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.cluster_lib.clients import Patience, aws_errors
from scripts.cluster_lib.documents import load
from scripts.cluster_lib.fleet import Node
from scripts.cluster_lib.logs import JOB_OUTPUT_FOLDERS, LogFollower, Logs
from scripts.cluster_lib.outputs import Stack

TERMINAL = {"Success", "Failed", "Cancelled", "TimedOut"}
#: SendCommand's InstanceIds takes at most 50 IDs (SSM API reference, SendCommand; botocore's
#: model: InstanceIds max 50). Larger clusters get one command per batch of 50.
MAX_INSTANCES_PER_COMMAND = 50
#: preflight.sh exits with this status when a node has a Neuron hardware fault.
REPLACE_NODE_STATUS = 3
#: launch.sh exits with this status (EX_TEMPFAIL) when it ended a leg at its time limit and the
#: trainer saved a resumable checkpoint (contract C4); SSM reports the node as Failed with it.
LEG_TIME_LIMIT_STATUS = 75


@dataclass(frozen=True)
class Sent:
    """One SendCommand call: a command ID and the nodes (at most 50) it went to."""

    command_id: str
    nodes: tuple[Node, ...]
    #: SSM's RequestedDateTime of the command (where a job's output starts in the nodes'
    #: job-log streams, logs.py).
    requested: datetime | None = None


@dataclass
class Invocation:
    rank: int
    node: Node
    command_id: str = ""
    status: str = "Pending"
    response_code: int = -1
    stdout: str = ""
    stderr: str = ""
    finished_at: float | None = None

    @property
    def label(self) -> str:
        return f"node {self.rank} ({self.node.address}, {self.node.instance_id})"

    @property
    def leg_ended(self) -> bool:
        """The node ended its leg at the time limit after saving (contract C4)."""
        return self.status == "Failed" and self.response_code == LEG_TIME_LIMIT_STATUS


@dataclass
class CommandResult:
    document: str
    command_ids: list[str]
    invocations: list[Invocation]
    tails: dict[str, str] = field(default_factory=dict)

    @property
    def command_id(self) -> str:
        return ", ".join(self.command_ids)

    @property
    def ok(self) -> bool:
        return all(inv.status == "Success" for inv in self.invocations)

    @property
    def leg_ended(self) -> bool:
        """Every node ended with Success or the leg's time-limit status, at least one with the
        latter: the job saved and stopped at its time limit, and the next leg resumes it."""
        return all(inv.status == "Success" or inv.leg_ended for inv in self.invocations) and any(
            inv.leg_ended for inv in self.invocations
        )

    @property
    def failed(self) -> list[Invocation]:
        """The failed invocations, the first to fail first (it is usually the cause)."""
        bad = [inv for inv in self.invocations if inv.status != "Success"]
        return sorted(bad, key=lambda inv: (inv.finished_at is None, inv.finished_at or 0.0))

    def summary(self) -> str:
        first = self.failed[0]
        others = [inv.label for inv in self.failed[1:]]
        text = (
            f"{self.document} failed on {first.label}: {first.status}"
            f" (exit status {first.response_code}), command {first.command_id}"
        )
        if others:
            shown = others[:8]
            more = f" and {len(others) - len(shown)} more" if len(others) > len(shown) else ""
            text += f"; also ended on {', '.join(shown)}{more}"
        tail = self.tails.get(first.node.instance_id, "").strip()
        if tail:
            text += "\n--- last output of " + first.label + " ---\n" + tail
        return text


def batches(nodes: list[Node], size: int = MAX_INSTANCES_PER_COMMAND) -> list[list[Node]]:
    return [nodes[start : start + size] for start in range(0, len(nodes), size)]


class RunCommand:
    """Sends the stack's SSM documents to nodes and follows them to their end."""

    def __init__(
        self,
        ssm: Any,
        stack: Stack,
        patience: Patience,
        logs: Logs,
        *,
        failure_grace: float,
        tail_lines: int,
    ) -> None:
        self.ssm = ssm
        self.stack = stack
        self.patience = patience
        self.logs = logs
        self.failure_grace = failure_grace
        self.tail_lines = tail_lines

    def send(
        self, name: str, nodes: list[Node], parameters: dict[str, str], comment: str
    ) -> list[Sent]:
        """Sends the document to every node: one SendCommand per batch of at most 50 nodes,
        each with the same parameters (the full host list, so every node finds its rank).

        Batches of explicit instance IDs rather than Targets by tag: a tag also matches a node
        that is starting or being replaced, which is not in the host list the ranks come from.
        If a later batch cannot be sent, the batches already sent are cancelled: half a job
        must not run.
        """
        document = load(name)
        document.check(parameters)
        outputs = self.stack.outputs()
        groups = batches(nodes)
        # The batches of one send share a comment with a token of their own (so `logs` finds
        # them together, and not a later run's batches), then ` part i/k`.
        token = f" #{secrets.token_hex(3)}" if len(groups) > 1 else ""
        sent: list[Sent] = []
        for index, group in enumerate(groups, start=1):
            part = f"{token} part {index}/{len(groups)}" if len(groups) > 1 else ""
            try:
                with aws_errors(f"sending {name}"):
                    response = self.ssm.send_command(
                        DocumentName=outputs.document(name),
                        InstanceIds=[n.instance_id for n in group],
                        Parameters={key: [value] for key, value in parameters.items()},
                        Comment=(comment[: 100 - len(part)] + part),
                        TimeoutSeconds=600,
                        MaxConcurrency=str(len(group)),
                        MaxErrors=str(len(group)),
                        CloudWatchOutputConfig={
                            "CloudWatchLogGroupName": outputs["TrainingLogGroupName"],
                            "CloudWatchOutputEnabled": True,
                        },
                    )
            except ClusterError:
                self.cancel(sent, reason=f"{name} could not be sent to every node")
                raise
            requested = response["Command"].get("RequestedDateTime") or datetime.now(UTC)
            sent.append(Sent(response["Command"]["CommandId"], tuple(group), requested))
        ids = ", ".join(s.command_id for s in sent)
        self.patience.out(
            f"{name}: command{'s' if len(sent) > 1 else ''} {ids} sent to {len(nodes)} nodes"
        )
        return sent

    def cancel(self, sent: list[Sent], *, reason: str, running: set[str] | None = None) -> None:
        """Cancels every sent command (on the `running` instance IDs only, when given)."""
        for command in sent:
            ids = [n.instance_id for n in command.nodes]
            if running is not None:
                ids = [i for i in ids if i in running]
                if not ids:
                    continue
            self.patience.out(
                f"cancelling command {command.command_id} on {len(ids)} nodes: {reason}"
            )
            self.patience.persist(
                "cancelling the command",
                functools.partial(
                    self.ssm.cancel_command, CommandId=command.command_id, InstanceIds=ids
                ),
            )

    def follow(
        self, name: str, sent: list[Sent], nodes: list[Node], *, stream_rank: int | None = None,
        hint: str = "",
    ) -> CommandResult:  # fmt: skip
        """Polls every node's invocation until all have ended.

        When one node fails, the others get failure_grace seconds to end on their own
        (torchrun on the survivors normally fails too), then the command is cancelled on
        them, so that a broken job never keeps the cluster busy. A node that ended its leg
        at the time limit (status 75) is not a failure: the others are saving too.
        """
        command_of = {n.instance_id: s.command_id for s in sent for n in s.nodes}
        result = CommandResult(
            name,
            [s.command_id for s in sent],
            [
                Invocation(rank, node, command_of[node.instance_id])
                for rank, node in enumerate(nodes)
            ],
        )
        stream: LogFollower | None = None
        if stream_rank is not None:
            streamed = nodes[stream_rank].instance_id
            # A job's own output is in the node's job-log stream, not in the command's.
            batch = next(s for s in sent if s.command_id == command_of[streamed])
            since = batch.requested if name in JOB_OUTPUT_FOLDERS else None
            stream = self.logs.follower(
                command_of[streamed], streamed, job_output_since=since, document=name
            )
        hint = hint or (
            f"command {result.command_id} keeps running on the nodes: see `cluster.py status`"
        )
        first_failure: float | None = None
        cancelled = False
        while True:
            for command in sent:
                statuses = self.patience.patiently(
                    "following the command", functools.partial(self._statuses, command), hint=hint
                )
                if statuses is None:
                    continue
                first_failure = self._update(
                    name, result, command, statuses, hint=hint, first_failure=first_failure
                )
            if stream is not None:
                stream.poll()
            running = [inv for inv in result.invocations if inv.status not in TERMINAL]
            if not running:
                break
            if (
                first_failure is not None
                and not cancelled
                and self.patience.clock() - first_failure >= self.failure_grace
            ):
                self.cancel(
                    sent,
                    reason=f"still running {self.failure_grace:.0f} s after the first failure",
                    running={inv.node.instance_id for inv in running},
                )
                cancelled = True
            self.patience.pause()
        if stream is not None:
            stream.poll()
        if result.failed and not result.leg_ended:
            # The summary shows the output of the first node to fail (usually the cause).
            first = result.failed[0]
            result.tails[first.node.instance_id] = self.output_tail(first.command_id, first)
        return result

    def _update(
        self, name: str, result: CommandResult, command: Sent, statuses: dict[str, str], *,
        hint: str, first_failure: float | None,
    ) -> float | None:  # fmt: skip
        """Takes one poll's statuses of a command into its invocations, saying what changed;
        returns when the first node failed (not by ending its leg), if one has."""
        for inv in result.invocations:
            if inv.command_id != command.command_id or inv.status in TERMINAL:
                continue
            status = statuses.get(inv.node.instance_id, inv.status)
            if status in TERMINAL and not self._details(inv, hint):
                continue  # the details come on the next poll
            if status != inv.status:
                inv.status = status
                code = f" (exit status {inv.response_code})" if status in TERMINAL else ""
                self.patience.out(f"{name}: {inv.label}: {status}{code}")
            if inv.status in TERMINAL:
                inv.finished_at = self.patience.clock()
                bad = inv.status != "Success" and not inv.leg_ended
                if bad and first_failure is None:
                    first_failure = inv.finished_at
        return first_failure

    def _statuses(self, command: Sent) -> dict[str, str]:
        """Every invocation's status of one command: ListCommandInvocations, all pages (an
        invocation not listed yet, right after SendCommand, keeps its status)."""
        statuses: dict[str, str] = {}
        paginator = self.ssm.get_paginator("list_command_invocations")
        for page in paginator.paginate(CommandId=command.command_id):
            for invocation in page["CommandInvocations"]:
                statuses[invocation["InstanceId"]] = invocation.get("Status", "Pending")
        return statuses

    def _details(self, inv: Invocation, hint: str) -> bool:
        """Reads an ended invocation's exit status and output (the first 24,000 characters)."""
        response = self.patience.patiently(
            "reading a node's result",
            lambda: self.ssm.get_command_invocation(
                CommandId=inv.command_id, InstanceId=inv.node.instance_id
            ),
            hint=hint,
        )
        if response is None:
            return False
        inv.response_code = int(response.get("ResponseCode", -1))
        inv.stdout = response.get("StandardOutputContent", "")
        inv.stderr = response.get("StandardErrorContent", "")
        return True

    def output_tail(self, command_id: str, inv: Invocation) -> str:
        """The last lines a node wrote: from CloudWatch Logs (the whole output), else from
        the invocation (SSM keeps only its first 24,000 characters)."""
        lines = self.logs.last_lines(command_id, inv.node.instance_id, self.tail_lines)
        if not lines:
            lines = (inv.stdout.rstrip("\n") + "\n" + inv.stderr.rstrip("\n")).strip().splitlines()
        return "\n".join(lines[-self.tail_lines :])

    def run(
        self,
        name: str,
        nodes: list[Node],
        parameters: dict[str, str],
        comment: str,
        *,
        stream_rank: int | None = None,
        hint: str = "",
    ) -> CommandResult:
        """Sends the document and follows it; Ctrl-C stops following, not the command."""
        sent = self.send(name, nodes, parameters, comment)
        try:
            return self.follow(name, sent, nodes, stream_rank=stream_rank, hint=hint)
        except KeyboardInterrupt:
            ids = ", ".join(s.command_id for s in sent)
            raise ClusterError(
                f"stopped following command {ids}; it keeps running on the nodes "
                "(see `cluster.py status`, `cluster.py logs`, `cluster.py stop`)"
            ) from None
