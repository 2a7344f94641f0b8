"""The job supervisor's hang detection: one reader of the job's progress per attempt.

A hung job (a collective that never returns, a rank stuck in I/O, a deadlock after a driver
fault) keeps every RunTraining invocation InProgress, so nothing in the commands ends the
attempt. Its progress does: rank 0's metrics-file lines reach the training log group, whose
metric filters make each one a datapoint of the cluster's JobStep metric
(stacks/progress_metric.py; docs/job-contract.md). So the child execution of the first batch
of RunTraining (one reader per attempt, whatever the node count), at a poll in which nothing
else happened and at least ProgressReadSeconds after its last read, asks CloudWatch for JobStep
since the newest datapoint it has seen (GetMetricData, the AWS SDK integration; no new
permission on the nodes):

- a datapoint newer than that one, or the same minute with a higher step, is progress: the
  deadline moves to the seconds waited so far plus HangSeconds, or CompileHangSeconds when that
  minute's highest step is a compiling line's (JobStep with Phase=compiling: a datapoint is a
  minute's Maximum, so a minute that holds the compile's end and the first steps is training);
  so is the same minute and step turning into a compiling line's after a training line was
  seen there (the phase seen is kept in $.Progress.Phase): a compile after training steps gets
  the compile limit;
- no progress by the deadline (counted in polls, as the poll's own limit is) ends the attempt:
  the cause says "no progress since step N at T", the batch's command is cancelled and so are
  the other batches' (as after a node that ended: stacks/supervisor_run.py), and the workflow
  retries from the last checkpoint, a retry spent.

A hang is noticed within HangSeconds plus one read interval (the larger of PollSeconds and
ProgressReadSeconds) plus one poll: the read that first sees the last datapoint sets the
deadline. Reading at every poll would cost a read's events (EVENTS_PER_PROGRESS_READ,
stacks/supervisor_limits.py) in every poll of that batch's history; read at most every
ProgressReadSeconds, they cost the shortest PollSeconds little (min_poll_seconds).

Before the attempt's first line the compile limit applies from when the nodes were ready. The
minute they were ready in may hold the previous attempt's last line (a retry's nodes are often
ready within a minute of it; the cluster's previous job's, in a queue), and CloudWatch answers
from the start of that minute: read as the attempt's progress, it gave a retry HangSeconds
while it compiled. So the batch's first read keeps that minute's highest step as stale
($.Progress.Stale); progress is a later minute, or that minute's step grown past the stale one.
The first read comes at the first poll, a wait after RunTraining was sent: the attempt's own
lines in that minute by then read as stale too, and count from its next minute on (the compile
limit stands until then, never a shorter one).
A datapoint's timestamp is the start of its minute (Period 60) and the window starts at the
newest one seen, so at most a few datapoints come back however long the job runs, and a line
that reaches CloudWatch late still counts once it is there.
"""

from __future__ import annotations

from typing import Any

from aws_cdk import aws_stepfunctions as sfn

from stacks.progress_metric import METRIC_NAME, PHASE_DIMENSION
from stacks.supervisor_tasks import SupervisorTasks

#: The datapoints' period: CloudWatch keeps one-minute datapoints for 15 days (GetMetricData,
#: botocore's cloudwatch model), longer than a 48-hour leg.
PERIOD_SECONDS = 60
#: The query IDs (MetricDataQuery.Id: a lowercase letter first).
ANY, COMPILING = "any", "compiling"
#: $.Progress.Stale before the batch's first read: the highest step of the minute the nodes
#: were ready in is not known yet (-1 once read: no datapoint in that minute).
UNREAD = -2


def initial_progress() -> dict[str, Any]:
    """What a RunTraining batch starts with: nothing seen since the nodes were ready, the
    compile limit, and a read at the first poll."""
    return {
        "At": sfn.JsonPath.string_at("$.Nodes.Since"),
        "Step": -1,
        "Phase": "compiling",
        "Deadline": sfn.JsonPath.number_at("$.Job.CompileHangSeconds"),
        "NextRead": 0,
        "Stale": UNREAD,
    }


def read_due() -> sfn.Condition:
    """Whether this poll of a RunTraining batch reads the job's progress: the first batch's,
    at least ProgressReadSeconds (counted in polls) after its last read. A condition of the poll's
    own Choice (stacks/supervisor_run.py), so a poll that does not read writes no event more."""
    return sfn.Condition.and_(
        sfn.Condition.number_equals("$.Batch", 0),
        sfn.Condition.number_greater_than_equals_json_path("$.Alive.Waited", "$.Progress.NextRead"),
    )


def _next_read() -> str:
    return "States.MathAdd($.Alive.Waited, $.Job.ProgressReadSeconds)"


def _query(t: SupervisorTasks, query_id: str, dimensions: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "Id": query_id,
        "MetricStat": {
            "Metric": {
                "Namespace": t.config.metrics_namespace,
                "MetricName": METRIC_NAME,
                "Dimensions": dimensions,
            },
            "Period": PERIOD_SECONDS,
            "Stat": "Maximum",
        },
        "ReturnData": True,
    }


