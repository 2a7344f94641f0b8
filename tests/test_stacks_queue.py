"""The job queue (stacks/job_queue.py): the synthesized dispatcher and the supervisor's slot
states run in moto's ASL interpreter against moto's DynamoDB, with EventBridge's rule emulated
from the template (scripts/rehearsal/job_queue.py). The supervisor here is its synthesized start
(Defaults to ClaimSlot or TakeOverSlot, and the refusal); where the real one would go on to wait
for nodes, the job's outcome decides how its execution ends: at once (SUCCEEDED), failing,
handing the job over (ContinuedAs), or holding until the test stops it (ABORTED), so the tests
wait for events, never for a clock. The outcome is read from the job's TrainArgs (`--hold`,
`--fail`, `--handover`; anything else finishes), so that `cluster.py train` can choose it too
(tests/test_job_queue.py). Jobs are queued with the CLI's own code
(scripts/cluster_lib/queue.py)."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest

from scripts.cluster_lib.executions import execution_name, job_of
from scripts.cluster_lib.outputs import StackOutputs
from scripts.cluster_lib.queue import JobQueue
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.job_queue import LocalQueue, local_queue, table_logical_id
from scripts.rehearsal.sdk_clients import one_at_a_time
from scripts.rehearsal.supervisor import definition as machine_definition
from stacks.job_queue import ENDED
from tests.cdk_support import Synth, only_resource, resources, synth

REGION = "us-east-1"
#: The supervisor's start, as synthesized.
START = ["Defaults", "ReadJob", "ReadCounters", "FreshOrContinued", "ClaimSlot", "TakeOverSlot",
         "DescribeRefusal", "JobRefused"]  # fmt: skip
_ids = itertools.count(1)


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def placeholder_refs(template: dict[str, Any]) -> dict[str, str]:
    refs = {"AWS::Partition": "aws", "AWS::Region": REGION, "AWS::AccountId": "123456789012"}
    for machine in template["Resources"].values():
        if machine["Type"] != "AWS::StepFunctions::StateMachine":
            continue
        for part in machine["Properties"]["DefinitionString"]["Fn::Join"][1]:
            if isinstance(part, dict):
                refs.setdefault(part["Ref"], f"<{part['Ref']}>")
    refs[table_logical_id(template)] = "trainium-operations-JobQueueTable"
    return refs


def supervisor_start(template: dict[str, Any], refs: dict[str, str]) -> dict[str, Any]:
    found = machine_definition(template, refs)["States"]
    states = {name: found[name] for name in START}
    outcome = {"Type": "Choice", "Default": "Finished", "Choices": [
        {"Variable": "$.Job.TrainArgs", "StringMatches": f"*--{word}*", "Next": state}
        for word, state in (("fail", "Failed"), ("hold", "Hold"), ("handover", "HandOver"))
    ]}  # fmt: skip
    # Where the job would go on: NotifyStart (a new job) and ReadGroup (a continued one).
    states["NotifyStart"] = states["ReadGroup"] = outcome
    states["Finished"] = {"Type": "Succeed"}
    states["Failed"] = {"Type": "Fail", "Error": "JobFailed", "Cause": "the job's outcome"}
    states["Hold"] = {"Type": "Wait", "Seconds": 3600, "Next": "Finished"}
    states["HandOver"] = {"Type": "Pass", "Result": {"ContinuedAs": "next"}, "End": True}
    return {"StartAt": "Defaults", "States": states}


@dataclass
class Cluster:
    session: Any
    sfn: Any
    dynamodb: Any
    supervisor: str
    local: LocalQueue
    queue: JobQueue

    def submit(self, job_id: str, outcome: str = "finish") -> str:
        """What `train` does: queue the job, start the dispatcher; returns the name."""
        name = execution_name(job_id, _now())
        self.queue.enqueue(job_id, name, {"JobId": job_id, "TrainArgs": f"--{outcome}"})
        return name

    def dispatch(self, times: int = 1) -> None:
        for _ in range(times):
            self.queue.dispatch()

    def started(self) -> list[str]:
        """The job IDs of the supervisor's executions, in the order they started."""
        listed = self.sfn.list_executions(stateMachineArn=self.supervisor)["executions"]
        return [job_of(e["name"]) for e in sorted(listed, key=lambda e: e["startDate"])]

    def execution(self, job_id: str) -> dict[str, Any]:
        (found,) = [
            e
            for e in self.sfn.list_executions(stateMachineArn=self.supervisor)["executions"]
            if job_of(e["name"]) == job_id
        ]
        described: dict[str, Any] = self.sfn.describe_execution(executionArn=found["executionArn"])
        return described

    def stop(self, job_id: str) -> None:
        """Stops the job's execution and waits until it ended (moto ends it a moment later)."""
        arn = self.execution(job_id)["executionArn"]
        self.sfn.stop_execution(executionArn=arn)
        deadline = time.monotonic() + 60
        while self.sfn.describe_execution(executionArn=arn)["status"] == "RUNNING":
            assert time.monotonic() < deadline, f"{job_id} still runs 60 s after its stop"
            time.sleep(0.05)

    def settled(self, timeout: float = 120) -> None:
        """Returns once every supervisor execution has either ended, its end delivered and
        its dispatcher ended, or is holding (in Hold, which ends only when stopped): nothing
        more happens until the test acts. An execution that ends by itself (a finishing or a
        failing job) is waited for, however slowly the machine runs it."""
        deadline = time.monotonic() + timeout
        while True:
            before = self._supervisors()
            if all(status != "RUNNING" or self._holding(arn) for arn, status in before.items()):
                self.local.rule.settled(timeout)
                if self._supervisors() == before:
                    return
            assert time.monotonic() < deadline, f"the queue did not settle in {timeout} s"
            time.sleep(0.1)

    def _supervisors(self) -> dict[str, str]:
        listed = self.sfn.list_executions(stateMachineArn=self.supervisor)["executions"]
        return {e["executionArn"]: e["status"] for e in listed}

    def _holding(self, arn: str) -> bool:
        events = whole_history(self.sfn, arn)
        return any(e.get("stateEnteredEventDetails", {}).get("name") == "Hold" for e in events)


