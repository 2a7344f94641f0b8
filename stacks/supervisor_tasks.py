"""The CDK plumbing the job supervisor's states are built with.

`SupervisorTasks` holds the construct the states are made in, the cluster's settings and the
resources they name (the SSM documents, the training log group, the topic, the state machine's
role and ARN), and makes the kinds of task the workflow uses: an AWS SDK call that retries
throttling and brief outages (`sdk`, `on_this_machine`) and a message on the cluster's topic
(`notify`); it also writes the ARNs the role's statements name. `StatesBase` is the base of the
classes whose properties are the states (stacks/supervisor_states.py,
stacks/supervisor_outcomes.py); `choice`, `succeed`, `fail`, `wait` and `pass_state` declare a
state that needs nothing but its settings as one such property. stacks/supervisor.py makes the
SupervisorTasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import aws_cdk as cdk
from aws_cdk import aws_dynamodb as dynamodb
from aws_cdk import aws_iam as iam
from aws_cdk import aws_logs as logs
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sqs as sqs
from aws_cdk import aws_ssm as ssm
from aws_cdk import aws_stepfunctions as sfn
from aws_cdk import aws_stepfunctions_tasks as tasks
from constructs import Construct

from stacks.config import ClusterConfig
from stacks.supervisor_limits import SEND_BATCH


@dataclass(frozen=True)
class SupervisorTasks:
    """What the supervisor's states are made in and with, and its two kinds of SDK task."""

    #: The construct every state is made in: a state's construct ID is its name in the definition.
    scope: Construct
    config: ClusterConfig
    documents: dict[str, ssm.CfnDocument]
    training_log_group: logs.ILogGroup
    topic: sns.ITopic
    role: iam.Role
    #: The state machine's own ARN, known before it exists (the role names it without a cycle).
    state_machine_arn: str
    #: The job queue's table (stacks/job_queue.py), whose slot names the job allowed to run.
    queue_table: dynamodb.ITableV2
    #: The queue whose messages wake the batches' polls (stacks/supervisor_wake.py); None: the
    #: polls wait PollSeconds.
    wake_queue: sqs.IQueue | None = None

    @property
    def job_id(self) -> str:
        """The job ID, as a path into the state's input."""
        return sfn.JsonPath.string_at("$.Job.JobId")

    def document_name(self, name: str) -> str:
        """The deployed name of the SSM document `name` (RunTraining, Preflight, StopTraining)."""
        return self.documents[name].ref

    def document_arn(self, name: str) -> str:
        return cdk.Stack.of(self.scope).format_arn(
            service="ssm", resource="document", resource_name=self.document_name(name)
        )

    def instances_arn(self) -> str:
        return cdk.Stack.of(self.scope).format_arn(
            service="ec2", resource="instance", resource_name="*"
        )

    def group_arn(self) -> str:
        # arn:aws:autoscaling:region:account:autoScalingGroup:<uuid>:autoScalingGroupName/<name>
        # (Service Authorization Reference, Amazon EC2 Auto Scaling resource types).
        return cdk.Stack.of(self.scope).format_arn(
            service="autoscaling",
            resource="autoScalingGroup",
            resource_name=f"*:autoScalingGroupName/{self.config.auto_scaling_group_name}",
            arn_format=cdk.ArnFormat.COLON_RESOURCE_NAME,
        )

    def sdk(
        self,
        construct_id: str,
        service: str,
        action: str,
        parameters: dict[str, Any],
        resources: list[str],
        *,
        iam_action: str | None = None,
        result_selector: dict[str, Any] | None = None,
        result_path: str | None = None,
        final_errors: list[str] | None = None,
        retry_on: tuple[str, ...] = ("States.TaskFailed", "States.Timeout"),
    ) -> tasks.CallAwsService:
        """An AWS SDK call; its result is discarded unless `result_path` says where it goes. It
        is retried on the errors `retry_on` names (any failure, by default); `final_errors`
        (Step Functions' names: ServiceName.ErrorName) are not retried."""
        task = tasks.CallAwsService(
            self.scope,
            construct_id,
            service=service,
            action=action,
            parameters=parameters,
            iam_resources=resources,
            iam_action=iam_action,
            additional_iam_statements=[],
            result_selector=result_selector,
            result_path=result_path if result_path is not None else sfn.JsonPath.DISCARD,
        )
        # Step Functions tries a state's retriers in order: errors no retry can help first.
        if final_errors:
            task.add_retry(errors=final_errors, max_attempts=0)
        # Throttling and brief outages must not end a job that runs for days.
        task.add_retry(
            errors=list(retry_on),
            interval=cdk.Duration.seconds(5),
            max_attempts=6,
            backoff_rate=2,
            max_delay=cdk.Duration.minutes(2),
        )
        return task

    def on_this_machine(
        self, construct_id: str, action: str, parameters: dict[str, str], **kwargs: Any
    ) -> tasks.CallAwsService:
        """An AWS SDK call to Step Functions about this state machine (its StateMachineArn
        first, then `parameters`); `kwargs` as for `sdk`."""
        return self.sdk(
            construct_id,
            "sfn",
            action,
            {"StateMachineArn": sfn.JsonPath.string_at("$$.StateMachine.Id"), **parameters},
            [self.state_machine_arn],
            **kwargs,
        )

    def in_service(
        self, construct_id: str, key: str, field: str, result_path: str
    ) -> tasks.CallAwsService:
        """DescribeAutoScalingInstances for the batch's $.InstanceIds; `result_path` gets
        {key: [each InService entry's `field` (".InstanceId"), or the entry itself ("")]}.
        At most 50 IDs and records (a batch); an ID that no longer exists "is ignored with no
        error" (Auto Scaling API reference). An entry is about 300 bytes, where
        DescribeInstances lists every network interface of a node (8 on a trn1.32xlarge, 16 on
        a trn2.48xlarge: about 10 and 17 KB a node), past a task's 256 KiB result from 27 and
        16 nodes (tests/test_supervisor.py measures the raw answers)."""
        return self.sdk(
            construct_id,
            "autoscaling",
            "describeAutoScalingInstances",
            {"InstanceIds": sfn.JsonPath.list_at("$.InstanceIds"), "MaxRecords": SEND_BATCH},
            ["*"],
            iam_action="autoscaling:DescribeAutoScalingInstances",
            result_selector={
                key: sfn.JsonPath.list_at(
                    f"$.AutoScalingInstances[?(@.LifecycleState == 'InService')]{field}"
                )
            },
            result_path=result_path,
        )

    def notify(
        self, construct_id: str, subject: str, message: str, *values: str
    ) -> tasks.CallAwsService:
        """Publishes to the cluster's topic; `message` is a States.Format template."""
        return self.sdk(
            construct_id,
            "sns",
            "publish",
            {
                "TopicArn": self.topic.topic_arn,
                "Subject": sfn.JsonPath.format(
                    f"{self.config.cluster_name}: job {{}} {subject}", self.job_id
                ),
                "Message": sfn.JsonPath.format(message, *values),
            },
            [self.topic.topic_arn],
            iam_action="sns:Publish",
        )


