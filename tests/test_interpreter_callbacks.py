"""The rehearsal's Step Functions interpreter ends a callback Task's wait as Step Functions does
(scripts/rehearsal/task_timeouts.py): once its wait has timed out, SendTaskSuccess for its token
is refused with TaskTimedOut (API reference, SendTaskSuccess, Errors), and the task's history
holds one outcome, TaskSucceeded or TaskTimedOut, never both.

The machine is the supervisor's park in small (stacks/supervisor_wake.py): an SQS message with
the task token, TimeoutSecondsPath, States.Timeout caught."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3

from scripts.rehearsal.task_timeouts import timed_out_tasks_refuse_their_tokens
from tests.test_interpreter_stops import held_send

__all__ = ["held_send"]  # a fixture of test_interpreter_stops, shared here

REGION = "us-east-1"
#: Upper bound only: every wait below ends on an event.
WAIT = 120
#: The park's timeout (ASL's smallest).
TIMEOUT = 1


def _park(url: str) -> dict[str, Any]:
    park = {
        "Type": "Task",
        "Resource": "arn:aws:states:::sqs:sendMessage.waitForTaskToken",
        "Parameters": {"QueueUrl": url, "MessageBody": {"TaskToken.$": "$$.Task.Token"}},
        "TimeoutSecondsPath": "$.Seconds",
        "Catch": [{"ErrorEquals": ["States.Timeout"], "Next": "TimedOut"}],
        "Next": "Woken",
    }
    return {
        "StartAt": "Park",
        "States": {
            "Park": park,
            "Woken": {"Type": "Succeed"},
            # The supervisor's child goes on polling: the execution still runs, and a token
            # for it is looked for there.
            "TimedOut": {"Type": "Wait", "Seconds": 3600, "End": True},
        },
    }


@contextlib.contextmanager
def _machine(adjusted: bool) -> Iterator[tuple[Any, Any, str, str]]:
    """moto (started by the caller) with a park machine: (sqs, sfn, queue URL, machine ARN)."""
    with timed_out_tasks_refuse_their_tokens() if adjusted else contextlib.nullcontext():
        sqs = boto3.client("sqs", region_name=REGION)
        sfn = boto3.client("stepfunctions", region_name=REGION)
        url = sqs.create_queue(QueueName="wake")["QueueUrl"]
        machine = sfn.create_state_machine(
            name="park", definition=json.dumps(_park(url)),
            roleArn="arn:aws:iam::123456789012:role/park",
        )["stateMachineArn"]  # fmt: skip
        yield sqs, sfn, url, machine


def _history(sfn: Any, arn: str) -> list[str]:
    """The execution's state names entered, then its event types."""
    events = sfn.get_execution_history(executionArn=arn)["events"]
    entered = [e["stateEnteredEventDetails"]["name"] for e in events
               if "stateEnteredEventDetails" in e]  # fmt: skip
    return entered + [e["type"] for e in events]


def _entered(sfn: Any, arn: str, *names: str) -> None:
    """Returns once the execution has entered one of the states `names`."""
    deadline = time.monotonic() + WAIT
    while not set(names) & set(_history(sfn, arn)):
        assert time.monotonic() < deadline, f"the execution never entered {names}"
        time.sleep(0.02)


@contextlib.contextmanager
def _threads_joined() -> Iterator[None]:
    """Joins the threads of the executions started within it, once it ends."""
    from moto.stepfunctions.parser.utils import TMP_THREADS

    before = set(TMP_THREADS)
    yield
    for thread in [t for t in list(TMP_THREADS) if t not in before]:
        thread.join(WAIT)
        assert not thread.is_alive(), "the execution's threads did not end"


def _send(sfn: Any, token: str) -> str:
    try:
        sfn.send_task_success(taskToken=token, output="{}")
    except sfn.exceptions.TaskTimedOut:
        return "TaskTimedOut"
    return "sent"


