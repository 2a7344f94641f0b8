"""Waking the supervisor's polls: a batch's poll runs when something happened, not only every
PollSeconds.

Each batch's child execution (stacks/supervisor_run.py) waits between two polls of its command.
Without a wake that wait is a plain Wait of PollSeconds, so a crashed rank or a dead node is
seen up to PollSeconds late, twice (the end, then the grace's end), before the retry starts. The
wait here is a callback instead (`park`): <Document>WaitForWake sends a message with its task
token to the cluster's wake queue (`arn:aws:states:::sqs:sendMessage.waitForTaskToken`, Step
Functions developer guide, "Wait for a Callback with Task Token") and waits for it, at most
$.Job.PollSeconds (TimeoutSecondsPath). States.Timeout is the timed poll of before; any other
error of the send falls back to the plain Wait (<Document>WaitPlain), which is also what a child
uses once it has been woken WAKE_BUDGET times in one attempt (stacks/supervisor_limits.py
counts those wakes in the child's history budget).

The wake state machine (Standard, AWS SDK integrations only, as stacks/drain.py) is started by
EventBridge rules on what ends a poll's wait early:

- Systems Manager's "EC2 Command Invocation Status-change Notification" (source aws.ssm; detail
  command-id, document-name, instance-id, requested-date-time, status: EventBridge event
  examples for Systems Manager, Run Command events,
  https://docs.aws.amazon.com/systems-manager/latest/userguide/monitoring-systems-manager-event-examples.html)
  for the cluster's Preflight and RunTraining documents in an ended status (COMMAND_ENDED): a
  rank that crashes ends its node's invocation, and preflight's results arrive;
- Auto Scaling's "EC2 Instance-terminate Lifecycle Action" (source aws.autoscaling; detail
  AutoScalingGroupName, EC2InstanceId, LifecycleHookName, LifecycleTransition: Amazon EC2 Auto
  Scaling event reference, "Scale-in lifecycle action",
  https://docs.aws.amazon.com/autoscaling/ec2/userguide/ec2-auto-scaling-event-reference.html)
  for the cluster's group: a node the group terminates (a dead node it replaces, one marked
  unhealthy) waits in Terminating:Wait under its termination hook (stacks/compute.py), and the
  event says so at once.

It receives the queue's messages (ReceiveMessage, up to 10 a round, rounds until the queue
answers empty, at most WAKE_ROUNDS, and once more after the queue was empty, a long poll of up
to SETTLE_SECONDS that returns as soon as a message comes: a child that was polling when the
event came, its poll perhaps read just before the change, parks a moment later), sends each
message's task token SendTaskSuccess (a token whose wait has already timed out or ended is
refused with TaskTimedOut, InvalidToken or TaskDoesNotExist: ignored) and deletes the message.
Every child parked at the time polls at once: its own batch's event or another's, the poll
finds out.

A park's message is delayed PARK_DELAY seconds (SendMessage DelaySeconds: no receive returns it
before then). A woken child that finds nothing new parks again at once; without the delay the
same wake's next round received that message and woke it again, round after round, and a few
events spent a child's WAKE_BUDGET in seconds (after which it waits PollSeconds between polls).
With it, a child is woken at most once per PARK_DELAY, however many events come: a burst of
them (every node's invocation ending together) costs it a poll or two, each seeing the events
so far. A child that parked less than PARK_DELAY before an event is woken by that event's
settle, which waits longer than the delay (SETTLE_SECONDS > PARK_DELAY); so is a child woken by
the wake's first round, once more after PARK_DELAY (seeing whatever else came meanwhile). A
wait of PARK_DELAY or less (PollSeconds 5, say) is a plain Wait: no wake could end it early,
and its message would only be read and refused.

Stale messages: a child whose wait timed out leaves its message behind. The next wake refuses
its token and deletes it; until then it stays at most RETENTION (the longest PollSeconds the CLI
allows and a margin: a parked child's message must outlive its wait), after which SQS drops it.
Older messages come first (SQS standard queues: best-effort order), so a wake drains them to
reach the live ones: WAKE_ROUNDS is enough for the stale messages of every child of the
largest cluster at the default PollSeconds.
"""

from __future__ import annotations

