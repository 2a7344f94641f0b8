"""The job supervisor's workflow: its states in the order a job meets them, and the rules that
choose between them. What each state does is in stacks/supervisor_states.py and
stacks/supervisor_outcomes.py (one property per state, named after it); the state machine
around it is stacks/supervisor.py.

    Defaults → ReadJob → ReadCounters → FreshOrContinued
    FreshOrContinued a new job → ClaimSlot → NotifyStart → ReadGroup
                    a continued job → TakeOverSlot → ReadGroup
    ClaimSlot, TakeOverSlot
                    the job queue's slot names another job or execution → DescribeRefusal
                    → JobRefused (fails)
    ReadGroup → MoreOfGroup
    MoreOfGroup     another page of IDs → ReadGroupPage → AddGroupPage → JoinGroupPage
                    → MoreOfGroup; the last → PartitionGroup → ReadNodes → CountNodes → FullSet
    ReadNodes       a child failed → ReadNodesFailed → RetryLeft
    FullSet         node_count nodes (or more) InService and HEALTHY → JoinHosts
                    otherwise → WaitForNodes → CountNodeWait → KeepWaiting
    KeepWaiting     node_wait_hours waited in all → DescribeWaitLimit → NotifyWaitLimit
                    → NodesNotReady (fails: JobFailed)
                    MAX_NODE_WAITS polls → DescribeLongWait → NotifyLongWait → HandOver
                    otherwise → ReadGroup
    JoinHosts → NodesReadyAt → SplitNodesReadyAt → NodesReady
    NodesReady → CountAttempt → Preflight (PreflightBatches … PreflightVerdict) → PreflightPassed
    PreflightPassed a mixed fleet → NotifyMixedFleet → NodesDiffer (fails)
                    a bad or replaced node → RetryLeft
                    otherwise → NewOrResumed
    NewOrResumed    a retry or a new leg → ResumeJob (Resume: resume) → RunTraining; the job's
                    first attempt → RunTraining (Resume: new, or resume for `train --resume`)
                    (RunTrainingBatches … RunTrainingVerdict) → TrainingOutcome
    PreflightBatches, RunTrainingBatches
                    a child failed → <Document>MapFailedListOtherBatches … (the attempt's
                    commands cancelled) → <Document>MapFailed → RetryLeft
    TrainingOutcome a leg end (and no bad or final node) → CountLeg → DescribeLeg → NotifyLeg
                    → HandOver
                    otherwise (a bad node, or every node done) → StopFilter → StopFilters
                    → ListStopCommands → AnyStopCommand
    AnyStopCommand  some → StopCommandJobs → StopMatched → WasStopped; none → MoreStopCommands
    WasStopped      this job's → NotifyStopped → JobStopped (fails); otherwise → MoreStopCommands
    MoreStopCommands another page → ListMoreStopCommands → AnyStopCommand; none → NotStopped
    NotStopped      a node ended with a status the job does not retry (NoRetryStatuses: 2, an
                    input error) → DescribeNotRetried → NotifyNotRetried → JobFailed (fails)
                    a bad node → RetryLeft; otherwise → NotifyFinish → JobFinished (succeeds)
    RetryLeft       none left → DescribeFailure → NotifyFailure → JobFailed (fails)
                    otherwise → CountRetry → DescribeRetry → NotifyRetry → WaitBeforeRetry
                    → HandOver
    HandOver → NameSuccessor → SuccessorInput → StartSuccessor → HandedOver
             → JobContinues (succeeds; the successor execution goes on with the job)

A Choice tries its rules in order: a failure outranks a leg end (a retry, not a new leg), and a
mixed fleet outranks a replaced node (the job ends rather than retry on nodes that differ).

Below, one function per phase joins its states and gives its Choices their rules, written in
the order above: start_the_job, wait_for_nodes, run_an_attempt (the Preflight and RunTraining
outcomes: a mixed fleet, a replaced node), after_a_leg_end, after_a_failure (the stop check,
the retry and the job's failure) and hand_over. A new state is a property of SupervisorStates
(or of OutcomeStates, after an attempt's outcome) joined in one of them.
"""

from __future__ import annotations

from aws_cdk import aws_stepfunctions as sfn

from stacks.supervisor_limits import MAX_NODE_WAITS
from stacks.supervisor_states import SupervisorStates


