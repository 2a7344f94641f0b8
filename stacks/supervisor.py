"""The job supervisor: AWS Step Functions standard executions that run each training job.

It supervises a job in AWS rather than on the operator's machine, so a job keeps its supervision
when that machine sleeps or its credentials expire: wait for a full set of bootstrapped nodes, run
Preflight, run RunTraining on every node with the same job ID and the full host list, follow the
invocations, and on a failure retry with resume (the same job ID) up to the job's limit; a leg that
ended at its time limit (contract C4: every node Success or ResponseCode 75) continues without
spending a retry, a job stopped with StopTraining is not retried, a node whose preflight exits 3 (a
Neuron hardware error, a lost EFA device, a failed bootstrap) is marked unhealthy so the Auto
Scaling group replaces it, and a preflight that exits 4 (the nodes run different software) ends the
job without spending retries: only a roll helps. A node whose instance dies mid-command never
reports again (its invocation stays in progress): the poll asks EC2 which nodes still run and treats
a node that does not as one that ended (stacks/supervisor_run.py). The cluster's SNS topic hears of
the start, each retry and what happened on each node that did not end well (failed with status N,
node gone, cancelled, replaced), each new leg, a stop, the failure, a mixed fleet and the finish;
the hand-over's output (Why) and a failed job's cause say the same for `cluster.py jobs`.

Everything is Amazon States Language (JSONPath) with AWS SDK service integrations; no Lambda
function is needed. The two things ASL has no function for are built from what it has: the
comma-separated host list (there is no States.ArrayJoin) is one States.Format with a placeholder
per node (the cluster's node_count is fixed at synthesis), and "every invocation ended Success or
75" is decided per invocation by a Choice inside a Map and then summed up with
States.ArrayContains.

History budget: a standard execution keeps at most 25,000 events. So that a job of any length
fits, an execution follows at most one attempt: at every new leg, every retry and after
MAX_NODE_WAITS polls for nodes it starts a new execution of this state machine with the job's
settings and counters (ContinuedFrom names the one before) and ends SUCCEEDED with ContinuedAs
in its output; the CLI follows the chain. Each batch of 50 nodes is followed in a child
execution of a Distributed Map, with a history of its own, so the job's execution writes no
event per node or per poll and the shortest PollSeconds does not grow with the cluster.
stacks/supervisor_limits.py holds the arithmetic (the CLI refuses a PollSeconds at which one
attempt would not fit).

Where things are:
- stacks/supervisor_workflow.py: the workflow, its states in the order a job meets them, every
  Choice's rules and every transition (a state diagram in its docstring);
- stacks/supervisor_states.py, stacks/supervisor_outcomes.py: what each state does (before and
  after an attempt's outcome);
- stacks/supervisor_run.py: the building block that runs a document on every node and
  classifies the invocations;
- stacks/supervisor_tasks.py: the SDK-call and notification helpers and the ARNs they name;
- here: the state machine, its role and log group, the EventBridge rule that announces failed
  executions, and the cdk-nag acknowledgements.
"""

from __future__ import annotations

import aws_cdk as cdk
from aws_cdk import aws_dynamodb as dynamodb
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
from stacks.log_groups import execution_log_group
from stacks.nag import acknowledge
from stacks.supervisor_run import LEG_TIME_LIMIT_STATUS, REPLACE_NODE_STATUS, ROLL_FLEET_STATUS
from stacks.supervisor_states import JOB_DEFAULTS, SupervisorStates
from stacks.supervisor_tasks import SupervisorTasks
from stacks.supervisor_wake import SupervisorWake, wake_queue
from stacks.supervisor_workflow import definition

__all__ = [
    "JOB_DEFAULTS",
    "LEG_TIME_LIMIT_STATUS",
    "REPLACE_NODE_STATUS",
    "ROLL_FLEET_STATUS",
    "JobSupervisor",
]


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
        queue_table: dynamodb.ITableV2,
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
        self.log_group = execution_log_group(self, self.state_machine_name, config=config, key=key)
        self.role = iam.Role(
            self,
            "Role",
            assumed_by=iam.ServicePrincipal("states.amazonaws.com"),
            description=f"{config.cluster_name}: the job supervisor's state machine",
        )
        # The queue whose messages wake the batches' polls, and the wake that reads it.
        self.wake_queue = wake_queue(self, config, key)
        states = SupervisorStates(
            SupervisorTasks(
                scope=self,
                config=config,
                documents=documents,
                training_log_group=training_log_group,
                topic=topic,
                role=self.role,
                state_machine_arn=self.state_machine_arn,
                queue_table=queue_table,
                wake_queue=self.wake_queue,
            )
        )
        self.state_machine = sfn.StateMachine(
            self,
            "StateMachine",
            state_machine_name=self.state_machine_name,
            state_machine_type=sfn.StateMachineType.STANDARD,
            definition_body=sfn.DefinitionBody.from_chainable(
                definition(
                    states,
                    node_count=config.node_count,
                    wait_seconds=config.node_wait_hours * 3600,
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
        self.wake = SupervisorWake(
            self, "Wake", config=config, queue=self.wake_queue, documents=documents, key=key
        )
        self._announce_ends()
        self._acknowledge()

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
                        "`trainium-cluster train --resume <job ID>` resumes it."
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
            "ssm:CancelCommand, ec2:DescribeNetworkInterfaces, "
            "autoscaling:DescribeAutoScalingGroups, autoscaling:DescribeAutoScalingInstances, "
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
        # The Distributed Map that follows each batch of nodes in a child execution: aws-cdk-lib
        # writes its policy (start this state machine's child executions, describe and stop
        # them), whose execution ARNs end in the map run's and the child's generated names.
        children = self.state_machine.node.find_child("DistributedMapPolicy")
        machine = self.state_machine.node.default_child
        assert isinstance(machine, cdk.CfnElement)
        machine_name = (
            '{"Fn::Select":[6,{"Fn::Split":[":",{"Ref":"'
            + cdk.Stack.of(self).get_logical_id(machine)
            + '"}]}]}'
        )
        executions = f"{arn}:states:{config.region}:<AWS::AccountId>:execution:{machine_name}"
        acknowledge(
            children,
            [
                f"AwsSolutions-IAM5[Resource::{executions}:*]",
                f"AwsSolutions-IAM5[Resource::{executions}/*:*]",
            ],
            "The Distributed Map's child executions (one per batch of 50 nodes) are named by "
            "Step Functions when a map run starts; the wildcards stand for those names, under "
            "this state machine only (aws-cdk-lib's DistributedMap policy: "
            "states:DescribeExecution, states:StopExecution and states:RedriveExecution).",
        )
        acknowledge(
            children,
            "NIST.800.53.R5-IAMNoInlinePolicy",
            "aws-cdk-lib writes the Distributed Map's policy for this role only; it is deleted "
            "with it.",
        )
        acknowledge(
            self.role,
            "AwsSolutions-IAM5[Action::kms:GenerateDataKey*]",
            "Publishing to the cluster's topic, encrypted with the operations key, needs a data "
            "key of that key only (kms:GenerateDataKey and kms:GenerateDataKeyWithoutPlaintext "
            "variants on the one key ARN).",
        )
