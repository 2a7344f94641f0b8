"""How long one execution of the job supervisor can follow a job: the arithmetic that the
state machine (stacks/supervisor.py) and the CLI's `train --check-every` both follow. No CDK
import, so the CLI can use it.

A standard execution keeps at most 25,000 events in its history ("Maximum execution history
size: 25,000 events in a single state machine execution history", Step Functions quotas,
Quotas related to state machine executions). The supervisor therefore hands the job over to a
new execution of itself at every new leg, every retry and after MAX_NODE_WAITS polls for nodes,
so one execution follows at most one attempt, and it follows each batch of SEND_BATCH nodes in
a child execution of its own: PreflightBatches and RunTrainingBatches are Distributed Maps
whose iterations are standard executions ("Each child workflow execution has its own, separate
execution history from that of the parent workflow", Step Functions developer guide, Avoid
reaching the history quota; the parent's history records the map run's start and end).

So the job's execution writes what the attempt writes around its commands (OTHER_EVENTS) and
its polls for nodes (MAX_NODE_WAITS of node_wait_events: a page of the group's instance IDs
more for every TAG_PAGE of them), however often the commands are polled; no event per node
(the group is read batch by batch in child executions, the host list is one state) and none
per poll. A batch's child execution sends the command, polls it once per PollSeconds for up to
LEG_SECONDS (EVENTS_PER_POLL each; the first batch of RunTraining also reads the job's
progress, EVENTS_PER_PROGRESS_READ more at most once per PROGRESS_READ_SECONDS), is woken
early at most WAKE_BUDGET times (EVENTS_PER_WAKE each: stacks/supervisor_wake.py), and
classifies its invocations (at most EVENTS_PER_NODE a node) with CHILD_OTHER_EVENTS around
them: min_poll_seconds is what that child's history allows, the same from 50 nodes to 1,024
(stacks/config.py bounds node_count).
"""

from __future__ import annotations

import math

