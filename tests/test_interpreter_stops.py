"""The rehearsal's Step Functions interpreter (moto's, adjusted in scripts/rehearsal/supervisor.py)
keeps a stopped execution stopped, as Step Functions does: StopExecution makes its status
ABORTED and its history ends there (API reference, StopExecution and GetExecutionHistory).

moto's components do nothing once their environment has stopped (EvalComponent.eval), so a Task
stopped while it was sending (here the supervisor's park: an SQS message with a task token and
TimeoutSecondsPath, stacks/supervisor_wake.py) pops a value it never pushed and, without the
adjustment, records "'>' not supported between instances of 'dict' and 'int'" as the state's
TaskFailed in the aborted execution's history: a failure the supervisor's fault tests then
count (a child aborted when another batch's child failed the map run).

It also parses one definition at a time: moto's parser shares state between parses, and the
wake's executions start by the thousand; and, looking for a task token's owner, it passes over
an execution still waiting to parse (RUNNING, but without an environment yet), where moto alone
fails the SendTaskSuccess; and an execution is RUNNING as soon as it is listed, where moto alone
lists it without a status for a moment and fails a ListExecutions with a statusFilter.
"""

from __future__ import annotations

import collections
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from scripts.rehearsal.supervisor import stops_stay_stopped

REGION = "us-east-1"
#: Upper bound only: every wait below ends on an event.
WAIT = 120


@pytest.fixture
def held_send(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """moto with its interpreter on, and the interpreter's SQS client holding each SendMessage
    until the test releases it: (sending, release)."""
    from moto import mock_aws
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_sqs as sqs_task,
    )

    sending, release = threading.Event(), threading.Event()
    original = sqs_task.boto_client_for

    class Held:
        def __init__(self, client: Any) -> None:
            self.client = client

        def send_message(self, **kwargs: Any) -> Any:
            sending.set()
            assert release.wait(WAIT), "the test never released the send"
            return self.client.send_message(**kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(self.client, name)

    def client_for(*args: Any, **kwargs: Any) -> Any:
        return Held(original(*args, **kwargs))

    monkeypatch.setattr(sqs_task, "boto_client_for", client_for)
    with mock_aws(config={"stepfunctions": {"execute_state_machine": True}}):
        yield sending, release
    release.set()


def _stopped_while_sending(
    sending: threading.Event, release: threading.Event
) -> tuple[str, list[str]]:
    """A one-state machine parked on the queue, stopped while its SendMessage is held: its
    status and the event types of its history once every thread of the execution has ended."""
    from moto.stepfunctions.parser.utils import TMP_THREADS

    sqs = boto3.client("sqs", region_name=REGION)
    sfn = boto3.client("stepfunctions", region_name=REGION)
    url = sqs.create_queue(QueueName="wake")["QueueUrl"]
    park = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": url, "MessageBody": {"TaskToken.$": "$$.Task.Token"}},
        "TimeoutSecondsPath": "$.Seconds",
        "End": True,
    }
    machine = sfn.create_state_machine(
        name="park",
        definition=json.dumps({"StartAt": "Park", "States": {"Park": park}}),
        roleArn="arn:aws:iam::123456789012:role/park",
    )["stateMachineArn"]
    before = set(TMP_THREADS)
    execution = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"Seconds": WAIT}))
    assert sending.wait(WAIT), "the execution never sent its message"
    sfn.stop_execution(executionArn=execution["executionArn"])
    release.set()
    for thread in [t for t in list(TMP_THREADS) if t not in before]:
        thread.join(WAIT)
        assert not thread.is_alive(), "the execution's threads did not end"
    status = sfn.describe_execution(executionArn=execution["executionArn"])["status"]
    history = sfn.get_execution_history(executionArn=execution["executionArn"])["events"]
    return status, [e["type"] for e in history]


def test_a_task_stopped_midway_records_no_failure(
    held_send: tuple[threading.Event, threading.Event],
) -> None:
    with stops_stay_stopped():
        status, types = _stopped_while_sending(*held_send)
    assert status == "ABORTED", status
    assert "TaskFailed" not in types, types
    assert types[-1] == "ExecutionAborted", types


