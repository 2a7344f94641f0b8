"""moto's SQS long poll, waiting for what can end it instead of looking again every second.

moto's ReceiveMessage with WaitTimeSeconds (moto/sqs/models.py SQSBackend.receive_message)
loops until a message is received or the wait is over, and between two looks waits on the
queue's condition at most 1 s (Queue.wait_for_messages(1)); SendMessage notifies it. The wake's
executions each end with a long poll of up to 20 s (stacks/supervisor_wake.py SETTLE_SECONDS),
and at 1,024 nodes about a thousand of them wait at once (scripts/rehearsal/scale.py): a
thousand threads of one process woke every second, each taking Python's lock to look at a queue
that had not changed. On a machine busy with other work that cost more than the rehearsal's own
work (its system time grew fivefold beside other processes).

Here a long poll waits on the same condition until a message is sent (SendMessage notifies it,
as before), until the next in-flight or delayed message becomes visible (its visibility timeout
or DelaySeconds runs out: nothing notifies that), until a visibility is changed
(ChangeMessageVisibility, which now notifies too), or until the poll's WaitTimeSeconds is over,
whichever comes first. What a poll returns, and when, is unchanged: only the looks in between
that could find nothing are left out. A short poll (WaitTimeSeconds 0) never waited and is
untouched.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

#: The current thread's long poll: when its WaitTimeSeconds is over (moto's unix_time(), in
#: seconds).
_poll = threading.local()


def next_change(messages: list[Any], now_ms: float) -> float | None:
    """When (ms, moto's unix_time_millis) the first of `messages` not receivable now becomes
    receivable by time alone: its visibility timeout or its delay runs out."""
    upcoming = [
        moment
        for message in messages
        for moment in (message.visible_at, getattr(message, "delayed_until", 0.0))
        if moment > now_ms
    ]
    return min(upcoming, default=None)


@contextlib.contextmanager
def long_polls_wait_for_changes() -> Iterator[None]:
    """moto's SQS long polls wait for a change, not a second at a time (see the module's
    docstring)."""
    from moto.core.utils import unix_time, unix_time_millis
    from moto.sqs.models import Queue, SQSBackend

    receive, wait = SQSBackend.receive_message, Queue.wait_for_messages
    change = SQSBackend.change_message_visibility

    def receive_message(self: Any, queue_name: str, count: int, wait_seconds_timeout: int,
                        *args: Any, **kwargs: Any) -> Any:  # fmt: skip
        _poll.end = unix_time() + wait_seconds_timeout if wait_seconds_timeout else None
        try:
            return receive(self, queue_name, count, wait_seconds_timeout, *args, **kwargs)
        finally:
            _poll.end = None

    def wait_for_messages(self: Any, timeout: int) -> None:
        end = getattr(_poll, "end", None)
        if end is None:
            return wait(self, timeout)
        with self._messages_lock:
            while not self.messages:
                now_ms = unix_time_millis()
                until = min(end * 1000, next_change(self._messages, now_ms) or end * 1000)
                if until <= now_ms:
                    return None
                # +1 ms: moto's own checks are strict (visible after visible_at, over after
                # the end), so a wake exactly at the moment would find nothing yet.
                self._messages_lock.wait((until - now_ms) / 1000 + 0.001)
        return None

    def change_message_visibility(self: Any, queue_name: str, *args: Any, **kwargs: Any) -> Any:
        answer = change(self, queue_name, *args, **kwargs)
        queue = self.get_queue(queue_name)
        with queue._messages_lock:
            queue._messages_lock.notify_all()
        return answer

    SQSBackend.receive_message = receive_message  # type: ignore[method-assign]
    Queue.wait_for_messages = wait_for_messages  # type: ignore[method-assign]
    SQSBackend.change_message_visibility = change_message_visibility  # type: ignore[method-assign]
    try:
        yield
    finally:
        SQSBackend.receive_message = receive  # type: ignore[method-assign]
        Queue.wait_for_messages = wait  # type: ignore[method-assign]
        SQSBackend.change_message_visibility = change  # type: ignore[method-assign]
