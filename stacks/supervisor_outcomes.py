"""The job supervisor's states after an attempt: what each one does, made on first use.

`OutcomeStates` has one property per state, named after it (`retry_left` is the state
RetryLeft): the search for a StopTraining command, the retry and its counter, a new leg, the
hand-over to a successor execution, and the ends of a job (finished, failed, stopped, cannot
run) with the message each sends. Which state follows which, and every Choice's rules, are the
workflow's (stacks/supervisor_workflow.py). SupervisorStates (stacks/supervisor_states.py)
adds the states up to an attempt's outcome; the sections here follow the workflow's phases.
"""

from __future__ import annotations

from functools import cached_property

from aws_cdk import aws_stepfunctions as sfn

from stacks.supervisor_tasks import (
    StatesBase,
    SupervisorTasks,
    choice,
    fail,
    pass_state,
    succeed,
    time_parts,
    wait,
)

#: StopTraining commands read at once: each lists up to 50 instance IDs (about 2 KB), so a page
#: stays far below a task's 256 KiB result; a stop of 1,024 nodes sends 21 of them.
STOP_PAGE = 25


def _command_ids() -> str:
    """The IDs of the attempt's commands, as a string for a message."""
    return sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Outcome.CommandIds"))


def _causes() -> str:
    """What happened on each node that did not end well ($.Outcome.Causes, a list per batch of
    50 nodes: stacks/supervisor_run.py), as a string for a message."""
    return sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Outcome.Causes"))


def _why(construct_id: str, template: str, *values: str) -> cached_property[sfn.Pass]:
    """A Pass that writes $.Why.Text, a States.Format of `template`: why this execution hands
    the job over or ends it. The notification says it, the hand-over's output (HandedOver) or
    the failure's cause carries it, and `cluster.py jobs` lists it."""
    return pass_state(construct_id, "$.Why", {"Text": sfn.JsonPath.format(template, *values)})


def map_failed(
    t: SupervisorTasks, construct_id: str, map_name: str, *, cancelled: bool
) -> sfn.Pass:
    """A Pass that writes $.Outcome after the Distributed Map `map_name` failed, its error in
    $.MapFailure: the commands cancelled after it ($.Others.Ids, where `cancelled`) and the
    map's error and cause as the one cause. A child execution that fails fails the map run, by
    default at the first failure (Step Functions developer guide, "Tolerated failure threshold
    for Distributed Map states": States.ExceedToleratedFailureThreshold), whatever ended the
    child: an error of a task after its retries (SendCommand's Ssm.InvalidInstanceIdException
    for a node terminated since the group was read), States.DataLimitExceeded or a runtime
    error (States.ALL matches neither of these two in the child). The map's own error is one
    its Catch can catch."""
    cause = (
        f"States.Format('{map_name} failed ({{}}): {{}}; its failed child execution says "
        "why (Step Functions console, the map run)', $.MapFailure.Error, $.MapFailure.Cause)"
    )
    return sfn.Pass(
        t.scope,
        construct_id,
        parameters={
            "CommandIds": sfn.JsonPath.list_at("$.Others.Ids") if cancelled else [],
            "Classes": [],
            "Causes.$": f"States.Array(States.Array({cause}))",
        },
        result_path="$.Outcome",
    )