def _now() -> Any:
    from datetime import UTC, datetime, timedelta

    # Execution names carry the second they were made: a distinct second per job here.
    return datetime(2026, 11, 26, tzinfo=UTC) + timedelta(seconds=next(_ids))


@contextlib.contextmanager
def queue_cluster(default: Synth) -> Iterator[Cluster]:
    import boto3
    from moto import mock_aws
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_aws_sdk as aws_sdk,
    )

    from scripts.rehearsal.supervisor import (
        SfnAsSdkIntegration,
        step_functions_as_on_aws,
    )

    template = default.templates["operations"]
    refs = placeholder_refs(template)
    original = aws_sdk.boto_client_for
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
    ):
        session = boto3.Session(
            region_name=REGION, aws_access_key_id="testing", aws_secret_access_key="testing"
        )

        @one_at_a_time
        def client_for(region: str, service: str, state_credentials: Any = None) -> Any:
            client = session.client(service, region_name=region)
            return SfnAsSdkIntegration(client) if service == "stepfunctions" else client

        aws_sdk.boto_client_for = client_for
        try:
            sfn = session.client("stepfunctions")
            supervisor = sfn.create_state_machine(
                name="trainium-jobs",
                definition=json.dumps(supervisor_start(template, refs)),
                roleArn="arn:aws:iam::123456789012:role/trainium-jobs",
            )["stateMachineArn"]
            (supervisor_id,) = [
                k
                for k, v in template["Resources"].items()
                if k.startswith("JobSupervisorStateMachine")
                and v["Type"] == "AWS::StepFunctions::StateMachine"
            ]
            dispatcher = machine_definition(
                template, {**refs, supervisor_id: supervisor}, construct="JobDispatcher"
            )
            with local_queue(
                session, REGION, template, refs,
                supervisor=supervisor, definition=dispatcher, name="trainium-dispatcher",
            ) as local:  # fmt: skip
                outputs = StackOutputs(
                    "trainium-operations",
                    {"JobQueueTableName": local.table, "JobDispatcherArn": local.dispatcher},
                )
                stack = type("FixedStack", (), {"outputs": lambda self: outputs})()
                queue = JobQueue(session.client("dynamodb"), sfn, stack)  # type: ignore[arg-type]
                cluster = Cluster(
                    session, sfn, session.client("dynamodb"), supervisor, local, queue
                )
                try:
                    yield cluster
                finally:
                    # No dispatcher may outlive moto: the ends of the jobs stopped here start
                    # dispatchers, and they start the queued jobs, which are stopped too.
                    for _ in range(10):
                        running = sfn.list_executions(
                            stateMachineArn=supervisor, statusFilter="RUNNING"
                        )["executions"]
                        for execution in running:
                            sfn.stop_execution(executionArn=execution["executionArn"])
                        with contextlib.suppress(AssertionError):
                            local.rule.settled()
                        if not running:
                            break
        finally:
            aws_sdk.boto_client_for = original


