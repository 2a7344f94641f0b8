"""The job supervisor: AWS Step Functions standard executions that run each training job.

It supervises a job in AWS rather than on the operator's machine, so a job keeps its supervision
when that machine sleeps or its credentials expire: wait for a full set of bootstrapped nodes,
run Preflight, run RunTraining on every node with the same job ID and the full host list, follow
the invocations, and on a failure retry with resume (the same job ID) up to the job's limit; a
leg that ended at its time limit (contract C4: every node Success or ResponseCode 75) continues
without spending a retry, a job stopped with StopTraining is not retried, a node whose preflight
exits 3 (a Neuron hardware error) is marked unhealthy so the Auto Scaling group replaces it, and
a preflight that exits 4 (the nodes run different software) ends the job without spending
retries: only a roll helps. The cluster's SNS topic hears of the start, each retry, each new
leg, a stop, the failure, a mixed fleet and the finish.

Everything is Amazon States Language (JSONPath) with AWS SDK service integrations; no Lambda
function is needed. The two things ASL has no function for are built from what it has: the
comma-separated host list (there is no States.ArrayJoin) is built by a short loop of
States.Format, and "every invocation ended Success or 75" is decided per invocation by a Choice
inside a Map and then summed up with States.ArrayContains.

History budget: a standard execution keeps at most 25,000 events. So that a job of any length
fits, an execution follows at most one attempt: at every new leg, every retry and after
MAX_NODE_WAITS polls for nodes it starts a new execution of this state machine with the job's
settings and counters (ContinuedFrom names the one before) and ends SUCCEEDED with ContinuedAs
in its output; the CLI follows the chain. stacks/supervisor_limits.py holds the arithmetic (the
CLI refuses a PollSeconds at which one attempt would not fit).
"""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_ssm as ssm
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk.region_info import RegionInfo
from constructs import Construct

from stacks.config import CLUSTER_TAG_KEY, ClusterConfig
from stacks.log_groups import retention
from stacks.nag import acknowledge
from stacks.supervisor_limits import DEFAULT_POLL_SECONDS, MAX_NODE_WAITS, SEND_BATCH
from stacks.supervisor_run import (
    LEG_TIME_LIMIT_STATUS,
    REPLACE_NODE_STATUS,
    ROLL_FLEET_STATUS,
    from_job,
    run_on_every_node,
)
from stacks.supervisor_tasks import SupervisorTasks

__all__ = ["LEG_TIME_LIMIT_STATUS", "REPLACE_NODE_STATUS", "ROLL_FLEET_STATUS", "JobSupervisor"]

#: What an execution's input may set, with its default (the CLI passes JobId and TrainArgs).
JOB_DEFAULTS: dict[str, Any] = {
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
}