def _token_after_the_timeout(adjusted: bool) -> tuple[str, list[str]]:
    """A park that nobody wakes: it times out and the execution goes on (TimedOut). Its token
    is sent then: the send's answer, and the history."""
    from moto import mock_aws

    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        _machine(adjusted) as (sqs, sfn, url, machine),
        _threads_joined(),
    ):
        arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"Seconds": TIMEOUT}))[
            "executionArn"
        ]
        (message,) = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=20)["Messages"]
        _entered(sfn, arn, "TimedOut")
        answer = _send(sfn, json.loads(message["Body"])["TaskToken"])
        sfn.stop_execution(executionArn=arn)
        return answer, _history(sfn, arn)


def test_a_token_sent_after_its_task_timed_out_is_refused() -> None:
    answer, history = _token_after_the_timeout(adjusted=True)
    assert answer == "TaskTimedOut"
    assert "TaskTimedOut" in history and "TaskSucceeded" not in history, history


def test_moto_alone_takes_a_token_after_its_task_timed_out() -> None:
    """What the adjustment is for: moto never marks a timed-out task's endpoint, and takes the
    token as if the task still waited."""
    answer, _ = _token_after_the_timeout(adjusted=False)
    assert answer == "sent"


def _token_while_the_send_was_held(
    held: tuple[threading.Event, threading.Event], adjusted: bool
) -> tuple[str, list[str]]:
    """A park whose SendMessage is held past the task's timeout, then released; its token is
    sent as soon as its message arrives, as a wake would. The send's answer, and the history
    once every thread of the execution has ended.

    moto alone times the task out at TimeoutSeconds from the state's start, while the send is
    held (the test waits for that TaskTimedOut), and its callback then waits TimeoutSeconds more
    from the send. Adjusted, only the callback's wait decides: the hold lasts at least TIMEOUT
    seconds, and however much longer it lasts the history holds one outcome."""
    sending, release = held
    with _machine(adjusted) as (sqs, sfn, url, machine), _threads_joined():
        arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"Seconds": TIMEOUT}))[
            "executionArn"
        ]
        assert sending.wait(WAIT), "the park never sent its message"
        held_since = time.monotonic()
        while "TaskTimedOut" not in _history(sfn, arn):
            if adjusted and time.monotonic() > held_since + TIMEOUT:
                break
            assert time.monotonic() < held_since + WAIT, "the task never timed out"
            time.sleep(0.02)
        release.set()
        (message,) = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=20)["Messages"]
        answer = _send(sfn, json.loads(message["Body"])["TaskToken"])
        _entered(sfn, arn, "Woken", "TimedOut")
        if sfn.describe_execution(executionArn=arn)["status"] == "RUNNING":
            sfn.stop_execution(executionArn=arn)
    return answer, _history(sfn, arn)


def _after_exit(history: list[str]) -> list[str]:
    """The park's own events written after it exited (the next state's stretch of history)."""
    types = history[history.index("ExecutionStarted") :]
    exited = types.index("TaskStateExited")
    return [t for t in types[exited:] if t.startswith("Task") and t != "TaskStateExited"]


def test_a_send_held_past_the_timeout_times_the_task_out_once(
    held_send: tuple[threading.Event, threading.Event],
) -> None:
    """The send outlasted TimeoutSeconds: the task timed out, at its deadline, once; its token
    is refused; nothing of the park's comes after it exited."""
    answer, history = _token_while_the_send_was_held(held_send, adjusted=True)
    outcomes = [t for t in history if t in ("TaskSucceeded", "TaskTimedOut")]
    assert outcomes == ["TaskTimedOut"] and "TimedOut" in history, history
    assert answer == "TaskTimedOut"
    assert _after_exit(history) == [], history


def test_moto_alone_writes_the_park_s_events_after_it_timed_out(
    held_send: tuple[threading.Event, threading.Event],
) -> None:
    """What the adjustment is for: the state timed out (TaskTimedOut, the execution went on to
    TimedOut) while the send was held; the send then finished and wrote the park's
    TaskSubmitted into the next state's stretch of history (a poll of the supervisor's child
    one event longer than the budget counts), and the token was taken."""
    answer, history = _token_while_the_send_was_held(held_send, adjusted=False)
    assert answer == "sent" and "TimedOut" in history, history
    assert "TaskSubmitted" in _after_exit(history), history