# ------------------------------------------------------------------------- template


def test_the_queue_is_an_on_demand_table_with_recovery_and_a_generated_name(default: Synth) -> None:
    template = default.templates["operations"]
    table = only_resource(template, "AWS::DynamoDB::GlobalTable")["Properties"]
    assert "TableName" not in table
    assert table["BillingMode"] == "PAY_PER_REQUEST"
    assert [k["AttributeName"] for k in table["KeySchema"]] == ["Pk", "Sk"]
    (replica,) = table["Replicas"]
    assert replica["PointInTimeRecoverySpecification"] == {"PointInTimeRecoveryEnabled": True}
    outputs = template["Outputs"]
    assert outputs["JobQueueTableName"]["Value"] == {"Ref": table_logical_id(template)}
    assert "JobDispatcherArn" in outputs


def test_the_dispatcher_runs_whenever_a_supervisor_execution_ends(default: Synth) -> None:
    """The rule (Step Functions Execution Status Change, EventBridge events reference) names
    the supervisor and every status an execution ends with, and passes the whole event."""
    template = default.templates["operations"]
    rules = [
        r["Properties"]
        for r in template["Resources"].values()
        if r["Type"] == "AWS::Events::Rule"
        and any("JobDispatcher" in json.dumps(t["Arn"]) for t in r["Properties"]["Targets"])
    ]
    (rule,) = rules
    assert rule["EventPattern"]["detail"]["status"] == ENDED
    (arn,) = rule["EventPattern"]["detail"]["stateMachineArn"]
    assert arn["Ref"].startswith("JobSupervisorStateMachine")
    (target,) = rule["Targets"]
    assert not {"Input", "InputPath", "InputTransformer"} & set(target)


def test_the_dispatchers_role_allows_what_its_definition_calls_on_the_queue_and_supervisor(
    default: Synth,
) -> None:
    """The dispatcher's role: the SDK actions its definition calls (an AWS SDK integration's
    IAM action is the service's prefix and the action in PascalCase), on the queue's table, the
    supervisor and the supervisor's executions only, plus Step Functions' own logs and tracing
    actions; the supervisor's role updates the slot."""
    template = default.templates["operations"]
    refs = placeholder_refs(template)
    definition = machine_definition(template, refs, construct="JobDispatcher")
    prefixes = {"dynamodb": "dynamodb", "sfn": "states"}
    called = set()
    for state in definition["States"].values():
        if state["Type"] == "Task":
            service, action = state["Resource"].rsplit(":", 2)[-2:]
            called.add(f"{prefixes[service]}:{action[0].upper()}{action[1:]}")
    assert called == {
        "dynamodb:Query", "dynamodb:GetItem", "dynamodb:PutItem", "dynamodb:DeleteItem",
        "states:StartExecution", "states:DescribeExecution",
    }  # fmt: skip

    def allowed(role_prefix: str) -> dict[str, list[str]]:
        (role_id,) = [k for k in resources(template, "AWS::IAM::Role") if k.startswith(role_prefix)]
        found: dict[str, list[str]] = {}
        for policy in resources(template, "AWS::IAM::Policy").values():
            if policy["Properties"]["Roles"] != [{"Ref": role_id}]:
                continue
            for statement in policy["Properties"]["PolicyDocument"]["Statement"]:
                actions = statement["Action"]
                for action in [actions] if isinstance(actions, str) else actions:
                    found.setdefault(action, []).append(json.dumps(statement["Resource"]))
        return found

    dispatcher = allowed("JobDispatcherRole")
    service = {a for a in dispatcher if a.startswith(("logs:", "xray:"))}
    assert set(dispatcher) - service == called
    table = table_logical_id(template)
    for action in called:
        (resource,) = dispatcher[action]
        if action.startswith("dynamodb:"):
            assert table in resource and "*" not in resource, (action, resource)
        elif action == "states:StartExecution":
            assert resource.startswith('{"Ref": "JobSupervisorStateMachine'), resource
        else:
            assert resource.endswith(f':execution:{default.config.cluster_name}-jobs:*"]]}}')
    (update,) = allowed("JobSupervisorRole")["dynamodb:UpdateItem"]
    assert table in update and "*" not in update