def definition(s: SupervisorStates, *, node_count: int, wait_seconds: int) -> sfn.IChainable:
    """The whole workflow, joined phase by phase; returns its first state."""
    # aws-cdk-lib lists the states by walking from the first one, taking a state's predecessors
    # (in the order they were joined to it) before its successors. So the order of these calls,
    # and of the joins within them, fixes the order of the states in the definition string,
    # though not what they do; it is kept as deployed (tests/test_stacks_snapshots.py):
    # ReadGroup is joined from KeepWaiting before the job's start, HandOver from a leg end
    # before a retry, RetryLeft from NotStopped, after the stop check.
    wait_for_nodes(s, node_count=node_count, wait_seconds=wait_seconds)
    first = start_the_job(s)
    run_an_attempt(s)
    after_a_leg_end(s)
    after_a_failure(s)
    hand_over(s)
    return first


def start_the_job(s: SupervisorStates) -> sfn.IChainable:
    """The job's settings over the defaults, its counters, and one job at a time per cluster:
    the job queue's dispatcher claims the queue's slot for a job before it starts the job's
    execution (stacks/job_queue.py). A new job's execution runs only where the slot names it
    and its execution name; an execution that continues a job takes the slot over from the one
    that handed the job over. Either is a conditional write: a job started outside the queue,
    or one whose slot was released, is refused in one line."""
    first = s.defaults.next(s.read_job).next(s.read_counters).next(s.fresh_or_continued)
    fresh = sfn.Condition.string_equals("$.ContinuedFrom", "")
    s.fresh_or_continued.when(fresh, s.claim_slot).otherwise(s.take_over_slot)
    s.claim_slot.next(s.notify_start)
    s.take_over_slot.next(s.read_group)
    s.describe_refusal.next(s.job_refused)
    s.notify_start.next(s.read_group)
    return first


def wait_for_nodes(s: SupervisorStates, *, node_count: int, wait_seconds: int) -> None:
    """Poll the group until `node_count` nodes (or more: JoinHosts takes node_count of them)
    are InService and HEALTHY, then build the host list; after MAX_NODE_WAITS polls a successor
    execution waits on (the operator hears of it), and after `wait_seconds` of waiting in all,
    counted in polls over the hand-overs, the job fails naming the count. The group is read
    page by page and batch by batch (stacks/supervisor_group.py)."""
    s.read_group.next(s.more_of_group)
    s.more_of_group.when(sfn.Condition.is_present("$.Group.Next[0]"), s.read_group_page).otherwise(
        s.partition_group
    )
    s.read_group_page.next(s.add_group_page).next(s.join_group_page).next(s.more_of_group)
    s.partition_group.next(s.read_nodes).next(s.count_nodes).next(s.full_set)
    # A batch's child execution failed (the map run with it): a retry, as after a failed attempt.
    s.read_nodes.add_catch(s.read_nodes_failed, errors=["States.ALL"], result_path="$.MapFailure")
    s.read_nodes_failed.next(s.retry_left)
    s.full_set.when(
        sfn.Condition.number_greater_than_equals("$.Group.Count", node_count), s.join_hosts
    ).otherwise(s.wait_for_nodes)
    s.wait_for_nodes.next(s.count_node_wait).next(s.keep_waiting)
    s.keep_waiting.when(
        sfn.Condition.number_greater_than_equals("$.NodeWaits.Seconds", wait_seconds),
        s.describe_wait_limit,
    ).when(
        sfn.Condition.number_greater_than_equals("$.NodeWaits.Count", MAX_NODE_WAITS),
        s.describe_long_wait,
    ).otherwise(s.read_group)
    s.describe_wait_limit.next(s.notify_wait_limit).next(s.nodes_not_ready)
    s.describe_long_wait.next(s.notify_long_wait).next(s.hand_over)

    # The host list "a,b,c" in one state (stacks/supervisor_states.py, host_list_format).
    s.join_hosts.next(s.nodes_ready_at).next(s.split_nodes_ready_at).next(s.nodes_ready)