def test_moto_alone_records_the_stopped_task_as_failed(
    held_send: tuple[threading.Event, threading.Event],
) -> None:
    """What the adjustment is for: without it the stopped execution's history holds a
    TaskFailed, and the execution ends FAILED."""
    status, types = _stopped_while_sending(*held_send)
    assert "TaskFailed" in types and status == "FAILED", (status, types)


def test_definitions_are_parsed_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """moto's Preprocessor keeps its scopes' query languages in a class attribute shared by
    every parse: two parses at once pop each other's (an execution's thread then dies with
    IndexError before its first state). Under the rehearsal's adjustment every parse runs
    holding PARSE_LOCK."""
    from moto.stepfunctions.parser.asl.parse import asl_parser, preprocessor

    from scripts.rehearsal.supervisor import PARSE_LOCK, parses_one_at_a_time

    # The shared state the lock guards: one list for every Preprocessor.
    assert "_query_language_per_scope" in vars(preprocessor.Preprocessor)
    assert preprocessor.Preprocessor()._query_language_per_scope is (
        preprocessor.Preprocessor()._query_language_per_scope
    )
    held: list[bool] = []
    visit = preprocessor.Preprocessor.visitState_machine  # once a parse, at the tree's root

    def watched(self: Any, ctx: Any) -> Any:
        held.append(PARSE_LOCK.locked())
        return visit(self, ctx)

    monkeypatch.setattr(preprocessor.Preprocessor, "visitState_machine", watched)
    # A definition of this test's own: one parsed before in this process is not parsed again.
    state = f"A{uuid.uuid4().hex}"
    definition = json.dumps({"StartAt": state, "States": {state: {"Type": "Succeed"}}})
    asl_parser.AmazonStateLanguageParser.parse(definition)
    with parses_one_at_a_time():
        asl_parser.AmazonStateLanguageParser.parse(definition)
    asl_parser.AmazonStateLanguageParser.parse(definition)
    assert held == [False, True, False], held


def test_a_definition_is_parsed_once_in_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rehearsals of one process (the tests start one after another) share each
    definition's program; the least recently used go past PARSED_KEPT definitions."""
    from moto.stepfunctions.parser.asl.parse import asl_parser, preprocessor

    from scripts.rehearsal import supervisor

    visits: list[int] = []
    visit = preprocessor.Preprocessor.visitState_machine

    def counted(self: Any, ctx: Any) -> Any:
        visits.append(1)
        return visit(self, ctx)

    monkeypatch.setattr(preprocessor.Preprocessor, "visitState_machine", counted)
    monkeypatch.setattr(supervisor, "PARSED_KEPT", 2)
    monkeypatch.setattr(supervisor, "PARSED", collections.OrderedDict())
    names = [f"S{uuid.uuid4().hex}" for _ in range(3)]
    first, second, third = (
        json.dumps({"StartAt": n, "States": {n: {"Type": "Succeed"}}}) for n in names
    )
    parse = asl_parser.AmazonStateLanguageParser.parse
    programs = []
    for _ in range(2):  # two rehearsals, one after the other
        with supervisor.parses_one_at_a_time():
            programs.append(asl_parser.AmazonStateLanguageParser.parse(first))
            asl_parser.AmazonStateLanguageParser.parse(first)
    assert len(visits) == 1 and programs[0] is programs[1]
    with supervisor.parses_one_at_a_time():
        for definition in (second, third):  # the first is the least recently used: it goes
            asl_parser.AmazonStateLanguageParser.parse(definition)
        assert list(supervisor.PARSED) == [second, third]
        asl_parser.AmazonStateLanguageParser.parse(first)
    assert len(visits) == 4 and list(supervisor.PARSED) == [third, first]
    assert asl_parser.AmazonStateLanguageParser.parse is parse  # moto's own once more


