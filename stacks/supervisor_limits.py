"""How long one execution of the job supervisor can follow a job: the arithmetic that the
state machine (stacks/supervisor.py) and the CLI's `train --check-every` both follow. No CDK
import, so the CLI can use it.

A standard execution keeps at most 25,000 events in its history ("Maximum execution history
size: 25,000 events in a single state machine execution history", Step Functions quotas,
Quotas related to state machine executions); an inline Map's iterations write into the same
history. The supervisor therefore hands the job over to a new execution of itself at every new
leg, every retry and after MAX_NODE_WAITS polls for nodes, so one execution follows at most one
attempt. An attempt is a RunTraining command of at most LEG_SECONDS (the aws:runShellScript
limit, RunTraining's ExecutionTimeout), polled once per PollSeconds by every batch of 50 nodes
(one Map iteration each), and each poll writes EVENTS_PER_POLL events. What the polls may
spend is what is left after the states around them: the waits for nodes before the attempt,
EVENTS_PER_NODE for each node and OTHER_EVENTS for the rest.
"""

from __future__ import annotations

import math

#: Step Functions quotas: maximum execution history size of a standard execution.
HISTORY_EVENTS = 25_000
#: Per node and attempt: its address in the host list (a Pass and a Choice, 4 events) and the
#: classification of its Preflight and RunTraining invocations (a Map iteration through Choice
#: and Pass states, at most 10 events, for a failed node or one that is gone; 15 for a node
#: marked unhealthy, whose iteration calls SetInstanceHealth). tests/test_supervisor.py counts
#: RunTraining's in an execution's history.
EVENTS_PER_NODE = 30
#: Everything else one attempt writes: the start, reading the group and the addresses, the
#: grace period, the stop check, notifications and the hand-over.
OTHER_EVENTS = 1_000
#: One poll: Wait (entered, exited), two Tasks (entered, scheduled, started, succeeded, exited:
#: ListCommands, and DescribeInstances for the batch's nodes that still run), a Pass that counts
#: them and the Choice (entered, exited each). tests/test_supervisor.py counts them in an
#: execution's history.
EVENTS_PER_POLL = 16
#: One poll for a full set of nodes: Wait 2, the ReadGroup Task 5, five Pass or Choice states 2
#: each (tests/test_supervisor.py adds them up along the definition's loop). After
#: MAX_NODE_WAITS of them the execution hands the job over (at PollSeconds 300, 8 hours).
EVENTS_PER_NODE_WAIT = 17
MAX_NODE_WAITS = 100
#: The longest a RunTraining command runs (its ExecutionTimeout: at most 172800 seconds, the
#: aws:runShellScript limit).
LEG_SECONDS = 172_800
#: The supervisor's poll of a running command when the execution input names none.
DEFAULT_POLL_SECONDS = 300
#: SendCommand takes at most 50 instance IDs (SSM API reference): one Map iteration each.
SEND_BATCH = 50


def batches(node_count: int) -> int:
    return math.ceil(node_count / SEND_BATCH)


def poll_events(node_count: int) -> int:
    """The events one attempt's polls may write on `node_count` nodes."""
    waits = MAX_NODE_WAITS * EVENTS_PER_NODE_WAIT
    return HISTORY_EVENTS - OTHER_EVENTS - waits - EVENTS_PER_NODE * node_count


def min_poll_seconds(node_count: int, leg_seconds: int | None = None) -> int:
    """The shortest PollSeconds at which one attempt of `leg_seconds` (LEG_SECONDS) on
    `node_count` nodes stays within the history."""
    polls = poll_events(node_count) / (EVENTS_PER_POLL * batches(node_count))
    return math.ceil((LEG_SECONDS if leg_seconds is None else leg_seconds) / polls)
