"""The rehearsal's Step Functions interpreter compares the timestamps Step Functions writes
(scripts/rehearsal/asl_timestamps.py): with a fraction of a second, which Step Functions accepts
and ignores, and which moto alone cannot parse (every such rule false)."""

from __future__ import annotations

import contextlib
import datetime
import json
import time

import boto3
import pytest

from scripts.rehearsal.asl_timestamps import parse_timestamp, rfc3339_timestamps

#: Upper bound only: each execution ends within moments.
WAIT = 120
#: Later, Earlier: whether $.A is a later time than $.B (the supervisor's progress reader asks
#: the same of a datapoint's minute and the time the nodes were ready).
DEFINITION = {
    "StartAt": "Compare",
    "States": {
        "Compare": {
            "Type": "Choice",
            "Choices": [
                {"Variable": "$.A", "TimestampGreaterThanPath": "$.B", "Next": "Later"},
            ],
            "Default": "NotLater",
        },
        "Later": {"Type": "Succeed"},
        "NotLater": {"Type": "Succeed"},
    },
}


def _later(a: str, b: str, adjusted: bool) -> bool:
    """Whether DEFINITION, run in moto's interpreter, finds `a` later than `b`."""
    from moto import mock_aws

    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        rfc3339_timestamps() if adjusted else contextlib.nullcontext(),
    ):
        sfn = boto3.client("stepfunctions", region_name="us-east-1")
        machine = sfn.create_state_machine(
            name="times", definition=json.dumps(DEFINITION),
            roleArn="arn:aws:iam::123456789012:role/times",
        )["stateMachineArn"]  # fmt: skip
        arn = sfn.start_execution(stateMachineArn=machine, input=json.dumps({"A": a, "B": b}))[
            "executionArn"
        ]
        deadline = time.monotonic() + WAIT
        while sfn.describe_execution(executionArn=arn)["status"] == "RUNNING":
            assert time.monotonic() < deadline, "the execution never ended"
            time.sleep(0.02)
        events = sfn.get_execution_history(executionArn=arn)["events"]
    entered = [e["stateEnteredEventDetails"]["name"] for e in events
               if "stateEnteredEventDetails" in e]  # fmt: skip
    return entered[-1] == "Later"


def test_a_datapoints_minute_compares_with_the_time_the_nodes_were_ready() -> None:
    minute, ready = "2026-11-26T06:34:00.000Z", "2026-11-26T06:33:27Z"
    assert _later(minute, ready, adjusted=True)
    assert not _later(ready, minute, adjusted=True)
    # moto alone reads no timestamp with a fraction: the rule is false either way.
    assert not _later(minute, ready, adjusted=False)
    # Whole seconds: moto's own parse and this one agree.
    assert _later("2026-11-26T06:34:00Z", ready, adjusted=False)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2026-11-26T06:33:27Z", "2026-11-26T06:33:27"),
        ("2026-11-26T06:33:27.999Z", "2026-11-26T06:33:27"),  # the fraction ignored
        ("2026-11-26T06:33:27.123456Z", "2026-11-26T06:33:27"),
        ("2026-11-26t06:33:27Z", None),  # the specification's uppercase T and Z
        ("2026-11-26T06:33:27z", None),
        ("2026-11-26T06:33:27", None),
        ("2026-13-26T06:33:27Z", None),
        ("2026-11-26T06:61:27Z", None),
        ("2026-11-26T06:33:27.Z", None),
        (1764138807, None),
    ],
)
def test_timestamps_read_as_the_specification_writes_them(
    text: object, seconds: str | None
) -> None:
    expected = None if seconds is None else datetime.datetime.fromisoformat(seconds)
    assert parse_timestamp(text) == expected