class JobSupervisor(Construct):
    """The state machine, its role (this cluster's resources only) and its log group."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        documents: dict[str, ssm.CfnDocument],
        training_log_group: logs.ILogGroup,
        topic: sns.ITopic,
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        self.config = config
        self.documents = documents
        self.training_log_group = training_log_group
        self.topic = topic
        stack = cdk.Stack.of(self)
        self.state_machine_name = f"{config.cluster_name}-jobs"
        # Known before the state machine exists, so the role may name it without a cycle.
        self.state_machine_arn = stack.format_arn(
            service="states",
            resource="stateMachine",
            resource_name=self.state_machine_name,
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )
        self.log_group = logs.LogGroup(
            self,
            "ExecutionLogGroup",
            # Vended-logs prefix: Step Functions log delivery keeps its resource policy small.
            log_group_name=f"/aws/vendedlogs/states/{self.state_machine_name}",
            retention=retention(config.log_retention_days),
            encryption_key=key,
            removal_policy=cdk.RemovalPolicy.RETAIN
            if config.retain_data
            else cdk.RemovalPolicy.DESTROY,
        )
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("states.amazonaws.com"),
            description=f"{config.cluster_name}: the job supervisor's state machine",
        )
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=self.state_machine_name,
            state_machine_type=sfn.StateMachineType.STANDARD,
            definition_body=sfn.DefinitionBody.from_chainable(
                self._definition(
                    SupervisorTasks(
                        scope=self,
                        config=config,
                        documents=documents,
                        training_log_group=training_log_group,
                        topic=topic,
                        role=self.role,
                        state_machine_arn=self.state_machine_arn,
                    )
                )
            ),
            role=self.role,
            # Execution data (job ID, train arguments, command IDs) is what an operator reads.
            logs=sfn.LogOptions(
                destination=self.log_group, level=sfn.LogLevel.ALL, include_execution_data=True
            ),
            tracing_enabled=True,
            comment=f"{config.cluster_name}: one training job per execution",
        )
        # aws-cdk-lib makes the state machine depend on its role and the role's policy, and
        # also reads the role's ARN: cfn-lint W3005 calls the first dependency redundant. It is
        # harmless, and the policy dependency (which no GetAtt gives) must stay.
        machine = self.state_machine.node.default_child
        assert isinstance(machine, cdk.CfnResource)
        machine.add_metadata("cfn-lint", {"config": {"ignore_checks": ["W3005"]}})
        # The topic is encrypted with the operations key: publishing needs a data key.
        key.grant(self.role, "kms:Decrypt", "kms:GenerateDataKey*")
        self._announce_ends()
        self._acknowledge()

    # --------------------------------------------------------------- definition
    def _definition(self, t: SupervisorTasks) -> sfn.IChainable:
        config = self.config
        job_id = sfn.JsonPath.string_at("$.Job.JobId")
        # An execution that continues a job (see the module's docstring) gets the counters and
        # ContinuedFrom in its input; a new job starts them afresh.
        with_defaults = sfn.Pass(
            self,
            "Defaults",
            parameters={
                "Defaults": JOB_DEFAULTS,
                "Fresh": {
                    "Counters": {"Retries": 0, "Legs": 1, "Attempts": 0},
                    "ContinuedFrom": "",
                },
                "Input": sfn.JsonPath.object_at("$"),
            },
        )
        defaults = sfn.Pass(
            self,
            "ReadJob",
            comment="The execution input over the defaults.",
            parameters={
                "Job": sfn.JsonPath.json_merge(
                    sfn.JsonPath.object_at("$.Defaults"), sfn.JsonPath.object_at("$.Input")
                ),
                "Carried": sfn.JsonPath.json_merge(
                    sfn.JsonPath.object_at("$.Fresh"), sfn.JsonPath.object_at("$.Input")
                ),
            },
        )
        counters = sfn.Pass(
            self,
            "ReadCounters",
            parameters={
                "Job": sfn.JsonPath.object_at("$.Job"),
                "Counters": sfn.JsonPath.object_at("$.Carried.Counters"),
                "ContinuedFrom": sfn.JsonPath.string_at("$.Carried.ContinuedFrom"),
                "NodeWaits": {"Count": 0},
            },
        )
        # One job at a time per cluster: refused rather than queued, because a queued job would
        # hold an execution (and its history) for as long as the running one trains, and the
        # operator who started it is better told at once which job has the nodes.
        running = t.sdk(
            "ListRunningJobs",
            "sfn",
            "listExecutions",
            {
                "StateMachineArn": sfn.JsonPath.string_at("$$.StateMachine.Id"),
                "StatusFilter": "RUNNING",
            },
            [self.state_machine_arn],
            iam_action="states:ListExecutions",
            result_selector={
                "Count": sfn.JsonPath.array_length(sfn.JsonPath.list_at("$.Executions")),
                "Names": sfn.JsonPath.list_at("$.Executions[*].Name"),
            },
            result_path="$.Running",
        )
        refuse = sfn.Pass(
            self,
            "DescribeRefusal",
            parameters={
                "Cause": sfn.JsonPath.format(
                    "another job runs on this cluster; one job at a time (running jobs: {})",
                    sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Running.Names")),
                )
            },
            result_path="$.Refusal",
        ).next(
            sfn.Fail(self, "JobRefused", error="JobAlreadyRunning", cause_path="$.Refusal.Cause")
        )
        notify_start = t.notify(
            "NotifyStart",
            "started",
            "Job {} started on {} nodes of {} (up to {} retries).",
            job_id,
            str(config.node_count),
            config.cluster_name,
            sfn.JsonPath.string_at("$.Job.MaxRetries"),
        )

        # Waiting for a full set of nodes ------------------------------------------------
        # InService in the group means the node's bootstrap completed the launch lifecycle hook
        # (contract C2); Healthy, that nothing asked the group to replace it.
        read_group = t.sdk(
            "ReadGroup",
            "autoscaling",
            "describeAutoScalingGroups",
            {"AutoScalingGroupNames": [config.auto_scaling_group_name]},
            ["*"],
            iam_action="autoscaling:DescribeAutoScalingGroups",
            result_selector={
                "InService.$": (
                    "$.AutoScalingGroups[0].Instances[?(@.LifecycleState == 'InService')]"
                )
            },
            result_path="$.Group",
        )
        healthy = sfn.Pass(
            self,
            "SelectHealthy",
            parameters={"Ids.$": "$.Group.InService[?(@.HealthStatus == 'Healthy')].InstanceId"},
            result_path="$.Group",
        )
        count = sfn.Pass(
            self,
            "CountNodes",
            parameters={
                "Ids": sfn.JsonPath.list_at("$.Group.Ids"),
                "Count": sfn.JsonPath.array_length(sfn.JsonPath.list_at("$.Group.Ids")),
            },
            result_path="$.Group",
        )
        wait_nodes = sfn.Wait(
            self,
            "WaitForNodes",
            time=sfn.WaitTime.seconds_path("$.Job.PollSeconds"),
        )
        addresses = t.sdk(
            "ReadAddresses",
            "ec2",
            "describeInstances",
            {"InstanceIds": sfn.JsonPath.list_at("$.Group.Ids")},
            ["*"],
            iam_action="ec2:DescribeInstances",
            result_selector={
                "Ids": sfn.JsonPath.list_at("$.Reservations[*].Instances[*].InstanceId"),
                "Addresses": sfn.JsonPath.list_at(
                    "$.Reservations[*].Instances[*].PrivateIpAddress"
                ),
            },
            result_path="$.Nodes",
        )
        # ASL has no join: the host list "a,b,c" is built one address at a time.
        first_host = sfn.Pass(
            self,
            "StartHostList",
            parameters={
                "Hosts": sfn.JsonPath.array_get_item(sfn.JsonPath.list_at("$.Nodes.Addresses"), 0),
                "Index": 1,
            },
            result_path="$.Join",
        )
        add_host = sfn.Pass(
            self,
            "AddHost",
            parameters={
                "Hosts.$": "States.Format('{},{}', $.Join.Hosts, "
                "States.ArrayGetItem($.Nodes.Addresses, $.Join.Index))",
                "Index.$": "States.MathAdd($.Join.Index, 1)",
            },
            result_path="$.Join",
        )
        nodes_ready = sfn.Pass(
            self,
            "NodesReady",
            parameters={
                "Ids": sfn.JsonPath.list_at("$.Nodes.Ids"),
                "Hosts": sfn.JsonPath.string_at("$.Join.Hosts"),
                "Batches.$": f"States.ArrayPartition($.Nodes.Ids, {SEND_BATCH})",
                # ListCommands' InvokedAfter takes "2024-07-07T00:00:00Z" (SSM API reference,
                # CommandFilter): the time without its milliseconds.
                "Since.$": "States.Format('{}-{}-{}T{}:{}:{}Z', "
                + ", ".join(f"States.ArrayGetItem($.Since.Parts, {i})" for i in range(6))
                + ")",
            },
            result_path="$.Nodes",
        )
        since = sfn.Pass(
            self,
            "NodesReadyAt",
            parameters={"Time": sfn.JsonPath.string_at("$$.State.EnteredTime")},
            result_path="$.Since",
        )
        since.next(
            sfn.Pass(
                self,
                "SplitNodesReadyAt",
                # 2026-11-23T10:00:00.123Z: 2026, 11, 23, 10, 00, 00, 123.
                parameters={"Parts.$": "States.StringSplit($.Since.Time, '-T:.Z')"},
                result_path="$.Since",
            )
        ).next(nodes_ready)
        more_hosts = sfn.Choice(self, "MoreHosts")
        more_hosts.when(
            sfn.Condition.number_less_than("$.Join.Index", config.node_count), add_host
        ).otherwise(since)
        add_host.next(more_hosts)
        full_set = sfn.Choice(self, "FullSet")
        full_set.when(
            sfn.Condition.number_equals("$.Group.Count", config.node_count), addresses
        ).otherwise(wait_nodes)
        count_wait = sfn.Pass(
            self,
            "CountNodeWait",
            parameters={"Count.$": "States.MathAdd($.NodeWaits.Count, 1)"},
            result_path="$.NodeWaits",
        )
        keep_waiting = sfn.Choice(self, "KeepWaiting")
        wait_nodes.next(count_wait).next(keep_waiting)
        read_group.next(healthy).next(count).next(full_set)
        addresses.next(first_host).next(more_hosts)

        # Handing the job over to a new execution (the history budget) ----------------------
        hand_over = sfn.Pass(
            self,
            "HandOver",
            comment="A new leg, a retry or a long wait for nodes: a new execution goes on.",
            parameters={
                "Time": sfn.JsonPath.string_at("$$.State.EnteredTime"),
                "Carry": {
                    "Counters": sfn.JsonPath.object_at("$.Counters"),
                    "ContinuedFrom": sfn.JsonPath.string_at("$$.Execution.Id"),
                },
            },
            result_path="$.Handover",
        )
        # The successor's name is the job ID and the UTC time, as the CLI names executions:
        # 2026-11-23T10:00:00.123Z splits into 2026, 11, 23, 10, 00, 00, 123.
        stamp = ", ".join(f"States.ArrayGetItem($.Handover.Parts, {i})" for i in range(6))
        successor_name = sfn.Pass(
            self,
            "NameSuccessor",
            parameters={
                "Parts.$": "States.StringSplit($.Handover.Time, '-T:.Z')",
                "Carry": sfn.JsonPath.object_at("$.Handover.Carry"),
            },
            result_path="$.Handover",
        )
        successor_input = sfn.Pass(
            self,
            "SuccessorInput",
            parameters={
                "Name.$": f"States.Format('{{}}-{{}}{{}}{{}}-{{}}{{}}{{}}', $.Job.JobId, {stamp})",
                "Input.$": "States.JsonToString(States.JsonMerge($.Job, $.Handover.Carry, false))",
            },
            result_path="$.Handover",
        )
        start_successor = t.sdk(
            "StartSuccessor",
            "sfn",
            "startExecution",
            {
                "StateMachineArn": sfn.JsonPath.string_at("$$.StateMachine.Id"),
                "Name": sfn.JsonPath.string_at("$.Handover.Name"),
                "Input": sfn.JsonPath.string_at("$.Handover.Input"),
            },
            [self.state_machine_arn],
            iam_action="states:StartExecution",
        )
        handed_over = sfn.Pass(
            self,
            "HandedOver",
            parameters={
                "JobId": sfn.JsonPath.string_at("$.Job.JobId"),
                "ContinuedAs": sfn.JsonPath.string_at("$.Handover.Name"),
                "Counters": sfn.JsonPath.object_at("$.Counters"),
            },
        )
        hand_over.next(successor_name).next(successor_input).next(start_successor).next(
            handed_over
        ).next(sfn.Succeed(self, "JobContinues"))
        keep_waiting.when(
            sfn.Condition.number_greater_than_equals("$.NodeWaits.Count", MAX_NODE_WAITS),
            hand_over,
        ).otherwise(read_group)

        # Preflight and training ------------------------------------------------------------
        preflight = run_on_every_node(
            t,
            "Preflight",
            {"Port": from_job("PreflightPort")},
            comment="{} preflight {}",
        )
        training = run_on_every_node(
            t,
            "RunTraining",
            {name: from_job(name) for name in ("JobId", "MasterPort", "NprocPerNode", "TrainArgs")},
            comment="{} attempt {}",
        )
        count_attempt = sfn.Pass(
            self,
            "CountAttempt",
            parameters={
                "Retries": sfn.JsonPath.number_at("$.Counters.Retries"),
                "Legs": sfn.JsonPath.number_at("$.Counters.Legs"),
                "Attempts.$": "States.MathAdd($.Counters.Attempts, 1)",
            },
            result_path="$.Counters",
        )
        nodes_ready.next(count_attempt).next(preflight.start)

        finished = t.notify(
            "NotifyFinish",
            "finished",
            "Job {} finished on all {} nodes after {} retries and {} legs.",
            job_id,
            str(config.node_count),
            sfn.JsonPath.string_at("$.Counters.Retries"),
            sfn.JsonPath.string_at("$.Counters.Legs"),
        ).next(sfn.Succeed(self, "JobFinished"))
        next_leg = sfn.Pass(
            self,
            "CountLeg",
            comment="A leg that ended at its time limit: resume without spending a retry.",
            parameters={
                "Retries": sfn.JsonPath.number_at("$.Counters.Retries"),
                "Legs.$": "States.MathAdd($.Counters.Legs, 1)",
                "Attempts": sfn.JsonPath.number_at("$.Counters.Attempts"),
            },
            result_path="$.Counters",
        )
        next_leg.next(
            t.notify(
                "NotifyLeg",
                "continues",
                "Job {}: leg {} ended at its time limit and saved a checkpoint; the next leg "
                "resumes from it (commands {}).",
                job_id,
                sfn.JsonPath.string_at("$.Counters.Legs"),
                sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Outcome.CommandIds")),
            )
        ).next(hand_over)
        failed = t.notify(
            "NotifyFailure",
            "failed",
            "Job {} failed after {} retries (commands {}). Read the output with "
            "`cluster.py logs --job-id {}`.",
            job_id,
            sfn.JsonPath.string_at("$.Counters.Retries"),
            sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Outcome.CommandIds")),
            job_id,
        ).next(
            sfn.Fail(self, "JobFailed", error="JobFailed", cause="the job's last attempt failed")
        )
        count_retry = sfn.Pass(
            self,
            "CountRetry",
            parameters={
                "Retries.$": "States.MathAdd($.Counters.Retries, 1)",
                "Legs": sfn.JsonPath.number_at("$.Counters.Legs"),
                "Attempts": sfn.JsonPath.number_at("$.Counters.Attempts"),
            },
            result_path="$.Counters",
        )
        count_retry.next(
            t.notify(
                "NotifyRetry",
                "retries",
                "Job {}: attempt failed (commands {}); retry {} of {} resumes from the latest "
                "checkpoint once a full set of nodes passes preflight.",
                job_id,
                sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Outcome.CommandIds")),
                sfn.JsonPath.string_at("$.Counters.Retries"),
                sfn.JsonPath.string_at("$.Job.MaxRetries"),
            )
        ).next(
            sfn.Wait(
                self, "WaitBeforeRetry", time=sfn.WaitTime.seconds_path("$.Job.RetryDelaySeconds")
            )
        ).next(hand_over)
        retry_left = sfn.Choice(self, "RetryLeft")
        retry_left.when(
            sfn.Condition.number_greater_than_equals_json_path(
                "$.Counters.Retries", "$.Job.MaxRetries"
            ),
            failed,
        ).otherwise(count_retry)

        mixed_fleet = t.notify(
            "NotifyMixedFleet",
            "cannot run",
            "Job {} cannot run: its nodes run different software (preflight commands {}). "
            "Roll the fleet with `cluster.py roll --wait`, then train again with the same job "
            "ID to resume.",
            job_id,
            sfn.JsonPath.json_to_string(sfn.JsonPath.list_at("$.Outcome.CommandIds")),
        ).next(
            sfn.Fail(
                self,
                "NodesDiffer",
                error="NodesRunDifferentSoftware",
                cause="the nodes run different software: roll the fleet (cluster.py roll "
                "--wait), then train again with the same job ID to resume",
            )
        )
        preflight_outcome = sfn.Choice(self, "PreflightPassed")
        preflight_outcome.when(
            sfn.Condition.boolean_equals("$.Verdict.Roll", True), mixed_fleet
        ).when(
            sfn.Condition.or_(
                sfn.Condition.boolean_equals("$.Verdict.Bad", True),
                sfn.Condition.boolean_equals("$.Verdict.Replaced", True),
            ),
            retry_left,
        ).otherwise(training.start)
        preflight.end.next(preflight_outcome)

        # Was the attempt ended by `cluster.py stop` (a StopTraining command for this job)?
        stop_commands = t.sdk(
            "ListStopCommands",
            "ssm",
            "listCommands",
            {"Filters": sfn.JsonPath.list_at("$.StopFilters.Filters")},
            ["*"],
            iam_action="ssm:ListCommands",
            result_selector={"Commands": sfn.JsonPath.list_at("$.Commands")},
            result_path="$.Stop",
        )
        # ASL expands paths in objects, not in arrays: the filter list is built with
        # States.Array from two objects.
        stop_filter = sfn.Pass(
            self,
            "StopFilter",
            parameters={
                "Document": {"key": "DocumentName", "value": t.document_name("StopTraining")},
                "After": {"key": "InvokedAfter", "value": sfn.JsonPath.string_at("$.Nodes.Since")},
            },
            result_path="$.StopFilters",
        )
        stop_filters = sfn.Pass(
            self,
            "StopFilters",
            parameters={
                "Filters": sfn.JsonPath.array(
                    sfn.JsonPath.string_at("$.StopFilters.Document"),
                    sfn.JsonPath.string_at("$.StopFilters.After"),
                )
            },
            result_path="$.StopFilters",
        )
        stop_filter.next(stop_filters).next(stop_commands)
        # Which job each StopTraining command was for; ASL compares two paths only in a
        # Choice, so each command goes through one.
        stop_for = sfn.Choice(self, "StopForThisJob")
        stop_for.when(
            sfn.Condition.string_equals_json_path("$.JobId", "$.Wanted"),
            sfn.Pass(self, "ThisJob", result=sfn.Result.from_string("stop")),
        ).otherwise(sfn.Pass(self, "OtherJob", result=sfn.Result.from_string("other")))
        stop_jobs = sfn.Map(
            self,
            "StopCommandJobs",
            items_path="$.Stop.Commands",
            item_selector={
                "JobId": sfn.JsonPath.string_at("$$.Map.Item.Value.Parameters.JobId[0]"),
                "Wanted": sfn.JsonPath.string_at("$.Job.JobId"),
            },
            result_path="$.Stop.Matches",
        )
        stop_jobs.item_processor(stop_for)
        stop_match = sfn.Pass(
            self,
            "StopMatched",
            parameters={"Stopped.$": "States.ArrayContains($.Stop.Matches, 'stop')"},
            result_path="$.Stop",
        )
        stopped = t.notify(
            "NotifyStopped",
            "stopped",
            "Job {} was stopped (StopTraining); not retrying.",
            job_id,
        ).next(sfn.Fail(self, "JobStopped", error="JobStopped", cause="StopTraining ended the job"))
        was_stopped = sfn.Choice(self, "WasStopped")
        was_stopped.when(sfn.Condition.boolean_equals("$.Stop.Stopped", True), stopped).otherwise(
            retry_left
        )
        any_stop = sfn.Choice(self, "AnyStopCommand")
        # A filter that matches nothing reads as [] in Step Functions; asked only when there is
        # a StopTraining command at all.
        any_stop.when(sfn.Condition.is_present("$.Stop.Commands[0]"), stop_jobs).otherwise(
            retry_left
        )
        stop_commands.next(any_stop)
        stop_jobs.next(stop_match).next(was_stopped)

        training_outcome = sfn.Choice(self, "TrainingOutcome")
        training_outcome.when(
            sfn.Condition.boolean_equals("$.Verdict.Bad", True), stop_filter
        ).when(sfn.Condition.boolean_equals("$.Verdict.Leg", True), next_leg).otherwise(finished)
        training.end.next(training_outcome)

        # The execution that handed a job over may still be running for a moment.
        one_job = sfn.Choice(self, "OneJobAtATime")
        fresh = sfn.Condition.string_equals("$.ContinuedFrom", "")
        one_job.when(
            sfn.Condition.or_(
                sfn.Condition.and_(fresh, sfn.Condition.number_greater_than("$.Running.Count", 1)),
                sfn.Condition.number_greater_than("$.Running.Count", 2),
            ),
            refuse,
        ).when(fresh, notify_start).otherwise(read_group)
        notify_start.next(read_group)
        return with_defaults.next(defaults).next(counters).next(running).next(one_job)

    def _announce_ends(self) -> None:
        """Every execution that ends FAILED, TIMED_OUT or ABORTED is announced on the topic by
        EventBridge, outside the state machine: an execution that fails in a way its own
        states cannot report (a runtime error, a permission it lacks, a quota) or that is
        stopped from outside still reaches the operator. Jobs the workflow ends itself were
        announced by it a moment before (failed, cannot run, stopped)."""
        cluster = self.config.cluster_name
        name, status = (
            events.EventField.from_path("$.detail.name"),
            events.EventField.from_path("$.detail.status"),
        )
        events.Rule(
            self,
            "ExecutionEndedRule",
            description=f"{cluster}: a job supervisor execution that did not succeed",
            # Step Functions Execution Status Change (EventBridge events reference, Step
            # Functions events): detail.stateMachineArn, detail.status, detail.name.
            event_pattern=events.EventPattern(
                source=["aws.states"],
                detail_type=["Step Functions Execution Status Change"],
                detail={
                    "stateMachineArn": [self.state_machine.state_machine_arn],
                    "status": ["FAILED", "TIMED_OUT", "ABORTED"],
                },
            ),
            targets=[
                targets.SnsTopic(
                    self.topic,
                    message=events.RuleTargetInput.from_text(
                        f"{cluster}: job supervisor execution {name} ended {status}. Unless a "
                        "message of its own just said why, the supervisor itself stopped: read "
                        "the execution's history in the Step Functions console; the job's "
                        "processes may still run (`cluster.py jobs`, `cluster.py stop`), and "
                        "`cluster.py train` with the same job ID resumes it."
                    ),
                )
            ],
        )
        # EventBridge publishes to the encrypted topic only if the key lets it (SNS developer
        # guide, encrypted topics and AWS service event sources): aws-cdk-lib's SnsTopic target
        # adds that to the key policy and the topic policy (tests/test_supervisor.py).

    def _acknowledge(self) -> None:
        config = self.config
        arn = f"arn:{RegionInfo.get(config.region).partition}"
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Resource::*]",
            "Resource * only for actions that have no resource-level permissions (Service "
            "Authorization Reference): ssm:ListCommands, ssm:ListCommandInvocations, "
            "ssm:CancelCommand, ec2:DescribeInstances, autoscaling:DescribeAutoScalingGroups, "
            "and the X-Ray and CloudWatch Logs delivery actions Step Functions needs for "
            "tracing and execution logs.",
        )
        acknowledge(
            self.role,
            f"AwsSolutions-IAM5[Resource::{arn}:ec2:{config.region}:<AWS::AccountId>:instance/*]",
            "ssm:SendCommand names the instances it runs on; the instance IDs change whenever "
            "the group replaces a node, so the statement allows any instance and a condition "
            f"(ssm:resourceTag/{CLUSTER_TAG_KEY}) limits it to this cluster's nodes.",
        )
        acknowledge(
            self.role,
            f"AwsSolutions-IAM5[Resource::{arn}:autoscaling:{config.region}:<AWS::AccountId>:"
            f"autoScalingGroup:*:autoScalingGroupName/{config.auto_scaling_group_name}]",
            "An Auto Scaling group ARN contains a UUID assigned at creation; the wildcard "
            "stands for that UUID only, the group name is fixed.",
        )
        acknowledge(
            self.role,
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "The state machine's role has one policy of its own, written by aws-cdk-lib from "
            "the service integrations the definition uses; it belongs to this role only and is "
            "deleted with it, so a managed policy would add nothing.",
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Action::kms:GenerateDataKey*]",
            "Publishing to the cluster's topic, encrypted with the operations key, needs a data "
            "key of that key only (kms:GenerateDataKey and kms:GenerateDataKeyWithoutPlaintext "
            "variants on the one key ARN).",
        )