import math
from typing import Any

import aws_cdk as cdk
from aws_cdk import aws_events as events
from aws_cdk import aws_events_targets as targets
from aws_cdk import aws_kms as kms
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_ssm as ssm
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from stacks.config import MAX_NODES, ClusterConfig
from stacks.nag import acknowledge
from stacks.state_machines import logged_state_machine, role_and_log_group
from stacks.supervisor_limits import DEFAULT_POLL_SECONDS, WAKE_BUDGET, batches

#: The documents whose invocations' ends wake the polls.
WAKE_DOCUMENTS = ("Preflight", "RunTraining")
#: Run Command statuses after which an invocation changes no more (botocore's ssm
#: CommandInvocationStatus less Pending, InProgress, Delayed and Cancelling): only these wake.
INVOCATION_ENDED = ("Success", "Failed", "Cancelled", "TimedOut")
#: Detail-types of the events that start the wake (see the module's docstring).
INVOCATION_EVENT = "EC2 Command Invocation Status-change Notification"
TERMINATE_EVENT = "EC2 Instance-terminate Lifecycle Action"
#: ReceiveMessage returns at most 10 messages (SQS API reference, MaxNumberOfMessages).
RECEIVE_MAX = 10
#: ReceiveMessage's long poll (seconds): SQS then asks every server, where a short poll samples
#: some and may answer empty while messages wait (SQS developer guide, "Amazon SQS short and
#: long polling").
RECEIVE_WAIT_SECONDS = 1
#: The longest PollSeconds `train --check-every` allows (scripts/cluster_lib/arguments.py).
MAX_POLL_SECONDS = 3600
#: How long SQS keeps a message (60 s to 14 days, SQS API reference, MessageRetentionPeriod):
#: a parked child's message must outlive the longest wait.
RETENTION_SECONDS = MAX_POLL_SECONDS + 300
RETENTION = cdk.Duration.seconds(RETENTION_SECONDS)
#: The stale messages one child leaves in the queue at most, at the default PollSeconds: one per
#: wait that ran out within RETENTION.
STALE_PER_CHILD = math.ceil(RETENTION_SECONDS / DEFAULT_POLL_SECONDS)
#: The rounds of ReceiveMessage one wake makes at most: every batch's child of the largest
#: cluster parked, each with its stale messages, and one round more that finds the queue empty.
#: Past it (shorter PollSeconds leave more), the next wakes drain the rest.
WAKE_ROUNDS = math.ceil(batches(MAX_NODES) * (STALE_PER_CHILD + 1) / RECEIVE_MAX) + 1
#: How long a park's message stays invisible after it is sent (SendMessage DelaySeconds, 0 to
#: 900: SQS API reference): the least time between two wakes of one child (see above).
PARK_DELAY = 5
#: How long, once the queue was found empty, the wake waits for a message still to come (a
#: child that polled while the event came parks a few state transitions later; under load,
#: longer): SQS's longest long poll (ReceiveMessage WaitTimeSeconds, 0 to 20, SQS API reference).
SETTLE_SECONDS = 20
#: A received message that is not deleted (the wake failed midway) is seen again after this.
VISIBILITY = cdk.Duration.seconds(30)
#: Step Functions' names for SendTaskSuccess's refusals of a token that no longer waits
#: (botocore's stepfunctions model: TaskTimedOut, InvalidToken, TaskDoesNotExist; an AWS SDK
#: integration's error is ServiceName.ErrorName with the Exception suffix).
STALE_TOKEN = [
    "Sfn.TaskTimedOutException",
    "Sfn.InvalidTokenException",
    "Sfn.TaskDoesNotExistException",
]


def wake_queue(scope: Construct, config: ClusterConfig, key: kms.IKey) -> sqs.Queue:
    """The cluster's wake queue: encrypted with the operations key, SSL only, short retention."""
    queue = sqs.Queue(
        scope,
        "WakeQueue",
        queue_name=f"{config.cluster_name}-wake",
        encryption=sqs.QueueEncryption.KMS,
        encryption_master_key=key,
        enforce_ssl=True,
        retention_period=RETENTION,
        visibility_timeout=VISIBILITY,
        removal_policy=cdk.RemovalPolicy.DESTROY,
    )
    acknowledge(
        queue,
        ["AwsSolutions-SQS3"],
        "The wake queue holds task tokens of waits that end by themselves at PollSeconds: a "
        "message that cannot be handled is one whose wait already ended, so a dead-letter "
        "queue would hold nothing anyone acts on; SQS drops it after the queue's retention.",
    )
    return queue


