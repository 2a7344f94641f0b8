"""The job supervisor's states up to an attempt's outcome: what each one does, made on first use.

`SupervisorStates` has one property per state, named after it (`read_group` is the state
ReadGroup), in the order a job meets them: the job's settings and counters, the wait for a full
set of nodes and the host list, Preflight and RunTraining. A property holds what its state
reads and writes and the SDK call or message it makes; which state follows which, and every
Choice's rules, are the workflow's (stacks/supervisor_workflow.py), so a Choice is made here
with no rules and a Pass or a task with no next state. Preflight and RunTraining come from the
building block in stacks/supervisor_run.py; the states after an attempt's outcome, from
OutcomeStates (stacks/supervisor_outcomes.py), the base class.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from aws_cdk import aws_stepfunctions as sfn

from stacks.supervisor_group import read_batches, read_tags
from stacks.supervisor_limits import (
    DEFAULT_COMPILE_HANG_SECONDS,
    DEFAULT_HANG_SECONDS,
    DEFAULT_POLL_SECONDS,
    PROGRESS_READ_SECONDS,
    SEND_BATCH,
)
from stacks.supervisor_outcomes import OutcomeStates, map_failed
from stacks.supervisor_run import Run, from_job, run_on_every_node
from stacks.supervisor_tasks import choice, fail, pass_state, time_parts, wait

#: DynamoDB's conditional-write failure as Step Functions names it (ServiceName.ErrorName).
SLOT_NOT_HELD = "DynamoDb.ConditionalCheckFailedException"

#: What an execution's input may set, with its default (the CLI passes JobId, CodeSnapshot,
#: which has no default, EntryPoint, DataPath and TrainArgs). Every attempt and leg of the
#: job, and every execution it is handed over to, sends the same CodeSnapshot.
JOB_DEFAULTS: dict[str, Any] = {
    "EntryPoint": "-m workload.train",
    "DataPath": "",
    "TrainArgs": "",
    "MasterPort": "29500",
    "NprocPerNode": "auto",
    "PreflightPort": "29600",
    "MaxRetries": 2,
    "PollSeconds": DEFAULT_POLL_SECONDS,
    "RetryDelaySeconds": 60,
    # How long the other nodes may run on after one node's invocation ended before the rest of
    # the attempt is cancelled (a data-parallel job cannot go on without a rank).
    "FailureGraceSeconds": 300,
    # How long RunTraining may go without a progress line before the attempt ends and is
    # retried: in training, and while compiling (stacks/supervisor_progress.py says why).
    "HangSeconds": DEFAULT_HANG_SECONDS,
    "CompileHangSeconds": DEFAULT_COMPILE_HANG_SECONDS,
    # The least time between two reads of the job's progress (the history budget counts them:
    # stacks/supervisor_limits.py min_poll_seconds).
    "ProgressReadSeconds": PROGRESS_READ_SECONDS,
    # RunTraining statuses that end the job without a retry: 2, the contract's input error
    # (launch.sh passes on a trainer's status 2 to 127 but 75); `train --no-retry-on` and
    # `--retry-on` change the list (INPUT_ERROR_STATUS in stacks/supervisor_run.py).
    "NoRetryStatuses": [2],
    # RunTraining's Resume on the job's first attempt: new (launch.sh refuses a job ID whose
    # directory holds a checkpoint), or resume (`train --resume`). Every later attempt and
    # leg resumes (NewOrResumed).
    "Resume": "new",
}

#: The RunTraining document's parameters the supervisor takes from the job (Hosts, and the
#: time limits, come from its own states).
RUN_TRAINING_PARAMETERS = (
    "JobId", "MasterPort", "NprocPerNode", "CodeSnapshot", "EntryPoint", "DataPath", "TrainArgs",
    "Resume",
)  # fmt: skip


def host_list_format(path: str, count: int) -> str:
    """States.Format of the `count` items of the array at `path`, joined by commas: no history
    event per node (a loop of one Pass and one Choice per address wrote four). Intrinsic
    functions nest up to 10 deep (Step Functions, intrinsic functions); this nests two, and the
    Format's template and arguments grow by about 45 characters a node (47 KB at 1,024, of the
    1 MB a definition may have: Step Functions quotas)."""
    template = ",".join(["{}"] * count)
    items = ", ".join(f"States.ArrayGetItem({path}, {i})" for i in range(count))
    return f"States.Format('{template}', {items})"


class SupervisorStates(OutcomeStates):
    """Every state of the job supervisor, each made once, when the workflow first names it: the
    ones up to an attempt's outcome here, the ones after it in OutcomeStates."""

    # The job: its settings, its counters, one job at a time --------------------------------------
    @cached_property
    def defaults(self) -> sfn.Pass:
        # An execution that continues a job (stacks/supervisor.py) gets the counters and
        # ContinuedFrom in its input; a new job starts them afresh.
        return self._pass(
            "Defaults",
            parameters={
                "Defaults": JOB_DEFAULTS,
                "Fresh": {
                    "Counters": {"Retries": 0, "Legs": 1, "Attempts": 0},
                    "ContinuedFrom": "",
                    # The seconds the job has waited for nodes so far (a long wait's successor).
                    "NodeWaited": 0,
                },
                "Input": sfn.JsonPath.object_at("$"),
            },
        )

    @cached_property
    def read_job(self) -> sfn.Pass:
        merge, given = sfn.JsonPath.json_merge, sfn.JsonPath.object_at("$.Input")
        return self._pass(
            "ReadJob",
            comment="The execution input over the defaults.",
            parameters={
                "Job": merge(sfn.JsonPath.object_at("$.Defaults"), given),
                "Carried": merge(sfn.JsonPath.object_at("$.Fresh"), given),
            },
        )

    @cached_property
    def read_counters(self) -> sfn.Pass:
        return self._pass(
            "ReadCounters",
            parameters={
                "Job": sfn.JsonPath.object_at("$.Job"),
                "Counters": sfn.JsonPath.object_at("$.Carried.Counters"),
                "ContinuedFrom": sfn.JsonPath.string_at("$.Carried.ContinuedFrom"),
                "NodeWaits": {
                    "Count": 0,
                    "Seconds": sfn.JsonPath.number_at("$.Carried.NodeWaited"),
                },
            },
        )

    @cached_property
    def claim_slot(self) -> sfn.TaskStateBase:
        """A new job runs only where the job queue's slot names it and this execution (the
        dispatcher claimed the slot for it, stacks/job_queue.py); the slot records its ARN. The
        conditional write is atomic (DynamoDB developer guide, condition expressions), where
        ListExecutions is eventually consistent."""
        return self._slot(
            "ClaimSlot",
            "SET ExecutionArn = :arn",
            "JobId = :job AND ExecutionName = :name",
            {},
        )

    @cached_property
    def take_over_slot(self) -> sfn.TaskStateBase:
        """An execution that continues a job names itself in the slot, in place of the one
        that handed the job over (the last part of ContinuedFrom, an execution ARN)."""
        return self._slot(
            "TakeOverSlot",
            "SET ExecutionName = :name, ExecutionArn = :arn",
            "JobId = :job AND ExecutionName = :from",
            {
                ":from": {
                    "S": sfn.JsonPath.array_get_item(
                        sfn.JsonPath.string_split(sfn.JsonPath.string_at("$.ContinuedFrom"), ":"),
                        7,
                    )
                }
            },
        )

    def _slot(
        self, construct_id: str, update: str, condition: str, values: dict[str, Any]
    ) -> sfn.TaskStateBase:
        table = self.t.queue_table
        task = self.t.sdk(
            construct_id,
            "dynamodb",
            "updateItem",
            {
                "TableName": table.table_name,
                "Key": {"Pk": {"S": "slot"}, "Sk": {"S": "slot"}},
                "UpdateExpression": update,
                "ConditionExpression": condition,
                "ExpressionAttributeValues": {
                    ":job": {"S": self.t.job_id},
                    ":name": {"S": sfn.JsonPath.string_at("$$.Execution.Name")},
                    ":arn": {"S": sfn.JsonPath.string_at("$$.Execution.Id")},
                    **values,
                },
            },
            [table.table_arn],
            iam_action="dynamodb:UpdateItem",
            final_errors=[SLOT_NOT_HELD],
        )
        task.add_catch(self.describe_refusal, errors=[SLOT_NOT_HELD], result_path="$.Slot")
        return task

    fresh_or_continued = choice("FreshOrContinued")

    @cached_property
    def describe_refusal(self) -> sfn.Pass:
        return self._pass(
            "DescribeRefusal",
            parameters={
                "Cause": sfn.JsonPath.format(
                    "the job queue slot does not name job {} and execution {}: jobs start "
                    "through the queue (cluster.py train), one at a time",
                    self.t.job_id,
                    sfn.JsonPath.string_at("$$.Execution.Name"),
                )
            },
            result_path="$.Refusal",
        )

    job_refused = fail("JobRefused", error="JobNotDispatched", cause_path="$.Refusal.Cause")

    @cached_property
    def notify_start(self) -> sfn.TaskStateBase:
        config = self.t.config
        return self.t.notify(
            "NotifyStart",
            "started",
            "Job {} started on {} nodes of {} (up to {} retries).",
            self.t.job_id,
            str(config.node_count),
            config.cluster_name,
            sfn.JsonPath.string_at("$.Job.MaxRetries"),
        )

    # Waiting for a full set of nodes -------------------------------------------------------------
    # The group is read in narrow steps that fit a task's result at 1,024 nodes
    # (stacks/supervisor_group.py): its instance IDs from their tags, page by page, then per
    # batch of 50 which are InService and HEALTHY, and their addresses.
    @cached_property
    def read_group(self) -> sfn.TaskStateBase:
        """$.Group: the first page of the group's instance IDs, and the token of the next."""
        return read_tags(self.t, "ReadGroup", next_token=False)

    more_of_group = choice("MoreOfGroup")

    @cached_property
    def read_group_page(self) -> sfn.TaskStateBase:
        """$.Page: the next page of IDs."""
        return read_tags(self.t, "ReadGroupPage", next_token=True)

    #: The IDs so far and the page's, as a list of the two lists; JoinGroupPage flattens it
    #: (ASL has no intrinsic that joins arrays).
    add_group_page = pass_state(
        "AddGroupPage",
        "$.Group",
        {"Ids.$": "States.Array($.Group.Ids, $.Page.Ids)", "Next.$": "$.Page.Next"},
    )

    join_group_page = pass_state(
        "JoinGroupPage", "$.Group", {"Ids.$": "$.Group.Ids[*][*]", "Next.$": "$.Group.Next"}
    )

    partition_group = pass_state(
        "PartitionGroup",
        "$.Group",
        {"Batches.$": f"States.ArrayPartition($.Group.Ids, {SEND_BATCH})"},
    )

    @cached_property
    def read_nodes(self) -> sfn.DistributedMap:
        """$.Group: the IDs and addresses of the nodes that are InService and HEALTHY."""
        return read_batches(self.t)

    @cached_property
    def read_nodes_failed(self) -> sfn.Pass:
        """$.Outcome after ReadNodes failed (its error in $.MapFailure): no command runs yet."""
        return map_failed(self.t, "ReadNodesFailed", "ReadNodes", cancelled=False)

    @cached_property
    def count_nodes(self) -> sfn.Pass:
        ids = sfn.JsonPath.list_at("$.Group.Ids")
        return self._pass(
            "CountNodes",
            parameters={
                "Ids": ids,
                "Addresses": sfn.JsonPath.list_at("$.Group.Addresses"),
                "Count": sfn.JsonPath.array_length(ids),
            },
            result_path="$.Group",
        )

    full_set = choice("FullSet")

    wait_for_nodes = wait("WaitForNodes", "$.Job.PollSeconds")

    #: The polls of this execution, and the seconds waited for nodes in all, counted in polls
    #: (each adds its PollSeconds) and carried over a long wait's hand-over.
    count_node_wait = pass_state(
        "CountNodeWait",
        "$.NodeWaits",
        {
            "Count.$": "States.MathAdd($.NodeWaits.Count, 1)",
            "Seconds.$": "States.MathAdd($.NodeWaits.Seconds, $.Job.PollSeconds)",
        },
    )

    keep_waiting = choice("KeepWaiting")

    @cached_property
    def join_hosts(self) -> sfn.Pass:
        """$.Group: the IDs and the host list "a,b,c" (in place of the addresses), in one state,
        of the first node_count nodes in the order the group was read (FullSet waits for at
        least that many: a group with more InService, healthy nodes than the job needs runs it
        on node_count of them, the same ones for the same answers). ASL has no join, but the
        number of addresses is fixed at synthesis, so one States.Format with a placeholder per
        node does it (host_list_format), and a JSONPath slice takes as many IDs."""
        nodes = self.t.config.node_count
        ids = sfn.JsonPath.list_at(f"$.Group.Ids[0:{nodes}]")
        hosts = host_list_format("$.Group.Addresses", nodes)
        return self._pass(
            "JoinHosts", parameters={"Ids": ids, "Hosts.$": hosts}, result_path="$.Group"
        )

    @cached_property
    def nodes_ready_at(self) -> sfn.Pass:
        return self._pass(
            "NodesReadyAt",
            parameters={"Time": sfn.JsonPath.string_at("$$.State.EnteredTime")},
            result_path="$.Since",
        )

    #: 2026-11-23T10:00:00.123Z: 2026, 11, 23, 10, 00, 00, 123.
    split_nodes_ready_at = pass_state(
        "SplitNodesReadyAt", "$.Since", {"Parts.$": "States.StringSplit($.Since.Time, '-T:.Z')"}
    )

    @cached_property
    def nodes_ready(self) -> sfn.Pass:
        """The attempt's state from here on: the job, its counters, ContinuedFrom and $.Nodes
        (the host list, the batches of SendCommand and the time the nodes were ready, from which
        a StopTraining command counts). What only the wait for nodes needed ($.Group, the running
        executions) stays behind, and its count starts again from 0: at 1,024 nodes each list
        of IDs is about 22 KB of a state's 256 KiB (tests/test_supervisor.py measures the
        payloads)."""
        return self._pass(
            "NodesReady",
            parameters={
                "Job": sfn.JsonPath.object_at("$.Job"),
                "Counters": sfn.JsonPath.object_at("$.Counters"),
                "ContinuedFrom": sfn.JsonPath.string_at("$.ContinuedFrom"),
                # The wait for nodes ended: a later hand-over carries no waiting time.
                "NodeWaits": {"Count": 0, "Seconds": 0},
                "Nodes": {
                    "Hosts": sfn.JsonPath.string_at("$.Group.Hosts"),
                    "Batches.$": f"States.ArrayPartition($.Group.Ids, {SEND_BATCH})",
                    # ListCommands' InvokedAfter takes "2024-07-07T00:00:00Z" (SSM API
                    # reference, CommandFilter): the time without its milliseconds.
                    "Since.$": "States.Format('{}-{}-{}T{}:{}:{}Z', "
                    + time_parts("$.Since.Parts")
                    + ")",
                },
            },
        )

    # An attempt: preflight, then training --------------------------------------------------------
    @cached_property
    def count_attempt(self) -> sfn.Pass:
        return self._add_one("CountAttempt", "Attempts")

    @cached_property
    def preflight(self) -> Run:
        return run_on_every_node(
            self.t,
            "Preflight",
            {"Port": from_job("PreflightPort")},
            comment="{} preflight {}",
        )

    preflight_passed = choice("PreflightPassed")

    #: The job's first attempt runs with the job's Resume (new, unless `train --resume`); a
    #: retry or a new leg (Attempts or Legs past 1) resumes, and so do the job's successors
    #: (they carry $.Job).
    new_or_resumed = choice("NewOrResumed")

    @cached_property
    def resume_job(self) -> sfn.Pass:
        return self._pass(
            "ResumeJob", result=sfn.Result.from_string("resume"), result_path="$.Job.Resume"
        )

    @cached_property
    def run_training(self) -> Run:
        return run_on_every_node(
            self.t,
            "RunTraining",
            {name: from_job(name) for name in RUN_TRAINING_PARAMETERS},
            comment="{} attempt {}",
        )

    training_outcome = choice("TrainingOutcome")
