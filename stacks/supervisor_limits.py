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
(one Map iteration each), and each poll writes EVENTS_PER_POLL events. What the poll loops may
spend, POLL_EVENTS, leaves the rest for the states around them (per-invocation classification
is about 8 events per node and document).
"""

from __future__ import annotations

import math

#: Step Functions quotas: maximum execution history size of a standard execution.
HISTORY_EVENTS = 25_000
#: The events the poll loops of one attempt may write; the rest of HISTORY_EVENTS is for the
#: states around them (at 500 nodes, the classification of Preflight and RunTraining
#: invocations is about 8,000 events).
POLL_EVENTS = 15_000
#: One poll: Wait (entered, exited), Task (entered, scheduled, started, succeeded, exited) and
#: Choice (entered, exited). tests/test_supervisor.py counts them in an execution's history.
EVENTS_PER_POLL = 9
#: Polls for a full set of nodes after which the execution hands the job over (one such poll
#: is a Wait, the ReadGroup Task and five Pass or Choice states: about 17 events).
MAX_NODE_WAITS = 500
#: The longest a RunTraining command runs (its ExecutionTimeout: at most 172800 seconds, the
#: aws:runShellScript limit).
LEG_SECONDS = 172_800
#: The supervisor's poll of a running command when the execution input names none.
DEFAULT_POLL_SECONDS = 300
#: SendCommand takes at most 50 instance IDs (SSM API reference): one Map iteration each.
SEND_BATCH = 50


def batches(node_count: int) -> int:
    return math.ceil(node_count / SEND_BATCH)


def min_poll_seconds(node_count: int, leg_seconds: int | None = None) -> int:
    """The shortest PollSeconds at which one attempt of `leg_seconds` (LEG_SECONDS) on
    `node_count` nodes stays within POLL_EVENTS."""
    polls = POLL_EVENTS / (EVENTS_PER_POLL * batches(node_count))
    return math.ceil((LEG_SECONDS if leg_seconds is None else leg_seconds) / polls)