def park(
    scope: Construct, document: str, queue: sqs.IQueue | None, poll: sfn.IChainable
) -> sfn.Choice:
    """<Document>Wait: the wait before each poll of the batch's command (`poll`). While the
    child has been woken fewer than WAKE_BUDGET times, a callback on the wake queue, at most
    $.Job.PollSeconds; then, or without a queue, a plain Wait of PollSeconds."""
    p = document
    names = (f"{p}Wait", f"{p}WaitPlain", f"{p}WaitForWake", f"{p}Woken")
    return _parked(scope, p, queue, names, "$.Job.PollSeconds", timed_out=poll, woken=poll)


def park_grace(
    scope: Construct, document: str, queue: sqs.IQueue | None, poll: sfn.IChainable
) -> sfn.Choice:
    """<Document>GraceWait: the failure grace's wait (stacks/supervisor_run.py), woken as the
    polls' waits are. The grace is over ($.Grace.Over, <Document>GraceOver) once a wait of
    FailureGraceSeconds passed with no event; a wake polls at once, and the poll either finds
    the command ended (every invocation ended within the grace: no cancel, no wait for the rest
    of the grace) or waits the grace again. So the rest of the command is cancelled
    FailureGraceSeconds after the last event, or at once once all ended. A wake counts against
    WAKE_BUDGET as a poll's does; past it, or without a queue, a plain Wait of
    FailureGraceSeconds."""
    p = document
    over = sfn.Pass(
        scope,
        f"{p}GraceOver",
        result=sfn.Result.from_object({"Over": True}),
        result_path="$.Grace",
    )
    over.next(poll)
    names = (f"{p}GraceWait", f"{p}WaitGrace", f"{p}GraceForWake", f"{p}GraceWoken")
    return _parked(scope, p, queue, names, "$.Job.FailureGraceSeconds", timed_out=over, woken=poll)


def _parked(
    scope: Construct,
    document: str,
    queue: sqs.IQueue | None,
    names: tuple[str, str, str, str],
    seconds: str,
    *,
    timed_out: sfn.IChainable,
    woken: sfn.IChainable,
) -> sfn.Choice:
    """A wait of `seconds` (a path) that a wake ends early: the Choice, the plain Wait, the
    callback and the Pass that counts a wake are `names`. A wait that ran its length goes on
    to `timed_out`, a woken one to `woken`; a failed send, a child past WAKE_BUDGET wakes, a
    wait of PARK_DELAY or less and a cluster without a queue wait plainly."""
    choice_id, plain_id, wake_id, woken_id = names
    plain = sfn.Wait(scope, plain_id, time=sfn.WaitTime.seconds_path(seconds))
    plain.next(timed_out)
    choice = sfn.Choice(scope, choice_id)
    if queue is None:
        return choice.otherwise(plain)
    wake = _callback(scope, wake_id, document, queue, seconds)
    wake.add_catch(timed_out, errors=["States.Timeout"], result_path=sfn.JsonPath.DISCARD)
    wake.add_catch(plain, errors=["States.ALL"], result_path=sfn.JsonPath.DISCARD)
    wake.next(_woken(scope, woken_id)).next(woken)
    # A wait no longer than PARK_DELAY cannot be woken (its message is seen only as it ends):
    # plain, so that it leaves no message behind for the wakes to read and refuse.
    return choice.when(
        sfn.Condition.or_(
            sfn.Condition.number_greater_than_equals("$.Alive.Woken", WAKE_BUDGET),
            sfn.Condition.number_less_than_equals(seconds, PARK_DELAY),
        ),
        plain,
    ).otherwise(wake)


