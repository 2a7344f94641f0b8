"""The job queue: a DynamoDB table of queued jobs and a dispatcher state machine that starts the
next one when the cluster is free.

The table holds two kinds of item (partition key `Pk`, sort key `Sk`):
- a queued job: Pk "queue", Sk "<submitted at, ISO 8601 UTC with microseconds>#<job ID>" (so a
  Query of Pk "queue" in ascending order reads the jobs in the order they were submitted), with
  JobId, ExecutionName (the supervisor execution's name, chosen when it was queued), Input (the
  supervisor execution's input, JSON) and SubmittedAt;
- the slot: Pk "slot", Sk "slot", present while a job holds the cluster, with JobId and
  ExecutionName (the supervisor execution that runs it now: the dispatcher writes the first
  one, each execution that takes the job over writes its own, stacks/supervisor_states.py).

The dispatcher (Standard, AWS SDK integrations only) is started by `cluster.py train` after it
queued a job, and by an EventBridge rule whenever a supervisor execution ends (Step Functions
Execution Status Change: SUCCEEDED, FAILED, TIMED_OUT or ABORTED; its input is the event). An
ended execution that handed its job over (ContinuedAs in its output) changes nothing; any other
releases the slot if the slot names it (or the execution it continued, should it have ended
before taking the slot over). Then: read the queue's head; claim the slot; take the head off the
queue; start the supervisor with the head's name and input.

Exactly once and in order, by the conditional writes (DynamoDB developer guide, condition
expressions: a conditional write is applied atomically, or fails with
ConditionalCheckFailedException and changes nothing):
- ClaimSlot puts the slot only if there is none (attribute_not_exists): of any number of
  dispatchers that run at once, one holds the slot, the others end; while a job holds it,
  nothing else starts, and a supervisor execution refuses to run a job the slot does not name.
- TakeHead deletes the head only if it is still there (attribute_exists): a job that `stop`
  removed meanwhile is not started (the dispatcher gives the slot back and reads the head
  again); only the slot's holder takes a head, so a head is taken once.
- StartJob names the execution as queued: Step Functions refuses a second execution of a name
  within 90 days (ExecutionAlreadyExists, StartExecution API reference), so a job never starts
  twice even where a start is retried.
- ReleaseSlot deletes the slot only if it names the ended execution (or its predecessor): a late
  or repeated event (EventBridge delivers at least once) never frees the slot of a later job.
The queue's head is always its oldest job, and it is taken only by the slot's holder when the
slot was free: jobs start in the order they were queued. A start that fails puts the job back at
the head and frees the slot; the dispatcher's execution fails, and the next `train` or the next
end of a supervisor execution tries again.

A slot whose holder ended unheard (its event lost, or a dispatcher that failed before freeing
it) is freed by the next dispatcher whose claim fails: it reads the slot, describes the holder's
execution (the ARN the holder recorded) and, if that ended without handing its job over, deletes
the slot on condition that it still names that execution (FreeStaleSlot). Not recovered: a
dispatcher that fails between TakeHead and StartJob on an error its Catch cannot catch (a
runtime error): the slot then names an execution that never started, with no ARN; delete the
slot item by hand (`aws dynamodb delete-item`, Pk and Sk "slot").
"""

from __future__ import annotations

from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_kms as kms
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from aws_cdk.region_info import RegionInfo
from constructs import Construct

from stacks.config import ClusterConfig
from stacks.nag import acknowledge
from stacks.state_machines import logged_state_machine, role_and_log_group

#: The partition keys of the two kinds of item, and the slot's sort key.
QUEUE, SLOT = "queue", "slot"
#: Step Functions' name of DynamoDB's conditional-write failure (AWS SDK integrations:
#: ServiceName.ErrorName in PascalCase, developer guide, "supported-services-awssdk").
CONDITION_FAILED = "DynamoDb.ConditionalCheckFailedException"
#: The supervisor statuses that end an execution (Step Functions Execution Status Change).
ENDED = ["SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED"]
#: The IAM prefix of each service the dispatcher calls.
IAM_PREFIXES = {"dynamodb": "dynamodb", "sfn": "states"}
SLOT_KEY = {"Pk": {"S": SLOT}, "Sk": {"S": SLOT}}


def queue_table(scope: Construct, config: ClusterConfig) -> dynamodb.TableV2:
    """The queue's table: on demand, encrypted (AWS owned key), point-in-time recovery."""
    return dynamodb.TableV2(
        scope,
        "JobQueueTable",
        partition_key=dynamodb.Attribute(name="Pk", type=dynamodb.AttributeType.STRING),
        sort_key=dynamodb.Attribute(name="Sk", type=dynamodb.AttributeType.STRING),
        billing=dynamodb.Billing.on_demand(),
        point_in_time_recovery_specification=dynamodb.PointInTimeRecoverySpecification(
            point_in_time_recovery_enabled=True
        ),
        removal_policy=cdk.RemovalPolicy.RETAIN
        if config.retain_data
        else cdk.RemovalPolicy.DESTROY,
    )


