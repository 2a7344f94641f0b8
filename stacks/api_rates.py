"""How many AWS API calls a job makes per minute, by action, against the documented quotas. No CDK
import: the CLI and the docs can use it (`python -m stacks.api_rates` prints the table).

Who calls what
--------------
The job supervisor (stacks/supervisor_workflow.py; the state names below are its states) calls:

- a new job (start_the_job): ClaimSlot (dynamodb:UpdateItem on the job queue's slot), NotifyStart
  (sns:Publish); a successor: TakeOverSlot (dynamodb:UpdateItem);
- a poll for nodes (wait_for_nodes, once per PollSeconds): ReadGroup and ReadGroupPage
  (ec2:DescribeTags, tag_pages of them), then the ReadNodes Distributed Map (a child execution per
  batch of SEND_BATCH tagged IDs, READ_CONCURRENCY at a time), each child ReadBatchNodes
  (autoscaling:DescribeAutoScalingInstances) and ReadBatchAddresses
  (ec2:DescribeNetworkInterfaces, filtered); the tagged IDs include terminated instances
  (TAGGED_PER_NODE, stacks/supervisor_limits.py), so a read takes up to twice the batches;
- an attempt's start (PreflightBatches, RunTrainingBatches: Distributed Maps with no
  MaxConcurrency, so every batch's child starts at once): a child execution and a <Doc>Send
  (ssm:SendCommand) per batch of 50 nodes;
- a poll of a running command (each child, once per PollSeconds; the children start together, so
  they poll in the same second): <Doc>Poll (ssm:ListCommands) and <Doc>Nodes
  (autoscaling:DescribeAutoScalingInstances);
- the end of an attempt (each child): <Doc>CancelRest (ssm:CancelCommand, after a failure),
  <Doc>Results and <Doc>ResultsPage (ssm:ListCommandInvocations, invocation_pages of them: a
  page of INVOCATIONS_PAGE invocations with their output at a time), and in PreflightEachInvocation
  PreflightMarkUnhealthy (autoscaling:SetInstanceHealth) for each node whose preflight exits 3; in
  the job's execution ListStopCommands (ssm:ListCommands) after a failure, a notification
  (sns:Publish) and StartSuccessor (states:StartExecution) for a retry or a leg;
- a retry: NotifyRetry (sns:Publish), WaitBeforeRetry, StartSuccessor (states:StartExecution), and
  the successor's TakeOverSlot and first poll for nodes.

Every state entered is a state transition (Step Functions' StateTransition bucket), child
executions' included. The SDK tasks retry throttling (supervisor_tasks.py: 6 retries, 5 s
doubling to 2 min), which adds calls only once a rate is already exceeded; not counted here.

The wake (stacks/supervisor_wake.py): EventBridge starts one execution of the wake state
machine per matching event (events:Invocations, states:StartExecution), a Preflight or
RunTraining invocation that ended or a node the group terminates; so an attempt's end at N nodes
starts N of them within seconds. Each receives the wake queue's messages (sqs:ReceiveMessage,
twice when the queue is empty: at once, and a long poll after) and, for each parked child's message,
SendTaskSuccess and sqs:DeleteMessage; the children's tokens are taken by whichever executions
receive them first, so the tokens cost once per attempt's end however many events there are.

The operator CLI (scripts/cluster.py) while it runs: `train` follows the execution every
--poll-interval (CLI_INTERVAL) with GetExecutionHistory (one page of 100 events), DescribeExecution
and, once RunTraining runs, GetLogEvents on rank 0's job-log stream; `logs --follow` reads the
nodes' job-log streams in turn (GetLogEvents, at most half of its rate; one stream with --node)
and the commands' status (ssm:ListCommands, stopping at the first still running) every
--poll-interval; `jobs` lists executions and
describes each one it reads (up to MAX_LISTED). `status`, `stop` and `jobs` are one-shot.

The worst minute
----------------
Within one execution the phases follow one another; a minute can hold a poll for nodes and the
attempt's start, the last poll of Preflight, its end and RunTraining's start, or the last poll of
RunTraining, its end and (with --retry-delay under 60 s) the successor's start and first poll for
nodes. `worst_minute` takes, per action, the most of these minutes; `steady_minute` is a
command's or the node wait's polls alone (calls per poll x 60 / PollSeconds).

Quotas
------
`QUOTAS` holds the documented rate for each action: the sustained (refill) rate per second and
the bucket where the service uses a token bucket, with the page (title and URL). Where a figure
differs by region the lower is used. Where no figure could be confirmed (`confirmed=False`:
Systems Manager's and Auto Scaling's per-action API rates, SNS Publish, CloudFormation
DescribeStacks) the check uses ASSUMED_FLOOR_PER_SECOND, a deliberately low bound: staying under
it means staying under any plausible quota, and going over it is a flag to confirm, not a proven
throttle. `excesses` lists what goes over its rate per minute and by how much.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from stacks.supervisor_limits import (
    PROGRESS_READ_SECONDS,
    SEND_BATCH,
    TAGGED_PER_NODE,
    batches,
    invocation_pages,
    tag_pages,
)

#: The ReadNodes Distributed Map's MaxConcurrency (stacks/supervisor_group.py READ_CONCURRENCY;
#: tests/test_api_rates.py reads it from the synthesized definition).
READ_CONCURRENCY = 5
#: The CLI's --poll-interval default (scripts/cluster.py; scripts/cluster_lib/clients.py Patience).
CLI_INTERVAL = 10.0
#: GetExecutionHistory's page: the CLI asks for maxResults 100 (scripts/cluster_lib/executions.py).
HISTORY_PAGE = 100
#: `jobs` reads at most this many executions (scripts/cluster_lib/executions.py MAX_LISTED).
MAX_LISTED = 1000
#: State transitions per round of the node-wait loop in the job's execution with one page of IDs
#: (WaitForNodes, CountNodeWait, KeepWaiting, ReadGroup, MoreOfGroup, PartitionGroup, ReadNodes,
#: CountNodes, FullSet), per further page (ReadGroupPage, AddGroupPage, JoinGroupPage,
#: MoreOfGroup), and per ReadNodes child (ReadBatchNodes, SelectBatchHealthy, AnyBatchNodeReady,
#: ReadBatchAddresses). tests/test_api_rates.py counts them in the synthesized definition.
NODE_WAIT_STATES, TAG_PAGE_STATES, READ_CHILD_STATES = 9, 4, 4
#: Per child per poll of a command: <Doc>Wait, <Doc>WaitForWake (its SendMessage to the wake
#: queue: stacks/supervisor_wake.py), <Doc>Poll, <Doc>Nodes, <Doc>NodesAlive, <Doc>Ended.
POLL_STATES = 6
#: The most one read of the job's progress adds, in the first RunTraining batch
#: (stacks/supervisor_progress.py): ReadProgress, ProgressSeen, ProgressMade, ProgressPhase,
#: Progressed (or ProgressedCompiling). A read happens at most once per ProgressReadSeconds.
PROGRESS_STATES = 5
#: The most states one invocation's classification enters (PreflightClassify, PreflightPlugin,
#: PreflightByCode, PreflightMarkUnhealthy, PreflightReplaced; RunTraining's: its Classify,
#: Plugin, StatusNamed, ByCode, and for an input error InputError and InputErrorSaid);
#: what a child enters around its classification at most: a node gone, the
#: grace and the cancel (<Doc>NodeGone, <Doc>GraceStarts, <Doc>GraceWait, <Doc>GraceForWake,
#: <Doc>GraceOver, <Doc>CancelRest,
#: <Doc>Cancelled), <Doc>NoResultsYet, <Doc>BatchResult, <Doc>ManyCauses and <Doc>FirstCauses;
#: and per page of invocations <Doc>Results (or <Doc>ResultsPage), <Doc>EachInvocation,
#: <Doc>AddResultsPage, <Doc>JoinResultsPage and <Doc>MoreResults.
CLASSIFY_STATES = {"Preflight": 5, "RunTraining": 6}
CHILD_END_STATES, RESULTS_PAGE_STATES = 11, 5
#: The job's execution from an attempt's end to its successor's start, at most (TrainingOutcome,
#: StopFilter, StopFilters, ListStopCommands, AnyStopCommand, StopCommandJobs, StopMatched,
#: WasStopped, RetryLeft, CountRetry, DescribeRetry, NotifyRetry, WaitBeforeRetry, HandOver,
#: NameSuccessor, SuccessorInput, StartSuccessor, HandedOver, JobContinues), and a new
#: execution's start to its first poll (Defaults, ReadJob, ReadCounters, FreshOrContinued,
#: ClaimSlot, NotifyStart); from NodesReady to a Distributed Map (NodesReady, CountAttempt).
AFTER_ATTEMPT_STATES, JOB_START_STATES, ATTEMPT_START_STATES = 19, 6, 2
#: The wake's states: an execution that finds the queue empty (FirstRound, Receive, AnyMessages,
#: Settled, SettleReceive, AnyMessages, Woken); each round that received messages (WakeEach,
#: CountRound, MoreRounds, Receive, AnyMessages); each message (SendTaskSuccess, DeleteMessage).
#: tests/test_api_rates.py counts them in the synthesized wake definition.
WAKE_EMPTY_STATES, WAKE_ROUND_STATES, WAKE_TOKEN_STATES = 7, 5, 2
#: Messages one ReceiveMessage returns at most (stacks/supervisor_wake.RECEIVE_MAX; the SQS API
#: reference's MaxNumberOfMessages).
RECEIVE_MAX = 10
#: ReceiveMessage calls of a wake that finds the queue empty (Receive, then SettleReceive).
WAKE_EMPTY_RECEIVES = 2
#: How long the wake queue keeps a message (stacks/supervisor_wake.RETENTION_SECONDS): a wait
#: that runs out leaves its message there until a wake refuses its token and deletes it, so
#: each child leaves up to one stale message per PollSeconds of that long.
WAKE_RETENTION_SECONDS = 3900
#: `jobs`' query of the nodes' progress: at most this long, polled this often
#: (scripts/cluster_lib/stragglers.py QUERY_SECONDS, POLL_SECONDS; the tests check they agree).
STRAGGLER_QUERY_SECONDS, STRAGGLER_QUERY_POLL = 60, 2
#: Per minute, an action whose quota could not be confirmed is held to this rate (see above).
ASSUMED_FLOOR_PER_SECOND = 1.0

TRANSITIONS = "states:StateTransition"
CHILD_START = "states:StartExecution (Distributed Map child)"


@dataclass(frozen=True)
class Quota:
    """An action's documented request rate: `per_second` sustained (a token bucket's refill
    rate, or a flat TPS), `bucket` where there is one; `confirmed` False where no figure
    could be confirmed (the check then uses ASSUMED_FLOOR_PER_SECOND)."""

    per_second: float
    source: str
    url: str
    confirmed: bool = True
    bucket: float | None = None
    note: str = ""

    @property
    def per_minute(self) -> float:
        """What the check allows in a minute: the sustained rate for 60 seconds."""
        rate = self.per_second if self.confirmed else ASSUMED_FLOOR_PER_SECOND
        return rate * 60


_SFN = ("Step Functions developer guide, Quotas (API action throttling; other quotas)",
        "https://docs.aws.amazon.com/step-functions/latest/dg/service-quotas.html")  # fmt: skip
_SFN_NOTE = (
    "all other regions' column (lower than us-east-1, us-west-2, eu-west-1); read in "
    "awsdocs/aws-step-functions-developer-guide doc_source/limits-overview.md"
)
_EC2 = ("Request throttling for the Amazon EC2 API (non-mutating actions: bucket 100, refill 20)",
        "https://docs.aws.amazon.com/ec2/latest/devguide/ec2-api-throttling.html")  # fmt: skip
_SSM = ("AWS General Reference, AWS Systems Manager endpoints and quotas",
        "https://docs.aws.amazon.com/general/latest/gr/ssm.html")  # fmt: skip
_ASG = (
    "Amazon EC2 Auto Scaling user guide, Auto Scaling service quotas (resources only)",
    "https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-quotas.html",
)
_SQS = ("Amazon SQS developer guide, Amazon SQS message quotas",
        "https://docs.aws.amazon.com/AWSSimpleQueueService/latest/SQSDeveloperGuide/quotas-messages.html")  # fmt: skip  # noqa: E501
_SNS = ("AWS General Reference, Amazon Simple Notification Service endpoints and quotas",
        "https://docs.aws.amazon.com/general/latest/gr/sns.html")  # fmt: skip
_CWL = (
    "CloudWatch Logs User Guide, CloudWatch Logs quotas",
    "https://docs.aws.amazon.com/AmazonCloudWatch/latest/logs/cloudwatch_limits_cwl.html",
)
_CWL_NOTE = (
    "the figure of awsdocs/amazon-cloudwatch-logs-user-guide doc_source/cloudwatch_limits_cwl.md; "
    "the current page may allow more (not confirmed)"
)
_CW = (
    "Amazon CloudWatch user guide, CloudWatch service quotas (GetMetricData: 50 TPS per Region "
    "for operations without Metrics Insights queries, adjustable in Service Quotas)",
    "https://docs.aws.amazon.com/AmazonCloudWatch/latest/monitoring/cloudwatch_limits.html",
)
_CFN = (
    "AWS CloudFormation user guide, quotas (no API request rate found)",
    "https://docs.aws.amazon.com/AWSCloudFormation/latest/UserGuide/cloudformation-limits.html",
)
_DDB = (
    "Amazon DynamoDB developer guide, Service, account, and table quotas (throughput per "
    "partition)",
    "https://docs.aws.amazon.com/amazondynamodb/latest/developerguide/ServiceQuotas.html",
)
_EB = ("Amazon EventBridge user guide, EventBridge quotas (invocations throttle limit)",
       "https://docs.aws.amazon.com/eventbridge/latest/userguide/eb-quota.html")  # fmt: skip
_UNCONFIRMED = "no per-action request rate found in the documentation searched; not confirmed"


def _ec2(note: str = "") -> Quota:
    return Quota(20, *_EC2, bucket=100, note=note)


def _unconfirmed(source: tuple[str, str], note: str = _UNCONFIRMED) -> Quota:
    return Quota(ASSUMED_FLOOR_PER_SECOND, *source, confirmed=False, note=note)


#: Every action the supervisor and the CLI call while a job runs, with its documented quota.
QUOTAS: dict[str, Quota] = {
    "states:StartExecution": Quota(150, *_SFN, bucket=800, note=_SFN_NOTE),
    CHILD_START: Quota(
        150,
        *_SFN,
        bucket=800,
        note="counted against StartExecution's bucket here (whether a map run's children draw on "
        "it is not confirmed); at most 1,000 open map runs (Step Functions quotas)",
    ),
    "states:DescribeExecution": Quota(10, *_SFN, bucket=250, note=_SFN_NOTE),
    "states:GetExecutionHistory": Quota(20, *_SFN, bucket=400, note=_SFN_NOTE),
    "states:ListExecutions": Quota(2, *_SFN, bucket=100, note=_SFN_NOTE),
    "states:StopExecution": Quota(25, *_SFN, bucket=500, note=_SFN_NOTE),
    TRANSITIONS: Quota(
        500,
        *_SFN,
        bucket=800,
        note="Standard workflows, all other regions (us-east-1, us-west-2, eu-west-1: 5,000 and "
        "1,500); a throttled transition is delayed (ExecutionThrottled), not failed",
    ),
    "ec2:DescribeTags": _ec2(),
    "ec2:DescribeNetworkInterfaces": _ec2(
        "filtered, so the non-mutating bucket (unfiltered: 50 and 10)"
    ),
    "ec2:DescribeInstances": _ec2("filtered, so the non-mutating bucket (unfiltered: 50 and 10)"),
    "ssm:SendCommand": _unconfirmed(_SSM),
    "ssm:ListCommands": _unconfirmed(_SSM),
    "ssm:ListCommandInvocations": _unconfirmed(_SSM),
    "ssm:CancelCommand": _unconfirmed(_SSM),
    "ssm:GetCommandInvocation": _unconfirmed(_SSM),
    "autoscaling:DescribeAutoScalingInstances": _unconfirmed(
        _ASG, "AWS publishes no API request rate for EC2 Auto Scaling; not confirmed"
    ),
    "autoscaling:DescribeAutoScalingGroups": _unconfirmed(
        _ASG, "AWS publishes no API request rate for EC2 Auto Scaling; not confirmed"
    ),
    "autoscaling:SetInstanceHealth": _unconfirmed(
        _ASG, "AWS publishes no API request rate for EC2 Auto Scaling; not confirmed"
    ),
    "sqs:SendMessage": _unconfirmed(
        _SQS,
        "standard queues support a nearly unlimited number of API calls per second per action "
        "on that page; no figure, so not confirmed here",
    ),
    "sqs:ReceiveMessage": _unconfirmed(
        _SQS,
        "standard queues support a nearly unlimited number of API calls per second per action "
        "on that page; no figure, so not confirmed here",
    ),
    "sqs:DeleteMessage": _unconfirmed(
        _SQS,
        "standard queues support a nearly unlimited number of API calls per second per action "
        "on that page; no figure, so not confirmed here",
    ),
    "states:SendTaskSuccess": Quota(300, *_SFN, bucket=1500, note=_SFN_NOTE),
    "events:Invocations": Quota(
        750,
        *_EB,
        note="the lowest region's figure (af-south-1, ap-northeast-3, ap-southeast-3, "
        "eu-south-1; us-east-1 18,750); a throttled invocation is delayed, not dropped",
    ),
    "sns:Publish": _unconfirmed(
        _SNS, "Publish is thousands of TPS per region on that page; the figure not confirmed here"
    ),
    "logs:GetLogEvents": Quota(10, *_CWL, note=_CWL_NOTE),
    "logs:FilterLogEvents": Quota(5, *_CWL, note=_CWL_NOTE),
    "logs:DescribeLogStreams": Quota(5, *_CWL, note=_CWL_NOTE),
    "logs:StartQuery": _unconfirmed(_CWL),
    "logs:GetQueryResults": _unconfirmed(_CWL),
    "cloudformation:DescribeStacks": _unconfirmed(_CFN),
    "cloudwatch:GetMetricData": Quota(
        50,
        *_CW,
        note="the figure of awsdocs/amazon-cloudwatch-user-guide "
        "doc_source/cloudwatch_limits.md; 10 TPS for a Metrics Insights query, which the "
        "supervisor does not send",
    ),
    "dynamodb:UpdateItem": Quota(
        1000, *_DDB, note="1,000 write request units a second per partition; the slot is one item"
    ),
}


# ----------------------------------------------------------------- the supervisor's phases
def read_batches(node_count: int) -> int:
    """ReadNodes' child executions in one poll for nodes: batches of the tagged IDs, terminated
    instances included (TAGGED_PER_NODE of them a node at most)."""
    return math.ceil(TAGGED_PER_NODE * node_count / SEND_BATCH)


def job_start() -> Counter[str]:
    """A new execution's start (a new job's, or a successor's): ClaimSlot or TakeOverSlot, and
    NotifyStart (a new job only; counted for both)."""
    return Counter({"dynamodb:UpdateItem": 1, "sns:Publish": 1, TRANSITIONS: JOB_START_STATES})


def node_wait_round(node_count: int) -> Counter[str]:
    """One round of the node-wait loop: ReadGroup and its pages, and the ReadNodes map's
    children (each reads its batch's lifecycle and, when a node is ready, its addresses)."""
    children = read_batches(node_count)
    pages = tag_pages(node_count)
    return Counter(
        {
            "ec2:DescribeTags": pages,
            CHILD_START: children,
            "autoscaling:DescribeAutoScalingInstances": children,
            "ec2:DescribeNetworkInterfaces": children,
            TRANSITIONS: NODE_WAIT_STATES
            + TAG_PAGE_STATES * (pages - 1)
            + READ_CHILD_STATES * children,
        }
    )


def attempt_start(node_count: int) -> Counter[str]:
    """A document's start on every node: a child execution and a SendCommand per batch."""
    n = batches(node_count)
    return Counter(
        {CHILD_START: n, "ssm:SendCommand": n, TRANSITIONS: ATTEMPT_START_STATES + 2 * n}
    )


def command_poll(node_count: int) -> Counter[str]:
    """One poll of a running command: ListCommands and DescribeAutoScalingInstances in each
    batch's child execution, the wait before it, a message to the wake queue, and at most one
    read of the job's progress, by the first batch's child (RunTraining:
    stacks/supervisor_progress.py), whatever the node count."""
    n = batches(node_count)
    return Counter(
        {
            "ssm:ListCommands": n,
            "autoscaling:DescribeAutoScalingInstances": n,
            "sqs:SendMessage": n,
            "cloudwatch:GetMetricData": 1,
            TRANSITIONS: POLL_STATES * n + PROGRESS_STATES,
        }
    )


def attempt_end(node_count: int, document: str) -> Counter[str]:
    """The end of a document's run, at most: each batch cancelled and its invocations listed
    and classified (Preflight: every node marked unhealthy, the worst), then in the job's
    execution the stop check, a notification and the successor's start."""
    n = batches(node_count)
    calls = Counter(
        {
            "ssm:CancelCommand": n,
            "ssm:ListCommandInvocations": n * invocation_pages(),
            TRANSITIONS: (
                (CHILD_END_STATES + RESULTS_PAGE_STATES * invocation_pages()) * n
                + CLASSIFY_STATES[document] * node_count
            ),
        }
    )
    if document == "Preflight":
        calls["autoscaling:SetInstanceHealth"] = node_count
    else:
        calls.update(
            {
                "ssm:ListCommands": 1,
                "sns:Publish": 1,
                "states:StartExecution": 1,
                TRANSITIONS: AFTER_ATTEMPT_STATES,
            }
        )
    return calls


def wake(events: int, parked: int, stale: int = 0) -> Counter[str]:
    """`events` matching events, each starting a wake execution (EventBridge's invocation and
    a StartExecution), and the `parked` children's messages they find, with `stale` ones of
    waits that ran out: each execution that finds the queue empty receives twice and ends; the
    messages are received ten a round, and each sent SendTaskSuccess (a stale one's refused)
    and deleted once."""
    messages = parked + stale
    rounds = math.ceil(messages / RECEIVE_MAX)
    return Counter(
        {
            "events:Invocations": events,
            "states:StartExecution": events,
            "sqs:ReceiveMessage": WAKE_EMPTY_RECEIVES * events + rounds,
            "states:SendTaskSuccess": messages,
            "sqs:DeleteMessage": messages,
            TRANSITIONS: WAKE_EMPTY_STATES * events
            + WAKE_ROUND_STATES * rounds
            + WAKE_TOKEN_STATES * messages,
        }
    )


def stale_messages(node_count: int, poll_seconds: float) -> int:
    """The most stale messages in the wake queue: every child's waits that ran out within the
    queue's retention, one per PollSeconds."""
    return batches(node_count) * math.ceil(WAKE_RETENTION_SECONDS / poll_seconds)


def _polls_per_minute(poll_seconds: float) -> int:
    """The most polls one loop can make in a minute."""
    return math.ceil(60 / poll_seconds)


def supervisor_minutes(node_count: int, poll_seconds: float) -> dict[str, Counter[str]]:
    """The busiest minutes of a job's supervision, by what happens in them."""
    polls = _polls_per_minute(poll_seconds)
    waiting = Counter[str]()
    for _ in range(polls):
        waiting.update(node_wait_round(node_count))
    running = Counter[str]()
    for _ in range(polls):
        running.update(command_poll(node_count))
    return {
        "a new job and its first poll for nodes": job_start() + waiting,
        "the last poll for nodes and Preflight's start": waiting + attempt_start(node_count),
        "Preflight's end and RunTraining's start": running
        + attempt_end(node_count, "Preflight")
        + wake(node_count, batches(node_count), stale_messages(node_count, poll_seconds))
        + attempt_start(node_count),
        "RunTraining's polls": running,
        "RunTraining's end, a retry and the next poll for nodes": running
        + attempt_end(node_count, "RunTraining")
        + wake(node_count, batches(node_count), stale_messages(node_count, poll_seconds))
        + job_start()
        + waiting,
    }


def worst_minute(node_count: int, poll_seconds: float) -> dict[str, int]:
    """The supervisor's calls per minute by action in its busiest minute for each action."""
    found: dict[str, int] = {}
    for minute in supervisor_minutes(node_count, poll_seconds).values():
        for action, calls in minute.items():
            found[action] = max(found.get(action, 0), calls)
    return found


def steady_minute(
    node_count: int, poll_seconds: float, *, waiting: bool = False
) -> dict[str, float]:
    """Calls per minute while a command runs (or, `waiting`, while the nodes are waited for):
    one loop's calls x 60 / PollSeconds; the progress read's x 60 / the larger of PollSeconds
    and PROGRESS_READ_SECONDS (its interval)."""
    per_poll = node_wait_round(node_count) if waiting else command_poll(node_count)
    minute = {action: calls * 60 / poll_seconds for action, calls in per_poll.items()}
    if not waiting:
        reads = 60 / max(poll_seconds, PROGRESS_READ_SECONDS)
        minute["cloudwatch:GetMetricData"] = reads
        minute[TRANSITIONS] -= PROGRESS_STATES * (60 / poll_seconds - reads)
    return minute


# ------------------------------------------------------------------------------ the CLI
def cli_train_follow(interval: float = CLI_INTERVAL) -> dict[str, float]:
    """`train` following the execution: per --poll-interval one page of the history, a
    DescribeExecution and rank 0's job-log stream."""
    per_minute = 60 / interval
    return {
        "states:GetExecutionHistory": per_minute,
        "states:DescribeExecution": per_minute,
        "logs:GetLogEvents": per_minute,
    }


def cli_logs_follow(
    node_count: int, interval: float = CLI_INTERVAL, *, one_node: bool = False
) -> dict[str, float]:
    """`logs --job-id ID --follow`: per --poll-interval one ListCommands (the status check
    stops at the first command still running: command_history.commands_ended) and the
    nodes' job-log streams in turn, at most half of GetLogEvents' rate (scripts/cluster.py,
    LOG_READS_PER_SECOND; one stream with --node)."""
    per_minute = 60 / interval
    budget = max(1, int(QUOTAS["logs:GetLogEvents"].per_second / 2 * interval))
    streams = 1 if one_node else min(node_count, budget)
    return {
        "ssm:ListCommands": per_minute,
        "logs:GetLogEvents": streams * per_minute,
    }


def cli_jobs(executions_read: int = MAX_LISTED) -> dict[str, float]:
    """One `jobs`, as one minute: ListExecutions pages (boto3's default of 100 a page, not
    confirmed) and a DescribeExecution for each execution it reads (MAX_LISTED at most); for
    the running job one Insights query of every node's progress (StartQuery, and
    GetQueryResults every STRAGGLER_QUERY_POLL s for at most STRAGGLER_QUERY_SECONDS:
    scripts/cluster_lib/stragglers.py), whatever the node count."""
    return {
        "states:ListExecutions": math.ceil(executions_read / HISTORY_PAGE),
        "states:DescribeExecution": executions_read,
        "logs:StartQuery": 1,
        "logs:GetQueryResults": STRAGGLER_QUERY_SECONDS / STRAGGLER_QUERY_POLL + 1,
    }


# ---------------------------------------------------------------------------- the check
@dataclass(frozen=True)
class Excess:
    """An action over its quota in its busiest minute: who, how many calls, how many allowed."""

    caller: str
    action: str
    calls_per_minute: float
    allowed_per_minute: float

    @property
    def confirmed(self) -> bool:
        """Over a documented rate (False: over ASSUMED_FLOOR_PER_SECOND, a flag to confirm)."""
        return QUOTAS[self.action].confirmed

    @property
    def factor(self) -> float:
        return self.calls_per_minute / self.allowed_per_minute

    def __str__(self) -> str:
        quota = QUOTAS[self.action]
        kind = "documented" if quota.confirmed else "assumed (unconfirmed)"
        return (
            f"{self.caller}: {self.action} {self.calls_per_minute:,.0f}/min, {kind} "
            f"{self.allowed_per_minute:,.0f}/min: {self.factor:.1f}x"
        )


def callers(
    node_count: int, poll_seconds: float, interval: float = CLI_INTERVAL
) -> dict[str, dict[str, float]]:
    """Each caller's calls per minute by action in its busiest minute."""
    return {
        "supervisor": dict(worst_minute(node_count, poll_seconds)),
        "cluster.py train (following)": cli_train_follow(interval),
        "cluster.py logs --follow --node": cli_logs_follow(node_count, interval, one_node=True),
        "cluster.py logs --follow": cli_logs_follow(node_count, interval),
        "cluster.py jobs": cli_jobs(),
    }


def excesses(node_count: int, poll_seconds: float, interval: float = CLI_INTERVAL) -> list[Excess]:
    """What goes over its quota per minute, by caller, at `node_count` and `poll_seconds`:
    each caller alone, and the supervisor with `train` following it (one job at a time, so
    that is a job's load)."""
    found = []
    groups = callers(node_count, poll_seconds, interval)
    together = dict(groups["supervisor"])
    for action, calls in groups["cluster.py train (following)"].items():
        together[action] = together.get(action, 0) + calls
    groups["supervisor + train"] = together
    for caller, rates in groups.items():
        for action, calls in rates.items():
            allowed = QUOTAS[action].per_minute
            if calls > allowed:
                found.append(Excess(caller, action, calls, allowed))
    return found


def table(node_counts: tuple[int, ...] = (64, 256, 1024), poll_seconds: float | None = None) -> str:
    """A markdown table: the supervisor's and `train`'s calls per minute by action in the worst
    minute at each node count (PollSeconds: the minimum, supervisor_limits.min_poll_seconds),
    with the quota and its source."""
    from stacks.supervisor_limits import min_poll_seconds

    heads = " | ".join(f"{n:,} nodes" for n in node_counts)
    lines = [
        f"| Action | {heads} | Quota (per second) | Source |",
        "|---" * (len(node_counts) + 3) + "|",
    ]
    rates: list[dict[str, float]] = []
    for n in node_counts:
        poll = poll_seconds or min_poll_seconds(n)
        merged: dict[str, float] = dict(worst_minute(n, poll))
        for action, calls in cli_train_follow().items():
            merged[action] = merged.get(action, 0) + calls
        rates.append(merged)
    for action, quota in QUOTAS.items():
        counts = [r.get(action, 0.0) for r in rates]
        if not any(counts):
            continue
        cells = " | ".join(f"{c:,.0f}" for c in counts)
        bucket = f", bucket {quota.bucket:,.0f}" if quota.bucket else ""
        rate = f"{quota.per_second:g}{bucket}" if quota.confirmed else "not confirmed"
        lines.append(f"| {action} | {cells} | {rate} | [{quota.source}]({quota.url}) |")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    from stacks.supervisor_limits import DEFAULT_POLL_SECONDS, min_poll_seconds

    print("Worst minute, supervisor and `train` following, at the minimum PollSeconds:\n")
    print(table())
    print(f"\nAt PollSeconds {DEFAULT_POLL_SECONDS}:\n")
    print(table(poll_seconds=DEFAULT_POLL_SECONDS))
    print("\nOver a quota at 1,024 nodes, minimum PollSeconds:")
    for line in [str(e) for e in excesses(1024, min_poll_seconds(1024))] or ["none"]:
        print(f"- {line}")