#: Step Functions quotas: maximum execution history size of a standard execution.
HISTORY_EVENTS = 25_000
#: Per node in its batch's child execution: the classification of its invocation (an iteration
#: of <Document>EachInvocation through Choice and Pass states: at most 12 events for a failed
#: node or one that is gone, 14 for RunTraining's input error, whose cause quotes its output,
#: 15 for a node Preflight marks unhealthy, whose iteration calls SetInstanceHealth).
#: tests/test_supervisor.py counts RunTraining's in a child's history.
EVENTS_PER_NODE = 15
#: The rest of a batch's child execution: its start and end, SendCommand, the grace and the
#: cancel once a node has ended (13), and per page of INVOCATIONS_PAGE invocations
#: ListCommandInvocations, the classification Map's own events and the page's join (15), then
#: the batch's result (54 in all at two pages), with room for the Task retries that throttling
#: causes (3 events each).
CHILD_OTHER_EVENTS = 500
#: Everything else one attempt writes in the job's execution: the start, reading the group and
#: the addresses, the host list, the two Distributed Maps' runs, the grace period, the stop
#: check, notifications and the hand-over.
OTHER_EVENTS = 1_000
#: One poll, in a batch's child execution, after a wait that ran its full PollSeconds: the
#: <Document>Wait Choice (entered, exited), the <Document>WaitForWake callback Task that timed
#: out (entered, scheduled, started, submitted, timed out, exited: stacks/supervisor_wake.py), two
#: Tasks (entered, scheduled, started, succeeded, exited: ListCommands, and
#: DescribeAutoScalingInstances for the batch's nodes still in service), a Pass that counts
#: them and the Choice (entered, exited each). A plain Wait once the wakes are spent writes
#: less (2 instead of the callback's 6). tests/test_supervisor_wake.py counts them in a child's
#: history.
EVENTS_PER_POLL = 22
#: The same poll after a plain Wait (a wait of PARK_DELAY or less, or once the wakes are
#: spent: stacks/supervisor_wake.py): the Wait's 2 events instead of the callback's 6.
EVENTS_PER_PLAIN_POLL = EVENTS_PER_POLL - 4
#: One poll that a wake started: the callback Task succeeded (entered, scheduled, started,
#: submitted, succeeded, exited), the <Document>Woken Pass that counts it, the rest as a poll's.
#: tests/test_supervisor_wake.py counts them in a child's history.
EVENTS_PER_WAKE = 24
#: The wakes one batch's child takes in one attempt; after them it waits PollSeconds between
#: polls. When 1,024 invocations end at once, each of their events wakes every parked child,
#: and a woken child that finds nothing new parks again: the budget keeps such a herd from
#: filling the child's history. A wake counts for no seconds of the leg, so the budget's
#: events come off what the timed polls may write (poll_events).
WAKE_BUDGET = 40
#: What one read of the job's progress adds to a poll of RunTraining's first batch
#: (stacks/supervisor_progress.py), at most: the ReadProgress Task (GetMetricData) 5,
#: ProgressSeen, ProgressMade, ProgressPhase and ProgressedCompiling (or Progressed) 2 each;
#: the read goes back to the poll's own <Document>Wait, which EVENTS_PER_POLL counts. A poll
#: that reads nothing adds none (the read's condition is in the poll's own Choice). A woken
#: poll adds no seconds to $.Alive.Waited, so it reads nothing more: the reads stay one per
#: PROGRESS_READ_SECONDS of timed polls. tests/test_supervisor.py adds them up along the
#: definition's loop.
EVENTS_PER_PROGRESS_READ = 13
#: The least time between two reads of the progress (ProgressReadSeconds by default): that
#: batch's child reads at most once per PROGRESS_READ_SECONDS (or per poll, when PollSeconds is
#: longer), so the reads cost the shortest PollSeconds little (min_poll_seconds), and a hang is
#: noticed within HangSeconds plus one read interval plus one poll.
PROGRESS_READ_SECONDS = 600
#: One poll for a full set of nodes, in the job's execution, when the group's instance IDs fit
#: one page: Wait 2, the ReadGroup Task 5, the ReadNodes Distributed Map 4 (entered, map run
#: started and succeeded, exited: its batches are child executions of their own), six Pass or
#: Choice states 2 each (tests/test_supervisor.py adds them up along the definition's loop).
#: After MAX_NODE_WAITS of them the execution hands the job over (at PollSeconds 300, 8 hours).
EVENTS_PER_NODE_WAIT = 23
#: Each further page of IDs: the ReadGroupPage Task 5 and three Pass or Choice states 2 each.
EVENTS_PER_TAG_PAGE = 11
#: The group's instances a DescribeTags page holds (stacks/supervisor_group.py: 500 entries are
#: about 83 KB, a third of a task's result; EC2 allows 5 to 1000).
TAG_PAGE = 500
#: A terminated instance keeps its tags while EC2 still lists it, about an hour ("Terminated
#: instances remain visible ... for approximately one hour", Amazon EC2 user guide,
#: Terminate Amazon EC2 instances): the arithmetic allows one terminated instance per node.
TAGGED_PER_NODE = 2
MAX_NODE_WAITS = 100
#: The longest a RunTraining command runs (its ExecutionTimeout: at most 172800 seconds, the
#: aws:runShellScript limit).
LEG_SECONDS = 172_800
#: How long past its document's timeout a batch's child polls a command before it counts it as
#: ended (an agent cut off from SSM never reports: stacks/supervisor_run.py): the polls count
#: in the child's history like the command's own, so min_poll_seconds allows for them.
POLL_LIMIT_MARGIN = 600
#: The supervisor's poll of a running command when the execution input names none.
DEFAULT_POLL_SECONDS = 300
#: HangSeconds by default, in training (stacks/supervisor_progress.py): the reference trainer
#: writes a line at every log step, evaluation and save (a few a minute), and a BERT-class save
#: to host memory takes seconds; half an hour of silence is a hang, noticed well before a day's
#: work is lost.
DEFAULT_HANG_SECONDS = 1800
#: CompileHangSeconds by default, while compiling: neuronx-cc compiles a large model's graphs for
#: tens of minutes to hours on a cold cache (Neuron's persistent cache documentation;
#: neuron_parallel_compile exists for it), and a trainer writes nothing until its first step.
DEFAULT_COMPILE_HANG_SECONDS = 3 * 3600
#: SendCommand takes at most 50 instance IDs (SSM API reference): one child execution each.
SEND_BATCH = 50
#: A batch's child reads its invocations with their output (Details) this many at a time and
#: classifies each page before it reads the next (stacks/supervisor_results.py): at 2,500
#: characters of Output each (the SSM agent's limit), a page is about 72 KB of the state's
#: 256 KiB, and a batch's end takes invocation_pages ListCommandInvocations calls.
INVOCATIONS_PAGE = 25