class OutcomeStates(StatesBase):
    """The states after an attempt, each made once, when the workflow first names it."""

    def _why_pass(self, construct_id: str, template: str, *values: str) -> sfn.Pass:
        """As _why, for a text that needs the cluster's settings."""
        return self._pass(
            construct_id,
            parameters={"Text": sfn.JsonPath.format(template, *values)},
            result_path="$.Why",
        )

    # The nodes run different software ------------------------------------------------------------
    @cached_property
    def notify_mixed_fleet(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyMixedFleet",
            "cannot run",
            "Job {} cannot run: its nodes run different software (preflight commands {}). "
            "Roll the fleet with `trainium-cluster roll --wait`, then resume the job with "
            "`trainium-cluster train --resume {}`.",
            self.t.job_id,
            _command_ids(),
            self.t.job_id,
        )

    nodes_differ = fail(
        "NodesDiffer",
        error="NodesRunDifferentSoftware",
        cause="the nodes run different software: roll the fleet (trainium-cluster roll "
        "--wait), then resume the job with trainium-cluster train --resume <job ID>",
    )

    # The job finished ----------------------------------------------------------------------------
    @cached_property
    def notify_finish(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyFinish",
            "finished",
            "Job {} finished on all {} nodes after {} retries and {} legs.",
            self.t.job_id,
            str(self.t.config.node_count),
            sfn.JsonPath.string_at("$.Counters.Retries"),
            sfn.JsonPath.string_at("$.Counters.Legs"),
        )

    job_finished = succeed("JobFinished")

    # A new leg -----------------------------------------------------------------------------------
    @cached_property
    def count_leg(self) -> sfn.Pass:
        return self._add_one(
            "CountLeg",
            "Legs",
            comment="A leg that ended at its time limit: resume without spending a retry.",
        )

    #: After CountLeg: Legs counts the leg that starts.
    describe_leg = pass_state(
        "DescribeLeg",
        "$.Why",
        {
            "Text.$": "States.Format('leg {} ended at its time limit and saved a checkpoint; "
            "leg {} resumes from it', States.MathAdd($.Counters.Legs, -1), $.Counters.Legs)"
        },
    )

    @cached_property
    def notify_leg(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyLeg",
            "continues",
            "Job {}: {} (commands {}).",
            self.t.job_id,
            sfn.JsonPath.string_at("$.Why.Text"),
            _command_ids(),
        )

    # Was the attempt ended by `cluster.py stop` (a StopTraining command for this job)? -----------
    @cached_property
    def stop_filter(self) -> sfn.Pass:
        """The ListCommands filters' two objects (StopFilters makes the list): ASL expands paths
        in objects, not in arrays."""
        return self._pass(
            "StopFilter",
            parameters={
                "Document": {"Key": "DocumentName", "Value": self.t.document_name("StopTraining")},
                "After": {"Key": "InvokedAfter", "Value": sfn.JsonPath.string_at("$.Nodes.Since")},
            },
            result_path="$.StopFilters",
        )

    @cached_property
    def stop_filters(self) -> sfn.Pass:
        return self._pass(
            "StopFilters",
            parameters={
                "Filters": sfn.JsonPath.array(
                    sfn.JsonPath.string_at("$.StopFilters.Document"),
                    sfn.JsonPath.string_at("$.StopFilters.After"),
                )
            },
            result_path="$.StopFilters",
        )

    def _stop_commands(self, construct_id: str, *, next_token: bool) -> sfn.TaskStateBase:
        """$.Stop: a page of the StopTraining commands sent since the nodes were ready
        (Commands) and the token of the next page (Next: [token], or [] on the last)."""
        parameters: dict[str, object] = {
            "Filters": sfn.JsonPath.list_at("$.StopFilters.Filters"),
            "MaxResults": STOP_PAGE,
        }
        if next_token:
            parameters["NextToken"] = sfn.JsonPath.string_at("$.Stop.Next[0]")
        return self.t.sdk(
            construct_id,
            "ssm",
            "listCommands",
            parameters,
            ["*"],
            iam_action="ssm:ListCommands",
            result_selector={
                "Commands": sfn.JsonPath.list_at("$.Commands"),
                # An indefinite path: [] on the last page, [token] before it.
                "Next": sfn.JsonPath.list_at("$..NextToken"),
            },
            result_path="$.Stop",
        )

    @cached_property
    def list_stop_commands(self) -> sfn.TaskStateBase:
        return self._stop_commands("ListStopCommands", next_token=False)

    @cached_property
    def list_more_stop_commands(self) -> sfn.TaskStateBase:
        return self._stop_commands("ListMoreStopCommands", next_token=True)

    any_stop_command = choice("AnyStopCommand")
    more_stop_commands = choice("MoreStopCommands")
    #: No StopTraining command for this job: a failed attempt retries, a finished one finishes.
    not_stopped = choice("NotStopped")

    @cached_property
    def stop_command_jobs(self) -> sfn.Map:
        """$.Stop.Matches: 'stop' for each command for this job, 'other' for another job's.
        ASL compares two paths only in a Choice, so each command goes through one."""
        stop_for = sfn.Choice(self.scope, "StopForThisJob")
        stop_for.when(
            sfn.Condition.string_equals_json_path("$.JobId", "$.Wanted"),
            self._pass("ThisJob", result=sfn.Result.from_string("stop")),
        ).otherwise(self._pass("OtherJob", result=sfn.Result.from_string("other")))
        stop_jobs = sfn.Map(
            self.scope,
            "StopCommandJobs",
            items_path="$.Stop.Commands",
            item_selector={
                "JobId": sfn.JsonPath.string_at("$$.Map.Item.Value.Parameters.JobId[0]"),
                "Wanted": self.t.job_id,
            },
            result_path="$.Stop.Matches",
        )
        stop_jobs.item_processor(stop_for)
        return stop_jobs

    stop_matched = pass_state(
        "StopMatched",
        "$.Stop",
        {"Stopped.$": "States.ArrayContains($.Stop.Matches, 'stop')", "Next.$": "$.Stop.Next"},
    )

    was_stopped = choice("WasStopped")

    @cached_property
    def notify_stopped(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyStopped",
            "stopped",
            "Job {} was stopped (StopTraining); not retrying.",
            self.t.job_id,
        )

    job_stopped = fail("JobStopped", error="JobStopped", cause="StopTraining ended the job")

    # A retry, or the end of the retries ----------------------------------------------------------
    retry_left = choice("RetryLeft")

    describe_failure = _why(
        "DescribeFailure",
        "attempt {} failed after {} retries: {}",
        sfn.JsonPath.string_at("$.Counters.Attempts"),
        sfn.JsonPath.string_at("$.Counters.Retries"),
        _causes(),
    )

    @cached_property
    def notify_failure(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyFailure",
            "failed",
            "Job {} failed: {} (commands {}). Read the output with `cluster.py logs --job-id {}`.",
            self.t.job_id,
            sfn.JsonPath.string_at("$.Why.Text"),
            _command_ids(),
            self.t.job_id,
        )

    #: The execution's cause is the failure in words ($.Why.Text).
    job_failed = fail("JobFailed", error="JobFailed", cause_path="$.Why.Text")

    #: A node ended with a status of the job's NoRetryStatuses (2: the job's own input is
    #: wrong): no retry can help, the job ends.
    describe_not_retried = _why(
        "DescribeNotRetried",
        "attempt {} failed with a status this job does not retry: {}",
        sfn.JsonPath.string_at("$.Counters.Attempts"),
        _causes(),
    )

    @cached_property
    def notify_not_retried(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyNotRetried",
            "failed",
            "Job {} failed, not retried: {} (commands {}). Status 2 is an input error of the job "
            "(a bad flag, missing data): fix it and train again. Read the output with "
            "`cluster.py logs --job-id {}`.",
            self.t.job_id,
            sfn.JsonPath.string_at("$.Why.Text"),
            _command_ids(),
            self.t.job_id,
        )

    @cached_property
    def count_retry(self) -> sfn.Pass:
        return self._add_one("CountRetry", "Retries")

    #: After CountRetry: Retries counts the retry that starts.
    describe_retry = _why(
        "DescribeRetry",
        "retry {} of {}: attempt {} failed: {}",
        sfn.JsonPath.string_at("$.Counters.Retries"),
        sfn.JsonPath.string_at("$.Job.MaxRetries"),
        sfn.JsonPath.string_at("$.Counters.Attempts"),
        _causes(),
    )

    @cached_property
    def notify_retry(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyRetry",
            "retries",
            "Job {}: {}. The retry resumes from the latest checkpoint once a full set of nodes "
            "passes preflight (commands {}).",
            self.t.job_id,
            sfn.JsonPath.string_at("$.Why.Text"),
            _command_ids(),
        )

    wait_before_retry = wait("WaitBeforeRetry", "$.Job.RetryDelaySeconds")

    # A long wait for nodes, and its limit (node_wait_hours) -------------------------------------
    @cached_property
    def describe_long_wait(self) -> sfn.Pass:
        return self._why_pass(
            "DescribeLongWait",
            "{} of {} nodes InService and healthy after {} polls ({} s of waiting in all); the "
            "wait goes on",
            sfn.JsonPath.string_at("$.Group.Count"),
            str(self.t.config.node_count),
            sfn.JsonPath.string_at("$.NodeWaits.Count"),
            sfn.JsonPath.string_at("$.NodeWaits.Seconds"),
        )

    @cached_property
    def notify_long_wait(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyLongWait",
            "waits for nodes",
            "Job {} waits for nodes: {}. It fails after {} hours of waiting (node_wait_hours). "
            "`cluster.py status` shows the nodes.",
            self.t.job_id,
            sfn.JsonPath.string_at("$.Why.Text"),
            str(self.t.config.node_wait_hours),
        )

    @cached_property
    def describe_wait_limit(self) -> sfn.Pass:
        return self._why_pass(
            "DescribeWaitLimit",
            "no full set of nodes: {} of {} nodes InService and healthy after {} s of waiting, "
            "the limit of the job (node_wait_hours)",
            sfn.JsonPath.string_at("$.Group.Count"),
            str(self.t.config.node_count),
            sfn.JsonPath.string_at("$.NodeWaits.Seconds"),
        )

    @cached_property
    def notify_wait_limit(self) -> sfn.TaskStateBase:
        return self.t.notify(
            "NotifyWaitLimit",
            "failed",
            "Job {} failed: {}. Resume it with `trainium-cluster train --resume` and its ID "
            "once the nodes are "
            "there (`cluster.py status`).",
            self.t.job_id,
            sfn.JsonPath.string_at("$.Why.Text"),
        )

    #: A failed job, as JobFailed (the CLI reads the error), ended by the wait for nodes.
    nodes_not_ready = fail("NodesNotReady", error="JobFailed", cause_path="$.Why.Text")

    # Handing the job over to a new execution (the history budget) --------------------------------

    @cached_property
    def hand_over(self) -> sfn.Pass:
        return self._pass(
            "HandOver",
            comment="A new leg, a retry or a long wait for nodes: a new execution goes on.",
            parameters={
                "Time": sfn.JsonPath.string_at("$$.State.EnteredTime"),
                "Carry": {
                    "Counters": sfn.JsonPath.object_at("$.Counters"),
                    "ContinuedFrom": sfn.JsonPath.string_at("$$.Execution.Id"),
                    "NodeWaited": sfn.JsonPath.number_at("$.NodeWaits.Seconds"),
                },
            },
            result_path="$.Handover",
        )

    name_successor = pass_state(
        "NameSuccessor",
        "$.Handover",
        {
            "Parts.$": "States.StringSplit($.Handover.Time, '-T:.Z')",
            "Carry.$": "$.Handover.Carry",
        },
    )
    #: The successor's name is the job ID and the UTC time, as the CLI names executions; its
    #: input, the job's settings with the counters and ContinuedFrom.
    successor_input = pass_state(
        "SuccessorInput",
        "$.Handover",
        {
            "Name.$": "States.Format('{}-{}{}{}-{}{}{}', $.Job.JobId, "
            + time_parts("$.Handover.Parts")
            + ")",
            "Input.$": "States.JsonToString(States.JsonMerge($.Job, $.Handover.Carry, false))",
        },
    )

    @cached_property
    def start_successor(self) -> sfn.TaskStateBase:
        return self.t.on_this_machine(
            "StartSuccessor",
            "startExecution",
            {
                "Name": sfn.JsonPath.string_at("$.Handover.Name"),
                "Input": sfn.JsonPath.string_at("$.Handover.Input"),
            },
            iam_action="states:StartExecution",
        )

    @cached_property
    def handed_over(self) -> sfn.Pass:
        """The execution's output: the job, the successor (ContinuedAs), the counters and why
        it handed the job over (Why: a retry and its causes, a new leg or a long wait)."""
        return self._pass(
            "HandedOver",
            parameters={
                "JobId": self.t.job_id,
                "ContinuedAs": sfn.JsonPath.string_at("$.Handover.Name"),
                "Counters": sfn.JsonPath.object_at("$.Counters"),
                "Why": sfn.JsonPath.string_at("$.Why.Text"),
            },
        )

    job_continues = succeed("JobContinues")
