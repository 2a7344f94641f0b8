"""What the cluster's nodes cost: per job, per attempt, its retries, and the time with no job.

A node-hour is priced at the operations stack's output NodeUsdPerHour: the setting
node_usd_per_hour (a reservation's or a Capacity Block's rate), else the instance type's on-demand
price (stacks/instance_types.py). EC2 bills a running instance whether a job uses it or not, and
a Capacity Block is paid up front (EC2 API reference, CapacityBlockOffering: upfrontFee for
instanceCount instances and capacityBlockDurationHours), so what matters is what each job did
with the node-hours and how many passed with no job at all.

- A job holds the cluster from its first execution's start to its last one's end: its cost is
  that time x the group's node count x the price (waiting for nodes that are not up counts too:
  an upper bound where a job waited for a block to start).
- An attempt is one RunTraining (every batch of it: commands.py sends at most 50 nodes per
  command, the batches share a comment): from its first batch's RequestedDateTime (SSM
  ListCommands) to the next attempt's, or to the job's end, on the nodes its batches targeted
  (TargetCount). The attempts before the last are the retries: their cost is what the retries
  cost.
- Idle: nodes up, no job. `jobs` shows the gaps between one job's end and the next one's start
  (priced at the group's node count: an upper bound, the group may have been scaled in), and it
  warns when the nodes running now have had no job for longer than idle_warning_minutes
  (output IdleWarningMinutes).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from scripts.cluster_lib.command_history import attempt_of
from scripts.cluster_lib.outputs import StackOutputs
from scripts.cluster_lib.progress import duration
from stacks.instance_types import INSTANCE_TYPES

#: idle_warning_minutes where the stack predates the output (the setting's default).
DEFAULT_IDLE_WARNING_MINUTES = 60


@dataclass(frozen=True)
class Price:
    """USD per node-hour (None: unknown) and the idle warning's threshold (0: none)."""

    usd_per_node_hour: float | None
    idle_warning_minutes: int = DEFAULT_IDLE_WARNING_MINUTES

    @classmethod
    def of(cls, outputs: StackOutputs) -> Price:
        """From the stack's outputs; a stack deployed before them prices at on-demand."""
        values = outputs.values
        text = values.get("NodeUsdPerHour")
        if text is None:
            spec = INSTANCE_TYPES.get(values.get("InstanceType", ""))
            price = spec.on_demand_usd_per_hour if spec else None
        else:
            price = None if text == "unknown" else float(text)
        minutes = int(values.get("IdleWarningMinutes", DEFAULT_IDLE_WARNING_MINUTES))
        return cls(price, minutes)

    def usd(self, node_hours: float) -> str:
        """The node-hours' cost, "$1,234.56", or "-" where the price is unknown."""
        if self.usd_per_node_hour is None:
            return "-"
        return f"${node_hours * self.usd_per_node_hour:,.2f}"


def node_hours(started: datetime, ended: datetime, nodes: int) -> float:
    return max((ended - started).total_seconds(), 0.0) / 3600 * nodes


@dataclass(frozen=True)
class Attempt:
    """One RunTraining of a job: when it started, until when it counts, on how many nodes."""

    started: datetime
    ended: datetime
    nodes: int

    @property
    def node_hours(self) -> float:
        return node_hours(self.started, self.ended, self.nodes)


def attempts(commands: list[dict[str, Any]], ended: datetime) -> list[Attempt]:
    """A job's attempts, oldest first, from its RunTraining commands as SSM ListCommands gives
    them (RequestedDateTime, Comment, TargetCount); the last counts until `ended`."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for command in commands:
        grouped.setdefault(attempt_of(command), []).append(command)
    starts = sorted(
        (
            min(c["RequestedDateTime"] for c in batches),
            sum(c.get("TargetCount", 0) for c in batches),
        )
        for batches in grouped.values()
    )
    return [
        Attempt(start, starts[i + 1][0] if i + 1 < len(starts) else max(ended, start), nodes)
        for i, (start, nodes) in enumerate(starts)
    ]


def attempt_lines(found: list[Attempt], price: Price) -> list[str]:
    """One line per attempt: when, how long, on how many nodes, what it cost; the retries'
    total where there were any."""
    lines = [
        f"attempt {n}: {a.started:%Y-%m-%d %H:%M}  "
        f"{duration((a.ended - a.started).total_seconds())} on {a.nodes} nodes = "
        f"{a.node_hours:,.1f} node-hours, {price.usd(a.node_hours)}"
        for n, a in enumerate(found, 1)
    ]
    retried = found[:-1]
    if retried:
        hours = sum(a.node_hours for a in retried)
        lines.append(
            f"retries: {len(retried)}, {hours:,.1f} node-hours, {price.usd(hours)} of the job's "
            "cost"
        )
    return lines


def idle_line(
    *,
    nodes_up: int,
    since: datetime | None,
    now: datetime,
    price: Price,
) -> str | None:
    """The warning for nodes up with no job since `since` (the last job's end, or the nodes'
    launch where later), once that is longer than the threshold; None otherwise."""
    if not nodes_up or since is None or not price.idle_warning_minutes:
        return None
    seconds = (now - since).total_seconds()
    if seconds <= price.idle_warning_minutes * 60:
        return None
    hours = node_hours(since, now, nodes_up)
    return (
        f"warning: {nodes_up} nodes up with no job for {duration(seconds)} ({hours:,.1f} "
        f"node-hours, {price.usd(hours)} so far; the warning comes after "
        f"{price.idle_warning_minutes} minutes, setting idle_warning_minutes): queue a job, or "
        "destroy the compute stack to stop paying for the nodes"
    )