# ----------------------------------------------------------------------- executions


def test_jobs_queued_back_to_back_start_one_after_the_other_in_order_each_once(
    default: Synth,
) -> None:
    """Three jobs queued at once, and two dispatchers for each (the CLI's and a racing one):
    the first job starts, once; the others wait their turn. When it ends (stopped: ABORTED),
    EventBridge's dispatcher starts the next, which finishes, and then the last."""
    with queue_cluster(default) as cluster:
        first = cluster.submit("q1-first", "hold")
        cluster.submit("q1-second")
        cluster.submit("q1-third")
        cluster.dispatch(times=2)
        cluster.settled()
        assert cluster.started() == ["q1-first"]
        assert cluster.queue.slot()["ExecutionName"] == first
        assert [(q.position, q.job_id) for q in cluster.queue.queued()] == [
            (1, "q1-second"),
            (2, "q1-third"),
        ]
        cluster.stop("q1-first")
        cluster.settled()
        assert cluster.started() == ["q1-first", "q1-second", "q1-third"]
        assert cluster.execution("q1-third")["status"] == "SUCCEEDED"
        assert cluster.queue.queued() == []
        assert cluster.queue.slot() == {}


def test_racing_dispatchers_start_one_job_exactly_once(default: Synth) -> None:
    """Five dispatchers at once over a free slot: one claims it (attribute_not_exists), the
    others end; the head is taken once and started once."""
    with queue_cluster(default) as cluster:
        cluster.submit("q2-first", "hold")
        cluster.submit("q2-second", "hold")
        cluster.dispatch(times=5)
        cluster.settled()
        assert cluster.started() == ["q2-first"]
        assert [q.job_id for q in cluster.queue.queued()] == ["q2-second"]


def test_a_job_taken_off_the_queue_never_runs(default: Synth) -> None:
    with queue_cluster(default) as cluster:
        cluster.submit("q3-first", "hold")
        cluster.submit("q3-second")
        cluster.submit("q3-third")
        cluster.dispatch()
        cluster.settled()
        assert cluster.queue.remove("q3-second") is True
        assert cluster.queue.remove("q3-second") is False
        cluster.stop("q3-first")
        cluster.settled()
        assert cluster.started() == ["q3-first", "q3-third"]


def test_the_queue_goes_on_after_a_supervisor_that_failed(default: Synth) -> None:
    with queue_cluster(default) as cluster:
        cluster.submit("q4-first", "fail")
        cluster.submit("q4-second")
        cluster.dispatch()
        cluster.settled()
        assert cluster.execution("q4-first")["status"] == "FAILED"
        assert cluster.started() == ["q4-first", "q4-second"]
        assert cluster.execution("q4-second")["status"] == "SUCCEEDED"
        assert cluster.queue.slot() == {}


def test_a_job_started_outside_the_queue_is_refused_and_frees_nothing(default: Synth) -> None:
    """A supervisor execution that the slot does not name fails in one line (the conditional
    write, where ListExecutions is eventually consistent), and its end does not free the slot
    of the job that holds it."""
    with queue_cluster(default) as cluster:
        cluster.submit("q5-first", "hold")
        cluster.submit("q5-second")
        cluster.dispatch()
        cluster.settled()
        name = execution_name("q5-rogue", _now())
        cluster.sfn.start_execution(
            stateMachineArn=cluster.supervisor, name=name, input=json.dumps({"JobId": "q5-rogue"})
        )
        cluster.settled()
        refused = cluster.execution("q5-rogue")
        assert (refused["status"], refused["error"]) == ("FAILED", "JobNotDispatched")
        assert "does not name job q5-rogue" in refused["cause"], refused["cause"]
        assert cluster.queue.slot()["JobId"] == "q5-first"
        assert cluster.started() == ["q5-first", "q5-rogue"]