def test_a_token_sent_in_time_wakes_the_park_once() -> None:
    from moto import mock_aws

    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        _machine(adjusted=True) as (sqs, sfn, url, machine),
        _threads_joined(),
    ):
        arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"Seconds": WAIT}))[
            "executionArn"
        ]
        (message,) = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=20)["Messages"]
        assert _send(sfn, json.loads(message["Body"])["TaskToken"]) == "sent"
        _entered(sfn, arn, "Woken")
        history = _history(sfn, arn)
    outcomes = [t for t in history if t in ("TaskSucceeded", "TaskTimedOut")]
    assert outcomes == ["TaskSucceeded"] and _after_exit(history) == [], history


def test_the_refusal_is_an_error_send_task_success_names() -> None:
    """The refusal's code is one of SendTaskSuccess's errors in botocore's stepfunctions model
    (and SendTaskFailure's and SendTaskHeartbeat's): a caller's Catch on it matches here as on
    AWS."""
    import botocore.session

    model = botocore.session.get_session().get_service_model("stepfunctions")
    for operation in ("SendTaskSuccess", "SendTaskFailure", "SendTaskHeartbeat"):
        errors = {shape.name for shape in model.operation_model(operation).error_shapes}
        assert "TaskTimedOut" in errors, (operation, errors)


def test_a_park_whose_send_failed_leaves_no_deadline_behind() -> None:
    """A park whose SendMessage fails (its queue is gone) never reaches its callback's wait,
    which takes the deadline its timeout set: the adjustment drops it as it ends, so a long
    rehearsal's failed sends add nothing that outlives it."""
    from moto import mock_aws

    from scripts.rehearsal import task_timeouts

    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        _machine(adjusted=True) as (sqs, sfn, url, machine),
    ):
        sqs.delete_queue(QueueUrl=url)
        with _threads_joined():
            arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"Seconds": WAIT}))[
                "executionArn"
            ]
            deadline = time.monotonic() + WAIT
            while sfn.describe_execution(executionArn=arn)["status"] == "RUNNING":
                assert time.monotonic() < deadline, "the park's failed send never ended it"
                time.sleep(0.02)
        assert sfn.describe_execution(executionArn=arn)["status"] == "FAILED"
        assert len(task_timeouts._DEADLINES) == 1  # the deadline its timeout set, never taken
    assert task_timeouts._DEADLINES == {}


def test_a_token_sent_past_the_deadline_before_the_wait_has_woken_is_refused() -> None:
    """The deadline decides, not the interpreter's thread: the callback's wait is held (as a
    loaded machine holds a thread) until the token has been sent, past the task's deadline.
    Step Functions refuses it with TaskTimedOut; the task times out, once."""
    from moto import mock_aws
    from moto.stepfunctions.parser.asl.eval.callback.callback import CallbackEndpoint

    from scripts.rehearsal import task_timeouts

    token_sent = threading.Event()
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        _machine(adjusted=True) as (sqs, sfn, url, machine),
        _threads_joined(),
    ):
        adjusted_wait = CallbackEndpoint.wait

        def held_wait(self: Any, timeout: float | None = None) -> Any:
            assert token_sent.wait(WAIT), "the test never sent the token"
            return adjusted_wait(self, timeout)

        CallbackEndpoint.wait = held_wait  # type: ignore[method-assign]
        try:
            arn = sfn.start_execution(
                stateMachineArn=machine, input=json.dumps({"Seconds": TIMEOUT})
            )["executionArn"]
            (message,) = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=20)["Messages"]
            token = json.loads(message["Body"])["TaskToken"]
            deadline = task_timeouts._DEADLINES[token]
            time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)  # to the deadline, no race
            answer = _send(sfn, token)
            token_sent.set()
            _entered(sfn, arn, "Woken", "TimedOut")
            sfn.stop_execution(executionArn=arn)
        finally:
            token_sent.set()
            CallbackEndpoint.wait = adjusted_wait  # type: ignore[method-assign]
        history = _history(sfn, arn)
    assert answer == "TaskTimedOut", history
    assert [t for t in history if t in ("TaskSucceeded", "TaskTimedOut")] == ["TaskTimedOut"]
    assert "TimedOut" in history and "Woken" not in history, history