def invocation_pages() -> int:
    """The ListCommandInvocations pages a batch of SEND_BATCH nodes reads at its end."""
    return math.ceil(SEND_BATCH / INVOCATIONS_PAGE)


def batches(node_count: int) -> int:
    return math.ceil(node_count / SEND_BATCH)


def tag_pages(node_count: int) -> int:
    """The DescribeTags pages one read of the group takes, terminated instances included."""
    return math.ceil(TAGGED_PER_NODE * node_count / TAG_PAGE)


def node_wait_events(node_count: int) -> int:
    """The events one poll for a full set of `node_count` nodes writes in the job's execution."""
    return EVENTS_PER_NODE_WAIT + EVENTS_PER_TAG_PAGE * (tag_pages(node_count) - 1)


def job_events(node_count: int) -> int:
    """The most one attempt on `node_count` nodes writes in the job's execution."""
    return OTHER_EVENTS + MAX_NODE_WAITS * node_wait_events(node_count)


def poll_events(node_count: int) -> int:
    """The events the polls of one attempt may write in the child execution of its largest
    batch on `node_count` nodes."""
    return (
        HISTORY_EVENTS
        - CHILD_OTHER_EVENTS
        - EVENTS_PER_NODE * min(node_count, SEND_BATCH)
        - WAKE_BUDGET * EVENTS_PER_WAKE
    )


def progress_reads(seconds: float, poll_seconds: float, read_seconds: float) -> int:
    """The most reads of the progress in `seconds` of polls: the first at the first poll, each
    next one at least `read_seconds` (and one poll) after the last."""
    return int(seconds // max(poll_seconds, read_seconds)) + 1


def attempt_poll_events(
    poll_seconds: int, leg_seconds: int | None = None, read_seconds: int = PROGRESS_READ_SECONDS
) -> int:
    """The most events the polls of one attempt of `leg_seconds` (LEG_SECONDS, and the poll's
    own margin) write in RunTraining's first batch's child execution, which also reads the
    job's progress (at most once per `read_seconds`: ProgressReadSeconds)."""
    leg = LEG_SECONDS if leg_seconds is None else leg_seconds
    seconds = leg + POLL_LIMIT_MARGIN
    polls = math.ceil(seconds / poll_seconds)
    reads = progress_reads(seconds, poll_seconds, read_seconds)
    return polls * EVENTS_PER_POLL + reads * EVENTS_PER_PROGRESS_READ


def min_poll_seconds(
    node_count: int, leg_seconds: int | None = None, read_seconds: int = PROGRESS_READ_SECONDS
) -> int:
    """The shortest PollSeconds at which one attempt of `leg_seconds` (LEG_SECONDS) on
    `node_count` nodes stays within the history of each batch's child execution: its polls
    (EVENTS_PER_POLL each) and, in RunTraining's first batch, the reads of the job's progress
    (EVENTS_PER_PROGRESS_READ each, at most one per `read_seconds`)."""
    budget = poll_events(node_count)
    low, high = 1, (LEG_SECONDS if leg_seconds is None else leg_seconds) + POLL_LIMIT_MARGIN
    while low < high:  # the events fall as the polls grow apart: the first that fits
        middle = (low + high) // 2
        if attempt_poll_events(middle, leg_seconds, read_seconds) <= budget:
            high = middle
        else:
            low = middle + 1
    return low