def test_a_job_handed_over_keeps_the_slot_until_its_last_execution_ends(default: Synth) -> None:
    """An execution that continues a job (ContinuedFrom) takes the slot over; the end of the
    one before (here stopped, so without ContinuedAs) frees nothing, the end of the successor
    starts the next job. An execution that ends with ContinuedAs changes nothing either."""
    with queue_cluster(default) as cluster:
        first = cluster.submit("q6-first", "hold")
        cluster.submit("q6-second", "handover")
        cluster.submit("q6-third")
        cluster.dispatch()
        cluster.settled()
        arn = cluster.execution("q6-first")["executionArn"]
        successor = execution_name("q6-first", _now())
        counters = {"Retries": 0, "Legs": 2, "Attempts": 1}
        started = cluster.sfn.start_execution(
            stateMachineArn=cluster.supervisor,
            name=successor,
            input=json.dumps(
                {
                    "JobId": "q6-first",
                    "ContinuedFrom": arn,
                    "Counters": counters,
                    "TrainArgs": "--hold",
                }
            ),
        )["executionArn"]
        cluster.sfn.stop_execution(executionArn=arn)
        cluster.settled()
        assert cluster.queue.slot()["ExecutionName"] == successor
        assert cluster.started() == ["q6-first", "q6-first"]
        assert first != successor
        cluster.sfn.stop_execution(executionArn=started)
        cluster.settled()
        # q6-second ends SUCCEEDED with ContinuedAs: its job goes on elsewhere, the slot stays.
        assert cluster.started() == ["q6-first", "q6-first", "q6-second"]
        assert cluster.queue.slot()["JobId"] == "q6-second"
        assert [q.job_id for q in cluster.queue.queued()] == ["q6-third"]


def test_a_slot_whose_job_ended_unheard_is_freed_by_the_next_dispatcher(default: Synth) -> None:
    """The end of the job that holds the slot never reaches a dispatcher (an event lost, or a
    dispatcher that failed before it freed the slot): the next dispatcher (the next `train`)
    finds the holder ended without handing its job over (DescribeExecution), frees the slot
    (conditional on the holder's ARN) and starts the next job. A holder that runs, or that
    handed its job over, keeps it."""
    with queue_cluster(default) as cluster:
        cluster.submit("q7-first", "hold")
        cluster.submit("q7-second", "handover")
        cluster.submit("q7-third", "hold")
        cluster.dispatch()
        cluster.settled()
        cluster.dispatch()  # the holder runs: nothing changes
        cluster.settled()
        assert cluster.started() == ["q7-first"]
        cluster.local.rule.close()  # no more events
        cluster.stop("q7-first")
        assert cluster.execution("q7-first")["status"] == "ABORTED"
        cluster.dispatch()
        cluster.settled()
        assert cluster.started() == ["q7-first", "q7-second"]
        assert cluster.queue.slot()["JobId"] == "q7-second"
        # q7-second ended handing its job over: its slot stays (its successor takes it over).
        cluster.dispatch()
        cluster.settled()
        assert cluster.started() == ["q7-first", "q7-second"]
        assert [q.job_id for q in cluster.queue.queued()] == ["q7-third"]