def _callback(
    scope: Construct, construct_id: str, document: str, queue: sqs.IQueue, timeout: str
) -> tasks.SqsSendMessage:
    """A message with the task token to the wake queue, waited for at most `timeout` (a path)."""
    return tasks.SqsSendMessage(
        scope,
        construct_id,
        queue=queue,
        integration_pattern=sfn.IntegrationPattern.WAIT_FOR_TASK_TOKEN,
        message_body=sfn.TaskInput.from_object(
            {
                "TaskToken": sfn.JsonPath.task_token,
                "JobId": sfn.JsonPath.string_at("$.Job.JobId"),
                "Document": document,
                "CommandId": sfn.JsonPath.string_at("$.Command.CommandId"),
            }
        ),
        delay=cdk.Duration.seconds(PARK_DELAY),
        task_timeout=sfn.Timeout.at(timeout),
        result_path=sfn.JsonPath.DISCARD,
    )


def _woken(scope: Construct, construct_id: str) -> sfn.Pass:
    """A wake counts, and counts for no seconds of the poll's own limit ($.Alive.Waited: the
    command's time limit is measured in timed waits; NodesAlive adds PollSeconds)."""
    return sfn.Pass(
        scope,
        construct_id,
        parameters={
            "Waited.$": "States.MathAdd($.Alive.Waited, "
            "States.StringToJson(States.Format('-{}', $.Job.PollSeconds)))",
            "Woken.$": "States.MathAdd($.Alive.Woken, 1)",
        },
        result_path="$.Alive",
    )