def _token_sent_past_an_unstarted_execution(adjusted: bool) -> tuple[str, str]:
    """An execution parked on a task token, and another started while every parse waits
    (PARSE_LOCK held): RUNNING, its worker without an environment yet. SendTaskSuccess for the
    parked one's token: (the send's outcome, the parked execution's status once it ends)."""
    from moto import mock_aws

    from scripts.rehearsal.supervisor import (
        PARSE_LOCK,
        parses_one_at_a_time,
        unstarted_executions_hold_no_tokens,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock_aws(config={"stepfunctions": {"execute_state_machine": True}}))
        stack.enter_context(parses_one_at_a_time())
        if adjusted:
            stack.enter_context(unstarted_executions_hold_no_tokens())
        sqs = boto3.client("sqs", region_name=REGION)
        sfn = boto3.client("stepfunctions", region_name=REGION)
        url = sqs.create_queue(QueueName="wake")["QueueUrl"]
        role = "arn:aws:iam::123456789012:role/test"
        # Created first: the backend looks through the state machines in this order.
        later = sfn.create_state_machine(
            name="later", roleArn=role,
            definition=json.dumps({"StartAt": "A", "States": {"A": {"Type": "Succeed"}}}),
        )["stateMachineArn"]  # fmt: skip
        park = {
            "Type": "Task",
            "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
            "Parameters": {"QueueUrl": url, "MessageBody": {"TaskToken.$": "$$.Task.Token"}},
            "TimeoutSeconds": WAIT,
            "End": True,
        }
        parked = sfn.create_state_machine(
            name="park", roleArn=role,
            definition=json.dumps({"StartAt": "Park", "States": {"Park": park}}),
        )["stateMachineArn"]  # fmt: skip
        execution = sfn.start_execution(stateMachineArn=parked)["executionArn"]
        (message,) = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=20)["Messages"]
        token = json.loads(message["Body"])["TaskToken"]
        with PARSE_LOCK:
            waiting = sfn.start_execution(stateMachineArn=later)["executionArn"]
            assert sfn.describe_execution(executionArn=waiting)["status"] == "RUNNING"
            try:
                sfn.send_task_success(taskToken=token, output="{}")
                outcome = "sent"
            except Exception as error:  # what moto alone raises
                outcome = f"{type(error).__name__}: {error}"
        deadline = time.monotonic() + WAIT
        if outcome != "sent":  # once the other execution has ended, the token is found
            while sfn.describe_execution(executionArn=waiting)["status"] == "RUNNING":
                assert time.monotonic() < deadline, "the other execution never ended"
                time.sleep(0.05)
            sfn.send_task_success(taskToken=token, output="{}")
        while (status := sfn.describe_execution(executionArn=execution)["status"]) == "RUNNING":
            assert time.monotonic() < deadline, "the parked execution never ended"
            time.sleep(0.05)
        return outcome, status


def test_a_token_is_found_while_another_execution_is_still_parsing() -> None:
    assert _token_sent_past_an_unstarted_execution(adjusted=True) == ("sent", "SUCCEEDED")


def test_moto_alone_fails_the_send_on_the_execution_still_parsing() -> None:
    """What the adjustment is for: moto reads the environment of every RUNNING execution, and
    one still parsing has none."""
    outcome, _ = _token_sent_past_an_unstarted_execution(adjusted=False)
    assert "callback_pool_manager" in outcome, outcome


def _listed_while_starting(adjusted: bool) -> str:
    """An execution caught between moto's adding it to its state machine's list and its start
    (Execution.start held until the test releases it), and ListExecutions with statusFilter
    RUNNING meanwhile, as the job queue's settled() lists the dispatcher's: the listed
    status, or the error the listing raised."""
    from moto import mock_aws
    from moto.stepfunctions.parser.backend.execution import Execution

    from scripts.rehearsal.supervisor import executions_run_once_listed

    starting, release = threading.Event(), threading.Event()
    original = Execution.start

    def held_start(self: Any) -> None:
        starting.set()
        assert release.wait(WAIT), "the test never released the start"
        original(self)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock_aws(config={"stepfunctions": {"execute_state_machine": True}}))
        if adjusted:
            stack.enter_context(executions_run_once_listed())
        stack.callback(setattr, Execution, "start", original)
        Execution.start = held_start  # type: ignore[method-assign]
        sfn = boto3.client("stepfunctions", region_name=REGION)
        machine = sfn.create_state_machine(
            name="dispatch", roleArn="arn:aws:iam::123456789012:role/test",
            definition=json.dumps({"StartAt": "A", "States": {"A": {"Type": "Succeed"}}}),
        )["stateMachineArn"]  # fmt: skip
        thread = threading.Thread(target=sfn.start_execution, kwargs={"stateMachineArn": machine})
        thread.start()
        try:
            assert starting.wait(WAIT), "StartExecution never reached the start"
            try:
                listed = sfn.list_executions(stateMachineArn=machine, statusFilter="RUNNING")
                outcome = ",".join(e["status"] for e in listed["executions"])
            except Exception as error:  # what moto alone raises
                outcome = f"{type(error).__name__}: {error}"
        finally:
            release.set()
            thread.join(WAIT)
    return outcome