class _SlowStartClient:
    """Step Functions as RuleEmulator sees it: one supervisor execution that ended, and a
    StartExecution of the dispatcher that returns only when the test says (a start as slow as
    a loaded machine makes it); the dispatcher's executions end at once."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.dispatchers: list[str] = []

    def client(self, service: str, region_name: str) -> _SlowStartClient:
        return self

    def list_executions(self, stateMachineArn: str, statusFilter: str | None = None) -> Any:
        if stateMachineArn == "supervisor":
            return {"executions": [{"executionArn": "first", "status": "FAILED"}]}
        return {"executions": []}  # no dispatcher runs: each ends at once

    def describe_execution(self, executionArn: str) -> dict[str, Any]:
        now = datetime.now(UTC)
        return {"executionArn": executionArn, "stateMachineArn": "supervisor", "name": "first",
                "status": "FAILED", "startDate": now, "stopDate": now}  # fmt: skip

    def start_execution(self, stateMachineArn: str, name: str, input: str) -> dict[str, Any]:
        self.entered.set()
        assert self.release.wait(120)
        self.dispatchers.append(name)
        return {"executionArn": name}


def test_the_rule_has_delivered_an_event_only_once_its_dispatcher_started() -> None:
    """settled() waits for events, not for a pause: a supervisor execution that ended counts as
    delivered once the dispatcher execution its event starts exists, however long that start
    takes (here until the test releases it). Before, it counted from the moment the rule saw it,
    and a start slower than settled()'s second look (then 0.3 s after the first) on a loaded
    machine let a test read the queue before the dispatcher had started the next job."""
    from scripts.rehearsal.job_queue import RuleEmulator

    client = _SlowStartClient()
    rule = RuleEmulator(client, "us-east-1", {"source": ["aws.states"]}, "supervisor", "dispatcher")
    delivering = threading.Thread(target=rule.deliver, args=(client,), daemon=True)
    delivering.start()
    assert client.entered.wait(60)
    settling = threading.Thread(target=rule.settled, kwargs={"timeout": 120}, daemon=True)
    settling.start()
    settling.join(2)  # twenty of settled()'s looks: it must still wait
    assert settling.is_alive(), "settled() returned while the dispatcher's start was under way"
    client.release.set()
    delivering.join(60)
    settling.join(60)
    assert not settling.is_alive() and client.dispatchers == [rule.delivered[0]["id"]]


def test_the_rule_goes_through_the_api_only_when_an_execution_ended_undelivered() -> None:
    """RuleEmulator.undelivered reads moto's backend: false while the supervisor's execution
    runs, true once it ended (stopped here) until its event is delivered, false after."""
    import boto3
    from moto import mock_aws

    from scripts.rehearsal.job_queue import ACCOUNT, RuleEmulator

    role = f"arn:aws:iam::{ACCOUNT}:role/test"
    waits = {"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 3600, "End": True}}}
    ends = {"StartAt": "P", "States": {"P": {"Type": "Pass", "End": True}}}
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        client = boto3.client("stepfunctions", region_name="us-east-1")
        supervisor, dispatcher = (
            client.create_state_machine(name=name, definition=json.dumps(body), roleArn=role)[
                "stateMachineArn"
            ]
            for name, body in (("supervisor", waits), ("dispatcher", ends))
        )
        rule = RuleEmulator(boto3, "us-east-1", {"source": ["aws.states"]}, supervisor, dispatcher)
        assert not rule.undelivered()
        arn = client.start_execution(stateMachineArn=supervisor, name="job-1")["executionArn"]
        assert not rule.undelivered()  # RUNNING: the Wait state holds it for an hour
        client.stop_execution(executionArn=arn)
        deadline = time.monotonic() + 60  # moto ends the stopped execution on its own thread
        while client.describe_execution(executionArn=arn)["status"] == "RUNNING":
            assert time.monotonic() < deadline, "the stopped execution still runs after 60 s"
            assert not rule.undelivered()
            time.sleep(0.05)
        assert client.describe_execution(executionArn=arn)["status"] == "ABORTED"
        assert rule.undelivered()
        rule.deliver(client)
        assert [e["detail"]["executionArn"] for e in rule.delivered] == [arn]
        assert not rule.undelivered()


class _EndingSupervisor:
    """Step Functions as Cluster.settled sees it: one supervisor execution, RUNNING and not in
    Hold (a job that fails or finishes by itself) until the test ends it."""

    def __init__(self) -> None:
        self.status = "RUNNING"

    def list_executions(self, stateMachineArn: str) -> dict[str, Any]:
        return {"executions": [{"executionArn": "q-first", "status": self.status}]}

    def get_execution_history(self, executionArn: str) -> dict[str, Any]:
        entered = [{"type": "ChoiceStateEntered", "stateEnteredEventDetails": {"name": "Outcome"}}]
        return {"events": entered}

    def get_paginator(self, operation: str) -> Any:
        assert operation == "get_execution_history"
        return types.SimpleNamespace(
            paginate=lambda executionArn, **_: [self.get_execution_history(executionArn)]
        )


def test_settled_waits_for_a_supervisor_that_ends_by_itself() -> None:
    """A queued job's supervisor that fails or finishes on its own is waited for, however slowly
    it runs: test_the_queue_goes_on_after_a_supervisor_that_failed read the queue while
    `q4-first` still ran on a loaded machine (the next job never started), when settled()
    waited only for the dispatchers and ended supervisors."""
    sfn = _EndingSupervisor()
    rule = types.SimpleNamespace(settled=lambda timeout: None)
    cluster = Cluster(None, sfn, None, "supervisor", types.SimpleNamespace(rule=rule), None)  # type: ignore[arg-type]
    settling = threading.Thread(target=cluster.settled, kwargs={"timeout": 120}, daemon=True)
    settling.start()
    settling.join(2)
    assert settling.is_alive(), "settled() returned while a supervisor execution ran"
    sfn.status = "FAILED"
    settling.join(60)
    assert not settling.is_alive()
