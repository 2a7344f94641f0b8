"""moto's Amazon States Language interpreter, ending a callback Task's wait as Step Functions
does: once, at its timeout, after which its token is refused.

Step Functions' SendTaskSuccess answers TaskTimedOut for the token of a task whose wait has
ended by its timeout (API reference, SendTaskSuccess, Errors), and the task's history ends with
its TaskTimedOut. moto 5.2 times a callback Task out twice: the state waits TimeoutSeconds for
its evaluation (ExecutionState._evaluate_with_timeout, moto/stepfunctions/parser/asl/component/
state/exec/execute_state.py), and inside it, after the send, the callback waits TimeoutSeconds
again (StateTaskServiceCallback._wait_for_task_token_timeout). The outer wait ends first and
writes TaskTimedOut; a token sent before the inner one ends is still taken (moto never marks the
endpoint timed out: CallbackEndpoint.report is never called), and the inner evaluation then
writes the task's TaskSucceeded too, into a history that had moved on: a woken poll of the
supervisor's child counted 25 events where the budget counts 24 (tests/
test_supervisor_wake.py, on a loaded machine).

Adjusted: the callback's own wait decides, at the task's deadline (TimeoutSeconds from the
state's start, as before). The state's outer wait gets GRACE_SECONDS more for a waitForTaskToken
Task, the callback waits until the deadline, and when it ends with no outcome the endpoint is
marked timed out under the same lock that a SendTaskSuccess, SendTaskFailure or
SendTaskHeartbeat takes: a token sent before that is the task's outcome, one sent after is
refused with TaskTimedOut, and nothing is written twice or after the state has moved on. moto's
own refusal cannot be raised (the backend's SendTaskSuccess tests the wrong object for a timeout
and raises TaskDoesNotExist without the message its constructor wants: a TypeError, an internal
error to the caller), so the delivery raises the refusal itself, with the error code botocore's
stepfunctions model names; its message is the stand-in's own words.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

#: How much longer the state's own wait is than its callback's (an upper bound on the send,
#: SQS's SendMessage here, that comes between them).
GRACE_SECONDS = 60
#: Held while a callback's wait decides whether it timed out, and while a token is delivered.
_LOCK = threading.Lock()
#: Set on the thread of a waitForTaskToken Task's outer wait while it reads its timeout.
_OUTER = threading.local()
#: Each waiting task token's deadline (time.monotonic()): set as the Task's timeout is read,
#: taken by its callback's wait, and, for a Task that never reached that wait (its send failed),
#: dropped as the adjustment ends.
_DEADLINES: dict[str, float] = {}


@contextlib.contextmanager
def timed_out_tasks_refuse_their_tokens() -> Iterator[None]:
    """Within it, a callback Task times out once, by its callback's wait, and refuses its token
    from then on."""
    from moto.stepfunctions.parser.api import TaskTimedOut
    from moto.stepfunctions.parser.asl.component.common.timeouts.timeout import Timeout
    from moto.stepfunctions.parser.asl.component.state.exec.execute_state import ExecutionState
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.resource import (
        ResourceCondition,
    )
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_callback import (  # noqa: E501
        StateTaskServiceCallback,
    )
    from moto.stepfunctions.parser.asl.eval.callback.callback import (
        CallbackConsumerTimeout,
        CallbackEndpoint,
        CallbackPoolManager,
    )

    class TimedOut(TaskTimedOut):
        def __init__(self) -> None:
            super().__init__("the task's wait for its token has timed out", "TaskTimedOut")

    evaluate = ExecutionState._evaluate_with_timeout
    seconds_body = Timeout._eval_body
    wait = CallbackEndpoint.wait
    deliveries = {name: getattr(CallbackPoolManager, name) for name in ("notify", "heartbeat")}

    def evaluate_with_timeout(self: Any, env: Any) -> None:
        callback = (
            isinstance(self, StateTaskServiceCallback)
            and getattr(self.resource, "condition", None) == ResourceCondition.WaitForTaskToken
        )
        _OUTER.active = callback
        try:
            evaluate(self, env)
        finally:
            _OUTER.active = False

    def eval_body(self: Any, env: Any) -> None:
        seconds = self._eval_seconds(env=env)
        if getattr(_OUTER, "active", False):
            _OUTER.active = False  # the Task's own timeout only, read first
            token = env.states.context_object.context_object_data["Task"]["Token"]
            _DEADLINES[token] = time.monotonic() + seconds
            seconds += GRACE_SECONDS
        env.stack.append(seconds)

    def callback_wait(self: Any, timeout: float | None = None) -> Any:
        deadline = _DEADLINES.get(self.callback_id)
        if deadline is not None:  # never longer than asked (a test's instant waits)
            left = max(0.0, deadline - time.monotonic())
            timeout = left if timeout is None else min(timeout, left)
        self._notify_event.wait(timeout=timeout)
        _DEADLINES.pop(self.callback_id, None)
        with _LOCK:
            if self._outcome is None and self.consumer_error is None:
                self.report(CallbackConsumerTimeout())
            return self._outcome

    def delivered(name: str) -> Any:
        original = deliveries[name]

        def deliver(self: Any, callback_id: str, *args: Any, **kwargs: Any) -> Any:
            with _LOCK:
                endpoint = self._pool.get(callback_id)
                if endpoint is not None and endpoint._outcome is None:
                    deadline = _DEADLINES.get(callback_id)
                    if (
                        endpoint.consumer_error is None
                        and deadline is not None
                        and time.monotonic() >= deadline
                    ):
                        # Past the deadline the task has timed out, whether or not its
                        # callback's thread has woken to say so yet.
                        endpoint.report(CallbackConsumerTimeout())
                if endpoint is not None and isinstance(
                    endpoint.consumer_error, CallbackConsumerTimeout
                ):
                    raise TimedOut()
                return original(self, callback_id, *args, **kwargs)

        return deliver

    ExecutionState._evaluate_with_timeout = evaluate_with_timeout  # type: ignore[method-assign]
    Timeout._eval_body = eval_body  # type: ignore[method-assign]
    CallbackEndpoint.wait = callback_wait  # type: ignore[method-assign]
    for name in deliveries:
        setattr(CallbackPoolManager, name, delivered(name))
    try:
        yield
    finally:
        ExecutionState._evaluate_with_timeout = evaluate  # type: ignore[method-assign]
        Timeout._eval_body = seconds_body  # type: ignore[method-assign]
        CallbackEndpoint.wait = wait  # type: ignore[method-assign]
        for name, original in deliveries.items():
            setattr(CallbackPoolManager, name, original)
        _DEADLINES.clear()