class StatesBase:
    """The base of the classes whose properties are the supervisor's states
    (stacks/supervisor_outcomes.py, stacks/supervisor_states.py)."""

    def __init__(self, t: SupervisorTasks) -> None:
        self.t = t
        self.scope = t.scope

    def _pass(self, construct_id: str, **kwargs: Any) -> sfn.Pass:
        return sfn.Pass(self.scope, construct_id, **kwargs)

    def _add_one(self, construct_id: str, counter: str, *, comment: str | None = None) -> sfn.Pass:
        """A Pass that adds one to $.Counters.<counter> (Retries, Legs or Attempts)."""
        parameters: dict[str, Any] = {}
        for name in ("Retries", "Legs", "Attempts"):
            if name == counter:
                parameters[f"{name}.$"] = f"States.MathAdd($.Counters.{name}, 1)"
            else:
                parameters[name] = sfn.JsonPath.number_at(f"$.Counters.{name}")
        return self._pass(
            construct_id, comment=comment, parameters=parameters, result_path="$.Counters"
        )


# States that need nothing but their settings, declared as properties in one line each.
_State = TypeVar("_State", bound=sfn.State)


def _declared(kind: Callable[[Construct, str], _State], name: str) -> cached_property[_State]:
    def make(states: StatesBase) -> _State:
        return kind(states.scope, name)

    return cached_property(make)


def choice(name: str) -> cached_property[sfn.Choice]:
    """A Choice, made on first use; its rules are the workflow's."""
    return _declared(sfn.Choice, name)


def succeed(name: str) -> cached_property[sfn.Succeed]:
    """A Succeed state, made on first use."""
    return _declared(sfn.Succeed, name)


def fail(
    name: str, *, error: str, cause: str | None = None, cause_path: str | None = None
) -> cached_property[sfn.Fail]:
    """A Fail state that ends the execution with `error` and `cause` (or the input's
    `cause_path`), made on first use."""
    return _declared(
        lambda scope, n: sfn.Fail(scope, n, error=error, cause=cause, cause_path=cause_path), name
    )


def wait(name: str, seconds_path: str) -> cached_property[sfn.Wait]:
    """A Wait for as many seconds as the input has at `seconds_path`, made on first use."""
    return _declared(
        lambda scope, n: sfn.Wait(scope, n, time=sfn.WaitTime.seconds_path(seconds_path)), name
    )


def pass_state(
    name: str, result_path: str, parameters: dict[str, Any]
) -> cached_property[sfn.Pass]:
    """A Pass that writes `parameters` (JSONPath and intrinsic functions, "Key.$") to
    `result_path`, made on first use."""
    return _declared(
        lambda scope, n: sfn.Pass(scope, n, parameters=parameters, result_path=result_path), name
    )


def time_parts(path: str) -> str:
    """The six fields of a time split by States.StringSplit into `path` (2026-11-23T10:00:00.123Z
    splits into 2026, 11, 23, 10, 00, 00, 123), as States.Format arguments."""
    return ", ".join(f"States.ArrayGetItem({path}, {i})" for i in range(6))