def s(path: str) -> dict[str, str]:
    """A DynamoDB string attribute value read from `path`."""
    return {"S": sfn.JsonPath.string_at(path)}


class JobDispatcher(Construct):
    """The dispatcher's state machine, its role, log group and the rule that starts it."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        table: dynamodb.TableV2,
        supervisor: sfn.StateMachine,
        supervisor_name: str,
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        self.table = table
        self.supervisor = supervisor
        self.supervisor_name = supervisor_name
        name = f"{config.cluster_name}-dispatcher"
        self.role, self.log_group = role_and_log_group(
            self,
            name,
            description=f"{config.cluster_name}: the job queue's dispatcher",
            config=config,
            key=key,
        )
        self.state_machine = logged_state_machine(
            self,
            name,
            self._definition(),
            role=self.role,
            log_group=self.log_group,
            comment=f"{config.cluster_name}: starts the next queued job when the cluster is free",
        )
        events.Rule(
            self,
            "SupervisorEndedRule",
            description=f"{config.cluster_name}: a job supervisor execution ended",
            event_pattern=events.EventPattern(
                source=["aws.states"],
                detail_type=["Step Functions Execution Status Change"],
                detail={"stateMachineArn": [supervisor.state_machine_arn], "status": ENDED},
            ),
            targets=[targets.SfnStateMachine(self.state_machine)],
        )
        acknowledge(
            self.state_machine.node.find_child("EventsRole"),
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "aws-cdk-lib's role for the rule's target has one policy of its own, "
            "states:StartExecution on the dispatcher only; it is deleted with the role.",
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Resource::*]",
            "Resource * only for the X-Ray and CloudWatch Logs delivery actions Step Functions "
            "needs for tracing and execution logs (no resource-level permissions).",
        )
        arn = f"arn:{RegionInfo.get(config.region).partition}"
        acknowledge(
            self.role,
            f"AwsSolutions-IAM5[Resource::{arn}:states:{config.region}:<AWS::AccountId>:"
            f"execution:{supervisor_name}:*]",
            "states:DescribeExecution of the job supervisor's executions, whose names (job ID "
            "and time) are not known in advance: the wildcard stands for the execution name, "
            "under the supervisor's state machine only.",
        )
        acknowledge(
            self.role,
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "The dispatcher's role has one policy of its own, written by aws-cdk-lib from the "
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
        final_errors: list[str] | None = None,
    ) -> tasks.CallAwsService:
        task = tasks.CallAwsService(
            self,
            construct_id,
            service=service,
            action=action,
            parameters=parameters,
            iam_resources=resources,
            # The IAM action as the Service Authorization Reference spells it (aws-cdk-lib
            # would write the SDK's camelCase action name).
            iam_action=f"{IAM_PREFIXES[service]}:{action[0].upper()}{action[1:]}",
            additional_iam_statements=[],
            result_selector=result_selector,
            result_path=result_path if result_path is not None else sfn.JsonPath.DISCARD,
        )
        if final_errors:
            task.add_retry(errors=final_errors, max_attempts=0)
        task.add_retry(
            errors=["States.TaskFailed", "States.Timeout"],
            interval=cdk.Duration.seconds(2),
            max_attempts=5,
            backoff_rate=2,
        )
        return task

    def _table(self, construct_id: str, action: str, parameters: dict[str, Any]) -> Any:
        return self._sdk(
            construct_id,
            "dynamodb",
            action,
            {"TableName": self.table.table_name, **parameters},
            [self.table.table_arn],
            final_errors=[CONDITION_FAILED],
        )

    def _definition(self) -> sfn.IChainable:
        head = "$.Head.Items[0]"
        # A supervisor execution ended (the rule's event) -----------------------------------
        read_ended = sfn.Pass(
            self,
            "ReadEnded",
            parameters={
                "Name": sfn.JsonPath.string_at("$.detail.name"),
                "Status": sfn.JsonPath.string_at("$.detail.status"),
                "Input": sfn.JsonPath.string_to_json(sfn.JsonPath.string_at("$.detail.input")),
            },
            result_path="$.Ended",
        )
        read_output = sfn.Pass(
            self,
            "ReadOutput",
            parameters={
                "Output": sfn.JsonPath.string_to_json(sfn.JsonPath.string_at("$.detail.output"))
            },
            result_path="$.Ended.Result",
        )
        handed_over = sfn.Choice(self, "HandedOver")
        job_continues = sfn.Succeed(self, "JobContinues")
        continued = sfn.Choice(self, "ContinuedJob")
        own_name = sfn.Pass(
            self,
            "OwnName",
            parameters={"From": sfn.JsonPath.string_at("$.Ended.Name")},
            result_path="$.Predecessor",
        )
        # arn:aws:states:<region>:<account>:execution:<state machine>:<name>
        predecessor_name = sfn.Pass(
            self,
            "PredecessorName",
            parameters={
                "From": sfn.JsonPath.array_get_item(
                    sfn.JsonPath.string_split(
                        sfn.JsonPath.string_at("$.Ended.Input.ContinuedFrom"), ":"
                    ),
                    7,
                )
            },
            result_path="$.Predecessor",
        )
        release = self._table(
            "ReleaseSlot",
            "deleteItem",
            {
                "Key": SLOT_KEY,
                "ConditionExpression": "JobId = :job AND ExecutionName IN (:name, :from)",
                "ExpressionAttributeValues": {
                    ":job": s("$.Ended.Input.JobId"),
                    ":name": s("$.Ended.Name"),
                    ":from": s("$.Predecessor.From"),
                },
            },
        )
        # The queue's head -------------------------------------------------------------------
        read_head = self._sdk(
            "ReadHead",
            "dynamodb",
            "query",
            {
                "TableName": self.table.table_name,
                "KeyConditionExpression": "Pk = :queue",
                "ExpressionAttributeValues": {":queue": {"S": QUEUE}},
                "ScanIndexForward": True,
                "Limit": 1,
                "ConsistentRead": True,
            },
            [self.table.table_arn],
            result_selector={"Items": sfn.JsonPath.list_at("$.Items")},
            result_path="$.Head",
        )
        any_queued = sfn.Choice(self, "AnyQueued")
        queue_empty = sfn.Succeed(self, "QueueEmpty")
        claim = self._table(
            "ClaimSlot",
            "putItem",
            {
                "Item": {
                    **SLOT_KEY,
                    "JobId": s(f"{head}.JobId.S"),
                    "ExecutionName": s(f"{head}.ExecutionName.S"),
                    "ClaimedAt": s("$$.State.EnteredTime"),
                },
                "ConditionExpression": "attribute_not_exists(Pk)",
            },
        )
        another_job_runs = sfn.Succeed(self, "AnotherJobRuns")
        # The slot is held: by a running job, or by one whose end was never heard of (an event
        # lost, a dispatcher that failed before it freed the slot). Such a slot is freed here.
        read_slot = self._sdk(
            "ReadSlot",
            "dynamodb",
            "getItem",
            {"TableName": self.table.table_name, "Key": SLOT_KEY, "ConsistentRead": True},
            [self.table.table_arn],
            result_selector={"Item": sfn.JsonPath.object_at("$.Item")},
            result_path="$.Slot",
        )
        holder_started = sfn.Choice(self, "HolderStarted")
        describe_holder = self._sdk(
            "DescribeHolder",
            "sfn",
            "describeExecution",
            {"ExecutionArn": sfn.JsonPath.string_at("$.Slot.Item.ExecutionArn.S")},
            [self._executions_arn()],
            result_path="$.Holder",  # Status, and Output once it ended (API reference)
        )
        holder_ended = sfn.Choice(self, "HolderEnded")
        read_holder_output = sfn.Pass(
            self,
            "ReadHolderOutput",
            parameters={
                "Output": sfn.JsonPath.string_to_json(sfn.JsonPath.string_at("$.Holder.Output"))
            },
            result_path="$.Holder.Result",
        )
        holder_handed_over = sfn.Choice(self, "HolderHandedOver")
        free_stale = self._table(
            "FreeStaleSlot",
            "deleteItem",
            {
                "Key": SLOT_KEY,
                "ConditionExpression": "ExecutionArn = :arn",
                "ExpressionAttributeValues": {":arn": s("$.Slot.Item.ExecutionArn.S")},
            },
        )
        take = self._table(
            "TakeHead",
            "deleteItem",
            {
                "Key": {"Pk": {"S": QUEUE}, "Sk": s(f"{head}.Sk.S")},
                "ConditionExpression": "attribute_exists(Pk)",
            },
        )
        give_back = self._table("GiveBackSlot", "deleteItem", self._held_slot(head))
        start = self._sdk(
            "StartJob",
            "sfn",
            "startExecution",
            {
                "StateMachineArn": self.supervisor.state_machine_arn,
                "Name": sfn.JsonPath.string_at(f"{head}.ExecutionName.S"),
                "Input": sfn.JsonPath.string_at(f"{head}.Input.S"),
            },
            [self.supervisor.state_machine_arn],
            final_errors=["Sfn.ExecutionAlreadyExistsException"],
        )
        started = sfn.Succeed(self, "JobStarted")
        # A start that failed: the job goes back to the head, the slot is freed.
        requeue = self._table(
            "RequeueHead",
            "putItem",
            {"Item": sfn.JsonPath.object_at(head)},
        )
        release_claim = self._table("ReleaseClaim", "deleteItem", self._held_slot(head))
        start_failed = sfn.Fail(
            self, "StartFailed", error="JobNotStarted", cause_path="$.StartError.Cause"
        )
        # One that had started before (its name is taken): never again, on to the next.
        release_started = self._table("ReleaseStarted", "deleteItem", self._held_slot(head))

        ended = sfn.Choice(self, "SupervisorEnded")
        ended.when(sfn.Condition.is_present("$.detail.status"), read_ended).otherwise(read_head)
        read_ended.next(
            sfn.Choice(self, "Succeeded")
            .when(sfn.Condition.string_equals("$.Ended.Status", "SUCCEEDED"), read_output)
            .otherwise(continued)
        )
        read_output.next(handed_over)
        handed_over.when(
            sfn.Condition.is_present("$.Ended.Result.Output.ContinuedAs"), job_continues
        ).otherwise(continued)
        continued.when(
            sfn.Condition.is_present("$.Ended.Input.ContinuedFrom"),
            sfn.Choice(self, "AnyPredecessor")
            .when(sfn.Condition.string_equals("$.Ended.Input.ContinuedFrom", ""), own_name)
            .otherwise(predecessor_name),
        ).otherwise(own_name)
        own_name.next(release)
        predecessor_name.next(release)
        release.add_catch(read_head, errors=[CONDITION_FAILED], result_path=sfn.JsonPath.DISCARD)
        release.next(read_head)
        read_head.next(any_queued)
        any_queued.when(sfn.Condition.is_present(head), claim).otherwise(queue_empty)
        claim.add_catch(read_slot, errors=[CONDITION_FAILED], result_path="$.Claim")
        read_slot.next(holder_started)
        # No ExecutionArn yet: the holder's execution is starting (its ClaimSlot writes it).
        holder_started.when(
            sfn.Condition.is_present("$.Slot.Item.ExecutionArn.S"), describe_holder
        ).otherwise(another_job_runs)
        describe_holder.next(holder_ended)
        holder_ended.when(
            sfn.Condition.string_equals("$.Holder.Status", "RUNNING"), another_job_runs
        ).when(
            sfn.Condition.and_(
                sfn.Condition.string_equals("$.Holder.Status", "SUCCEEDED"),
                sfn.Condition.is_present("$.Holder.Output"),
            ),
            read_holder_output,
        ).otherwise(free_stale)
        # A holder that handed its job over: its successor takes the slot over (or its end
        # frees it, ReleaseSlot's predecessor clause).
        read_holder_output.next(holder_handed_over)
        holder_handed_over.when(
            sfn.Condition.is_present("$.Holder.Result.Output.ContinuedAs"), another_job_runs
        ).otherwise(free_stale)
        free_stale.add_catch(read_head, errors=[CONDITION_FAILED], result_path=sfn.JsonPath.DISCARD)
        free_stale.next(read_head)
        claim.next(take)
        take.add_catch(give_back, errors=[CONDITION_FAILED], result_path="$.Take")
        give_back.next(read_head)
        take.next(start)
        start.add_catch(
            release_started,
            errors=["Sfn.ExecutionAlreadyExistsException"],
            result_path="$.StartError",
        )
        release_started.next(read_head)
        start.add_catch(requeue, errors=["States.ALL"], result_path="$.StartError")
        requeue.next(release_claim).next(start_failed)
        start.next(started)
        return ended

    def _executions_arn(self) -> str:
        """The supervisor's executions: arn:…:execution:<state machine name>:*."""
        return cdk.Stack.of(self).format_arn(
            service="states",
            resource="execution",
            resource_name=f"{self.supervisor_name}:*",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )

    @staticmethod
    def _held_slot(head: str) -> dict[str, Any]:
        """DeleteItem of the slot while it names the head's execution (this dispatcher's claim)."""
        return {
            "Key": SLOT_KEY,
            "ConditionExpression": "ExecutionName = :name",
            "ExpressionAttributeValues": {":name": s(f"{head}.ExecutionName.S")},
        }