def watch_progress(
    t: SupervisorTasks, p: str, wait: sfn.IChainable, hang: sfn.IChainable
) -> sfn.State:
    """<p>ReadProgress (GetMetricData), then on progress a new deadline, past the deadline
    <p>NoProgress (the cause in $.Hang) and `hang`, otherwise the next read's time; then
    `wait`. Returns the first state. The longest way from the read back to `wait` is what
    EVENTS_PER_PROGRESS_READ counts (tests/test_supervisor.py walks it)."""
    read = t.sdk(
        f"{p}ReadProgress",
        "cloudwatch",
        "getMetricData",
        {
            "MetricDataQueries": [
                _query(t, ANY, []),
                _query(t, COMPILING, [{"Name": PHASE_DIMENSION, "Value": "compiling"}]),
            ],
            "StartTime": sfn.JsonPath.string_at("$.Progress.At"),
            "EndTime": sfn.JsonPath.string_at("$$.State.EnteredTime"),
            "ScanBy": "TimestampDescending",
        },
        # GetMetricData supports no resource-level permission (Service Authorization
        # Reference, Amazon CloudWatch).
        ["*"],
        iam_action="cloudwatch:GetMetricData",
        result_selector={
            # Each query's datapoints, newest first (ScanBy), picked by its ID (the API does
            # not promise the results' order) and flattened: an indefinite path is a list of
            # its matches, [] where there are none (Jayway JsonPath, which Step Functions
            # evaluates paths with).
            "Times": sfn.JsonPath.list_at(f"$.MetricDataResults[?(@.Id == '{ANY}')].Timestamps[*]"),
            "Steps": sfn.JsonPath.list_at(f"$.MetricDataResults[?(@.Id == '{ANY}')].Values[*]"),
            "CompilingTimes": sfn.JsonPath.list_at(
                f"$.MetricDataResults[?(@.Id == '{COMPILING}')].Timestamps[*]"
            ),
            "CompilingSteps": sfn.JsonPath.list_at(
                f"$.MetricDataResults[?(@.Id == '{COMPILING}')].Values[*]"
            ),
        },
        result_path="$.Read",
    )
    # A comparison never reads a path that may be missing: each Choice compares only what an
    # earlier rule, or an earlier Choice, found present.
    seen = sfn.Choice(t.scope, f"{p}ProgressSeen")
    made = sfn.Choice(t.scope, f"{p}ProgressMade")
    # A minute holds the compile's lines and the first steps alike: the job is compiling only
    # when the newest minute's highest step is a compiling line's (the trainer's compiling
    # line comes before the steps it compiles for: docs/job-contract.md).
    phase = sfn.Choice(t.scope, f"{p}ProgressPhase")
    # Before the attempt's first datapoint $.Progress.At is the time the nodes were ready, and
    # GetMetricData rounds a StartTime down to its minute (StartTime, botocore's cloudwatch
    # model): that minute's datapoint may hold the previous attempt's last lines (a minute's
    # timestamp is its start). So the first read keeps that minute's highest step as stale
    # ($.Progress.Stale), and what is the attempt's is a later minute (timestamps compare as
    # times: ASL's TimestampGreaterThanPath; Step Functions ignores fractions of a second) or
    # that minute's step grown past the stale one since.
    nothing_yet = sfn.Condition.number_less_than("$.Progress.Step", 0)
    unread = sfn.Condition.number_equals("$.Progress.Stale", UNREAD)
    later_minute = sfn.Condition.timestamp_greater_than_json_path(
        "$.Read.Times[0]", "$.Progress.At"
    )
    attempts_own = sfn.Condition.or_(
        sfn.Condition.not_(nothing_yet),
        later_minute,
        sfn.Condition.and_(
            sfn.Condition.not_(unread),
            sfn.Condition.number_greater_than_json_path("$.Read.Steps[0]", "$.Progress.Stale"),
        ),
    )
    new = sfn.Condition.and_(
        attempts_own,
        sfn.Condition.not_(
            sfn.Condition.and_(
                sfn.Condition.string_equals_json_path("$.Read.Times[0]", "$.Progress.At"),
                sfn.Condition.number_less_than_equals_json_path(
                    "$.Read.Steps[0]", "$.Progress.Step"
                ),
            )
        ),
    )
    compiling = sfn.Condition.and_(
        sfn.Condition.string_equals_json_path("$.Read.CompilingTimes[0]", "$.Read.Times[0]"),
        sfn.Condition.number_greater_than_equals_json_path(
            "$.Read.CompilingSteps[0]", "$.Read.Steps[0]"
        ),
    )
    past_deadline = sfn.Condition.number_greater_than_equals_json_path(
        "$.Alive.Waited", "$.Progress.Deadline"
    )

    def progressed(name: str, limit: str, phase: str) -> sfn.Pass:
        return sfn.Pass(
            t.scope,
            f"{p}{name}",
            parameters={
                "At": sfn.JsonPath.string_at("$.Read.Times[0]"),
                "Step": sfn.JsonPath.number_at("$.Read.Steps[0]"),
                "Phase": phase,
                "Deadline.$": f"States.MathAdd($.Alive.Waited, {limit})",
                "NextRead.$": _next_read(),
                "Stale": sfn.JsonPath.number_at("$.Progress.Stale"),
            },
            result_path="$.Progress",
        )

    def kept(name: str, stale: Any) -> sfn.Pass:
        """The same progress, read again later, with `stale` as $.Progress.Stale."""
        return sfn.Pass(
            t.scope,
            f"{p}{name}",
            parameters={
                "At": sfn.JsonPath.string_at("$.Progress.At"),
                "Step": sfn.JsonPath.number_at("$.Progress.Step"),
                "Phase": sfn.JsonPath.string_at("$.Progress.Phase"),
                "Deadline": sfn.JsonPath.number_at("$.Progress.Deadline"),
                "NextRead.$": _next_read(),
                "Stale": stale,
            },
            result_path="$.Progress",
        )

    # Nothing new and the deadline not reached.
    quiet = kept("ProgressQuiet", sfn.JsonPath.number_at("$.Progress.Stale"))
    # The first read: the highest step of the minute the nodes were ready in, or none.
    stale_seen = kept("ProgressStale", sfn.JsonPath.number_at("$.Read.Steps[0]"))
    none_seen = kept("ProgressNoneStale", -1)
    still = sfn.Choice(t.scope, f"{p}NoProgress")
    no_line = sfn.Pass(
        t.scope,
        f"{p}NoProgressLine",
        parameters={
            "Cause.$": "States.Format('no progress since the nodes were ready at {}: no "
            "progress line in {} s (CompileHangSeconds; train --compile-hang-minutes); every "
            "RunTraining command of the attempt cancelled', $.Progress.At, "
            "$.Job.CompileHangSeconds)"
        },
        result_path="$.Hang",
    )
    stalled = sfn.Pass(
        t.scope,
        f"{p}ProgressStalled",
        parameters={
            "Cause.$": "States.Format('no progress since step {} at {} (HangSeconds {}, "
            "CompileHangSeconds {}: train --hang-minutes, --compile-hang-minutes); every "
            "RunTraining command of the attempt cancelled', $.Progress.Step, $.Progress.At, "
            "$.Job.HangSeconds, $.Job.CompileHangSeconds)"
        },
        result_path="$.Hang",
    )
    still.when(sfn.Condition.number_less_than("$.Progress.Step", 0), no_line).otherwise(stalled)
    no_line.next(hang)
    stalled.next(hang)
    quiet.next(wait)
    stale_seen.next(wait)
    none_seen.next(wait)
    training = progressed("Progressed", "$.Job.HangSeconds", "training").next(wait)
    recompiled = progressed("ProgressedCompiling", "$.Job.CompileHangSeconds", "compiling")
    recompiled.next(wait)
    phase.when(compiling, recompiled).otherwise(training)
    # The same minute and step as the newest seen, now a compiling line's (a graph compiled
    # after training steps: an evaluation's, a new shape's): no new step, but a new phase, so
    # the compile limit from now ($.Progress.Phase keeps the phase of what was seen).
    recompiling = sfn.Choice(t.scope, f"{p}ProgressRecompiling")
    recompiling.when(
        sfn.Condition.and_(compiling, sfn.Condition.string_equals("$.Progress.Phase", "training")),
        recompiled,
    ).when(past_deadline, still).otherwise(quiet)
    made.when(
        sfn.Condition.and_(nothing_yet, unread, sfn.Condition.not_(later_minute)), stale_seen
    ).when(
        sfn.Condition.and_(new, sfn.Condition.is_present("$.Read.CompilingTimes[0]")), phase
    ).when(new, training).when(
        sfn.Condition.is_present("$.Read.CompilingTimes[0]"), recompiling
    ).when(past_deadline, still).otherwise(quiet)
    seen.when(sfn.Condition.is_present("$.Read.Times[0]"), made).when(
        sfn.Condition.and_(nothing_yet, unread), none_seen
    ).when(past_deadline, still).otherwise(quiet)
    read.next(seen)
    return read


def hang_result(t: SupervisorTasks, p: str) -> sfn.Pass:
    """The result of the batch whose reader ended the attempt: bad, with the hang as its one
    cause (its nodes' invocations were cancelled by it, which says nothing more)."""
    return sfn.Pass(
        t.scope,
        f"{p}HangResult",
        parameters={
            "CommandId": sfn.JsonPath.string_at("$.Command.CommandId"),
            "Classes": ["bad"],
            "Causes.$": "States.Array($.Hang.Cause)",
        },
    )