class SupervisorWake(Construct):
    """The wake state machine, its role and log group, and the two rules that start it."""

    def __init__(
        self,
        scope: Construct,
        construct_id: str,
        *,
        config: ClusterConfig,
        queue: sqs.Queue,
        documents: dict[str, ssm.CfnDocument],
        key: kms.IKey,
    ) -> None:
        super().__init__(scope, construct_id)
        self.config = config
        self.queue = queue
        name = f"{config.cluster_name}-wake"
        self.role, self.log_group = role_and_log_group(
            self,
            name,
            description=f"{config.cluster_name}: wakes the job supervisor's polls",
            config=config,
            key=key,
        )
        self.state_machine = logged_state_machine(
            self,
            name,
            self._definition(),
            role=self.role,
            log_group=self.log_group,
            timeout=cdk.Duration.minutes(5),
            comment=f"{config.cluster_name}: wakes the job supervisor's parked polls",
        )
        # Reading the queue's messages decrypts them with the operations key.
        key.grant_decrypt(self.role)
        events.Rule(
            self,
            "InvocationEndedRule",
            description=f"{config.cluster_name}: a Preflight or RunTraining invocation ended",
            event_pattern=events.EventPattern(
                source=["aws.ssm"],
                detail_type=[INVOCATION_EVENT],
                detail={
                    "document-name": [documents[d].ref for d in WAKE_DOCUMENTS],
                    "status": list(INVOCATION_ENDED),
                },
            ),
            targets=[targets.SfnStateMachine(self.state_machine)],
        )
        events.Rule(
            self,
            "NodeTerminatingRule",
            description=f"{config.cluster_name}: the group terminates a node",
            event_pattern=events.EventPattern(
                source=["aws.autoscaling"],
                detail_type=[TERMINATE_EVENT],
                detail={"AutoScalingGroupName": [config.auto_scaling_group_name]},
            ),
            targets=[targets.SfnStateMachine(self.state_machine)],
        )
        acknowledge(
            self.state_machine.node.find_child("EventsRole"),
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "aws-cdk-lib's role for the rules' target has one policy of its own, "
            "states:StartExecution on the wake only; it is deleted with the role.",
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Resource::*]",
            "Resource * only for states:SendTaskSuccess (task tokens are not resources: no "
            "resource-level permission in the Service Authorization Reference) and the X-Ray "
            "and CloudWatch Logs delivery actions.",
        )
        acknowledge(
            self.role,
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "The wake's role has one policy of its own, written by aws-cdk-lib from the "
            "service integrations the definition uses; it is deleted with the role.",
        )

    def _sdk(
        self,
        construct_id: str,
        call: tuple[str, str, str],
        parameters: dict[str, Any],
        resources: list[str],
        *,
        final_errors: list[str] | None = None,
        **kwargs: Any,
    ) -> tasks.CallAwsService:
        """An AWS SDK call (`call`: the service, its action and the IAM action), retried on a
        failure (throttling, a brief outage) other than `final_errors`."""
        service, action, iam_action = call
        task = tasks.CallAwsService(
            self,
            construct_id,
            service=service,
            action=action,
            parameters=parameters,
            iam_resources=resources,
            iam_action=iam_action,
            additional_iam_statements=[],
            **kwargs,
        )
        if final_errors:
            task.add_retry(errors=final_errors, max_attempts=0)
        task.add_retry(
            errors=["States.TaskFailed", "States.Timeout"],
            interval=cdk.Duration.seconds(1),
            max_attempts=3,
            backoff_rate=2,
        )
        return task

    def _definition(self) -> sfn.IChainable:
        queue_url = self.queue.queue_url
        start = sfn.Pass(self, "FirstRound", result=sfn.Result.from_object({"N": 0}),
                         result_path="$.Round")  # fmt: skip

        def receive_for(construct_id: str, wait_seconds: int) -> tasks.CallAwsService:
            return self._sdk(
                construct_id,
                ("sqs", "receiveMessage", "sqs:ReceiveMessage"),
                {
                    "QueueUrl": queue_url,
                    "MaxNumberOfMessages": RECEIVE_MAX,
                    "WaitTimeSeconds": wait_seconds,
                },
                [self.queue.queue_arn],
                result_selector={"Messages": sfn.JsonPath.list_at("$.Messages[*]")},
                result_path="$.Received",
            )

        receive = receive_for("Receive", RECEIVE_WAIT_SECONDS)
        each = sfn.Map(
            self,
            "WakeEach",
            items_path="$.Received.Messages",
            item_selector={
                "Token.$": "States.StringToJson($$.Map.Item.Value.Body)",
                "ReceiptHandle": sfn.JsonPath.string_at("$$.Map.Item.Value.ReceiptHandle"),
            },
            max_concurrency=RECEIVE_MAX,
            result_path=sfn.JsonPath.DISCARD,
        )
        success = self._sdk(
            "SendTaskSuccess",
            ("sfn", "sendTaskSuccess", "states:SendTaskSuccess"),
            {"TaskToken": sfn.JsonPath.string_at("$.Token.TaskToken"), "Output": "{}"},
            ["*"],
            final_errors=STALE_TOKEN,
            result_path=sfn.JsonPath.DISCARD,
        )
        delete = self._sdk(
            "DeleteMessage",
            ("sqs", "deleteMessage", "sqs:DeleteMessage"),
            {"QueueUrl": queue_url, "ReceiptHandle": sfn.JsonPath.string_at("$.ReceiptHandle")},
            [self.queue.queue_arn],
            result_path=sfn.JsonPath.DISCARD,
        )
        # A token whose wait ended already (timed out, or the child is gone): delete it too.
        success.add_catch(delete, errors=STALE_TOKEN, result_path=sfn.JsonPath.DISCARD)
        each.item_processor(success.next(delete))
        count = sfn.Pass(
            self,
            "CountRound",
            parameters={"N.$": "States.MathAdd($.Round.N, 1)"},
            result_path="$.Round",
        )
        more = sfn.Choice(self, "MoreRounds")
        done = sfn.Succeed(self, "Woken")
        # A child that was polling when the event came parks a moment later, its poll perhaps
        # read before the change: once the queue was found empty, one long poll waits up to
        # SETTLE_SECONDS for such a message and returns as soon as one is there.
        settled = sfn.Pass(self, "Settled", result=sfn.Result.from_boolean(True),
                           result_path="$.Settled")  # fmt: skip
        settle = receive_for("SettleReceive", SETTLE_SECONDS)
        any_messages = sfn.Choice(self, "AnyMessages")
        start.next(receive).next(any_messages)
        any_messages.when(sfn.Condition.is_present("$.Received.Messages[0]"), each).when(
            sfn.Condition.is_present("$.Settled"), done
        ).otherwise(settled)
        settled.next(settle).next(any_messages)
        each.next(count).next(more)
        more.when(sfn.Condition.number_less_than("$.Round.N", WAKE_ROUNDS), receive).otherwise(done)
        return start