def test_an_execution_being_started_is_listed_running() -> None:
    assert _listed_while_starting(adjusted=True) == "RUNNING"


def test_moto_alone_fails_a_listing_while_an_execution_starts() -> None:
    """What the adjustment is for: the job queue's settled() failed so in a full run."""
    outcome = _listed_while_starting(adjusted=False)
    assert "'NoneType' object has no attribute 'value'" in outcome, outcome


def _stopped_while_parsing(adjusted: bool) -> str:
    """An execution started while every parse waits (PARSE_LOCK held: RUNNING, its worker without
    an environment yet) and stopped meanwhile, from another thread, as a test's clean-up stops
    what a dispatcher just started; the lock released once the stop is under way. The
    execution's status once it ended, or the error the stop raised."""
    from moto import mock_aws
    from moto.stepfunctions.parser.backend.execution_worker import ExecutionWorker

    from scripts.rehearsal.supervisor import (
        PARSE_LOCK,
        parses_one_at_a_time,
        stops_wait_for_the_start,
    )

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock_aws(config={"stepfunctions": {"execute_state_machine": True}}))
        stack.enter_context(parses_one_at_a_time())
        if adjusted:
            stack.enter_context(stops_wait_for_the_start())
        reached = threading.Event()
        inner = ExecutionWorker.stop

        def reaching(self: Any, *args: Any, **kwargs: Any) -> None:
            reached.set()
            inner(self, *args, **kwargs)

        stack.callback(setattr, ExecutionWorker, "stop", inner)
        ExecutionWorker.stop = reaching  # type: ignore[method-assign]
        sfn = boto3.client("stepfunctions", region_name=REGION)
        wait = {"StartAt": "W", "States": {"W": {"Type": "Wait", "Seconds": 3600, "End": True}}}
        machine = sfn.create_state_machine(
            name="held", roleArn="arn:aws:iam::123456789012:role/test", definition=json.dumps(wait)
        )["stateMachineArn"]
        outcome: list[str] = []
        with PARSE_LOCK:
            arn = sfn.start_execution(stateMachineArn=machine)["executionArn"]

            def stop() -> None:
                try:
                    sfn.stop_execution(executionArn=arn)
                    outcome.append("stopped")
                except Exception as error:  # what moto alone raises
                    outcome.append(f"{type(error).__name__}: {error}")

            stopping = threading.Thread(target=stop)
            stopping.start()
            # Adjusted, the stop waits in the worker for the parse; moto alone, it ends at once.
            if adjusted:
                assert reached.wait(WAIT), "the stop never reached the execution's worker"
            else:
                stopping.join(WAIT)
        stopping.join(WAIT)
        if outcome != ["stopped"]:
            return outcome[0]
        deadline = time.monotonic() + WAIT
        while (status := sfn.describe_execution(executionArn=arn)["status"]) == "RUNNING":
            assert time.monotonic() < deadline, "the stopped execution never ended"
            time.sleep(0.05)
        return str(status)


def test_an_execution_stopped_before_it_began_ends_aborted() -> None:
    assert _stopped_while_parsing(adjusted=True) == "ABORTED"


def test_moto_alone_fails_the_stop_of_an_execution_still_parsing() -> None:
    """What the adjustment is for: test_stacks_queue.py's clean-up failed so in a run."""
    outcome = _stopped_while_parsing(adjusted=False)
    assert "set_stop" in outcome, outcome
