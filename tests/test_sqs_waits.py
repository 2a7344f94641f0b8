"""moto's SQS long polls as the rehearsal runs them (scripts/rehearsal/sqs_waits.py): they wait
for what can end them, not a second at a time, and return what and when they did before.

The rule-holder for what a poll returns is SQS's ReceiveMessage (SQS API reference: a long poll
returns as soon as a message is available, or empty once WaitTimeSeconds is over; a message
sent with DelaySeconds is not returned before its delay is over); moto implements it, and these
tests check that the adjustment keeps it."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import boto3
import pytest

from scripts.rehearsal.sqs_waits import long_polls_wait_for_changes

REGION = "us-east-1"
#: A poll's WaitTimeSeconds where the test waits for a message: long enough that the message
#: comes well within it on a busy machine (SQS allows up to 20).
LONG = 20


class RecordingCondition(threading.Condition):
    """The queue's condition, recording every wait's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


@contextlib.contextmanager
def _queue(adjusted: bool = True) -> Iterator[tuple[Any, str, RecordingCondition]]:
    from moto import mock_aws
    from moto.sqs.models import sqs_backends

    with mock_aws(), long_polls_wait_for_changes() if adjusted else contextlib.nullcontext():
        sqs = boto3.client("sqs", region_name=REGION)
        url = sqs.create_queue(QueueName="waits")["QueueUrl"]
        queue = sqs_backends["123456789012"][REGION].get_queue("waits")
        condition = RecordingCondition()
        queue._messages_lock = condition
        yield sqs, url, condition


def _receive(sqs: Any, url: str, wait: int) -> tuple[list[dict[str, Any]], float]:
    started = time.monotonic()
    messages = sqs.receive_message(QueueUrl=url, WaitTimeSeconds=wait).get("Messages", [])
    return messages, time.monotonic() - started


def test_a_message_sent_during_a_long_poll_ends_it() -> None:
    with _queue() as (sqs, url, condition):
        result: list[Any] = []
        poll = threading.Thread(target=lambda: result.append(_receive(sqs, url, LONG)))
        poll.start()
        deadline = time.monotonic() + LONG
        while not condition.timeouts:  # the poll waits
            assert time.monotonic() < deadline, "the poll never waited"
            time.sleep(0.01)
        sqs.send_message(QueueUrl=url, MessageBody="woken")
        poll.join(LONG * 2)
        ((messages, seconds),) = result
        assert [m["Body"] for m in messages] == ["woken"]
        assert seconds < LONG, seconds


def test_an_empty_long_poll_waits_its_whole_time_in_one_wait() -> None:
    with _queue() as (sqs, url, condition):
        messages, seconds = _receive(sqs, url, 5)
    assert messages == []
    assert seconds >= 5  # SQS returns an empty long poll once WaitTimeSeconds is over
    # A wait for the rest of the poll, longer than moto's second (below) unless the machine
    # stalled 4 s between the poll's start and its first wait.
    assert max(t for t in condition.timeouts if t is not None) > 1, condition.timeouts


def test_moto_alone_looks_at_the_queue_every_second() -> None:
    with _queue(adjusted=False) as (sqs, url, condition):
        messages, seconds = _receive(sqs, url, 3)
    assert messages == [] and seconds >= 3
    assert condition.timeouts and all(t is not None and t <= 1 for t in condition.timeouts), (
        condition.timeouts
    )


@pytest.mark.parametrize("later", ["delay", "visibility"])
def test_a_message_that_becomes_receivable_by_time_ends_the_poll(later: str) -> None:
    """Nothing notifies a delayed message's delay running out, or an in-flight message's
    visibility timeout: the poll wakes for it."""
    with _queue() as (sqs, url, _):
        if later == "delay":
            sqs.send_message(QueueUrl=url, MessageBody="later", DelaySeconds=1)
        else:
            sqs.send_message(QueueUrl=url, MessageBody="later")
            (taken,) = sqs.receive_message(QueueUrl=url, VisibilityTimeout=1)["Messages"]
            assert taken["Body"] == "later"
        messages, seconds = _receive(sqs, url, LONG)
    assert [m["Body"] for m in messages] == ["later"]
    assert seconds < LONG, seconds


def test_a_visibility_changed_to_zero_ends_the_poll() -> None:
    with _queue() as (sqs, url, condition):
        sqs.send_message(QueueUrl=url, MessageBody="back")
        (taken,) = sqs.receive_message(QueueUrl=url, VisibilityTimeout=600)["Messages"]
        result: list[Any] = []
        poll = threading.Thread(target=lambda: result.append(_receive(sqs, url, LONG)))
        poll.start()
        deadline = time.monotonic() + LONG
        while not condition.timeouts:
            assert time.monotonic() < deadline, "the poll never waited"
            time.sleep(0.01)
        sqs.change_message_visibility(
            QueueUrl=url, ReceiptHandle=taken["ReceiptHandle"], VisibilityTimeout=0
        )
        poll.join(LONG * 2)
        ((messages, seconds),) = result
    assert [m["Body"] for m in messages] == ["back"]
    assert seconds < LONG, seconds