def run_an_attempt(s: SupervisorStates) -> None:
    """Preflight on every node, then RunTraining on every node, and what their verdicts lead to:
    a mixed fleet ends the job, a bad or replaced node is a failure, a bad training node is
    a failure (unless the job was stopped), every node at its time limit is a leg end, and
    every node done is the job finished."""
    s.nodes_ready.next(s.count_attempt).next(s.preflight.start)
    s.preflight.end.next(s.preflight_passed)
    s.preflight_passed.when(
        sfn.Condition.boolean_equals("$.Verdict.Roll", True), s.notify_mixed_fleet
    ).when(
        sfn.Condition.or_(
            sfn.Condition.boolean_equals("$.Verdict.Bad", True),
            sfn.Condition.boolean_equals("$.Verdict.Replaced", True),
        ),
        s.retry_left,
    ).otherwise(s.new_or_resumed)
    s.new_or_resumed.when(
        sfn.Condition.or_(
            sfn.Condition.number_greater_than("$.Counters.Attempts", 1),
            sfn.Condition.number_greater_than("$.Counters.Legs", 1),
        ),
        s.resume_job,
    ).otherwise(s.run_training.start)
    s.resume_job.next(s.run_training.start)
    s.notify_mixed_fleet.next(s.nodes_differ)
    # A batch's child execution failed, and with it the map run: the attempt's commands are
    # cancelled (stacks/supervisor_run.py), then a retry.
    s.preflight.failed.next(s.retry_left)

    s.run_training.end.next(s.training_outcome)
    # Every node done is a finish only if no StopTraining for the job came meanwhile: the
    # trainers save and exit 0 on a stop (cluster.py stop), so a stop can look like a finish.
    # A status the job does not retry (NoRetryStatuses: 2, an input error) outranks a leg end.
    s.training_outcome.when(
        sfn.Condition.or_(
            sfn.Condition.boolean_equals("$.Verdict.Bad", True),
            sfn.Condition.boolean_equals("$.Verdict.Final", True),
        ),
        s.stop_filter,
    ).when(sfn.Condition.boolean_equals("$.Verdict.Leg", True), s.count_leg).otherwise(
        s.stop_filter
    )
    s.run_training.failed.next(s.retry_left)


def after_a_leg_end(s: SupervisorStates) -> None:
    """Every node ended its leg at the time limit with a checkpoint: the next leg resumes from
    it without spending a retry."""
    s.count_leg.next(s.describe_leg).next(s.notify_leg).next(s.hand_over)


def after_a_failure(s: SupervisorStates) -> None:
    """A failed or finished training attempt: was it `cluster.py stop` (a StopTraining command
    for this job since the nodes were ready, on any page of ListCommands)? Then the job ends
    stopped, not retried and not finished. Otherwise a finished attempt finishes the job; a
    failed one, and a failed preflight, retries with resume while MaxRetries allows, then the
    job fails."""
    s.stop_filter.next(s.stop_filters).next(s.list_stop_commands).next(s.any_stop_command)
    s.stop_command_jobs.next(s.stop_matched).next(s.was_stopped)
    s.was_stopped.when(
        sfn.Condition.boolean_equals("$.Stop.Stopped", True), s.notify_stopped
    ).otherwise(s.more_stop_commands)
    s.notify_stopped.next(s.job_stopped)
    # A filter that matches nothing reads as [] in Step Functions; StopCommandJobs is asked
    # only when there is a StopTraining command at all.
    s.any_stop_command.when(
        sfn.Condition.is_present("$.Stop.Commands[0]"), s.stop_command_jobs
    ).otherwise(s.more_stop_commands)
    s.more_stop_commands.when(
        sfn.Condition.is_present("$.Stop.Next[0]"), s.list_more_stop_commands
    ).otherwise(s.not_stopped)
    s.list_more_stop_commands.next(s.any_stop_command)
    # A node's status the job does not retry (an input error) ends it, whatever the others did.
    s.not_stopped.when(
        sfn.Condition.boolean_equals("$.Verdict.Final", True), s.describe_not_retried
    ).when(sfn.Condition.boolean_equals("$.Verdict.Bad", True), s.retry_left).otherwise(
        s.notify_finish
    )
    s.notify_finish.next(s.job_finished)
    s.describe_not_retried.next(s.notify_not_retried).next(s.job_failed)

    s.retry_left.when(
        sfn.Condition.number_greater_than_equals_json_path(
            "$.Counters.Retries", "$.Job.MaxRetries"
        ),
        s.describe_failure,
    ).otherwise(s.count_retry)
    s.describe_failure.next(s.notify_failure).next(s.job_failed)
    s.count_retry.next(s.describe_retry).next(s.notify_retry).next(s.wait_before_retry).next(
        s.hand_over
    )


def hand_over(s: SupervisorStates) -> None:
    """A new leg, a retry or a long wait for nodes: this execution starts its successor with the
    job's settings and counters and ends (the history budget, stacks/supervisor.py)."""
    s.hand_over.next(s.name_successor).next(s.successor_input).next(s.start_successor).next(
        s.handed_over
    ).next(s.job_continues)
