"""The rehearsal's Step Functions answers GetExecutionHistory in pages, as Step Functions does
(scripts/rehearsal/history_pages.py): maxResults events a call (100 by default, at most 1,000),
reverseOrder, a nextToken that continues the same request after the events already read, and
InvalidToken for a token of another request (API reference, GetExecutionHistory; the limits and
error codes are botocore's stepfunctions model's). moto alone answers the whole history, oldest
first, to every call, so the operator CLI's reader (scripts/cluster_lib/executions.py: newest
first, 100 a call, until it reaches what it has read) never met a second page in the tests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any, cast

import boto3
import botocore.exceptions
import botocore.session
import pytest

from scripts.cluster_lib.executions import Executions
from scripts.rehearsal.history_pages import DEFAULT_PAGE, MAX_PAGE, whole_history
from scripts.rehearsal.supervisor import step_functions_as_on_aws

REGION = "us-east-1"
#: A Map of ITEMS inline iterations (four events each), then a Wait that parks the execution
#: until it is stopped: over 250 events that stay put while the test reads them.
ITEMS = 60
DEFINITION = {
    "StartAt": "Each",
    "States": {
        "Each": {
            "Type": "Map",
            "ItemsPath": "$.items",
            "ItemProcessor": {
                "StartAt": "Item",
                "States": {"Item": {"Type": "Pass", "End": True}},
            },
            "ResultPath": None,
            "Next": "Park",
        },
        "Park": {"Type": "Wait", "Seconds": 86400, "End": True},
    },
}


def test_the_limits_are_botocores() -> None:
    shape = (
        botocore.session.get_session()
        .get_service_model("stepfunctions")
        .operation_model("GetExecutionHistory")
    )
    assert shape.input_shape.members["maxResults"].metadata == {"min": 0, "max": MAX_PAGE}
    assert "The default is 100" in shape.input_shape.members["maxResults"].documentation
    assert DEFAULT_PAGE == 100
    assert "InvalidToken" in [error.name for error in shape.error_shapes]


@pytest.fixture
def parked() -> Iterator[tuple[Any, str]]:
    """A stepfunctions client and a RUNNING execution parked in its Wait, its Map done."""
    from moto import mock_aws

    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
    ):
        sfn = boto3.client("stepfunctions", region_name=REGION)
        machine = sfn.create_state_machine(
            name="history",
            definition=json.dumps(DEFINITION),
            roleArn="arn:aws:iam::123456789012:role/history",
        )["stateMachineArn"]
        arn = sfn.start_execution(
            stateMachineArn=machine, input=json.dumps({"items": list(range(ITEMS))})
        )["executionArn"]
        deadline = time.monotonic() + 600  # an upper bound: it ends at the Wait's entry
        while not any(
            e.get("stateEnteredEventDetails", {}).get("name") == "Park"
            for e in whole_history(sfn, arn)
        ):
            assert time.monotonic() < deadline, "the execution never reached its Wait"
            time.sleep(0.05)
        yield sfn, arn
        sfn.stop_execution(executionArn=arn)


def _ids(page: dict[str, Any]) -> list[int]:
    return [e["id"] for e in page["events"]]


def test_a_page_is_100_events_by_default_and_the_token_goes_on_after_them(
    parked: tuple[Any, str],
) -> None:
    sfn, arn = parked
    total = len(whole_history(sfn, arn))
    assert total > 2 * DEFAULT_PAGE
    first = sfn.get_execution_history(executionArn=arn)
    assert _ids(first) == list(range(1, DEFAULT_PAGE + 1))
    assert sfn.get_execution_history(executionArn=arn, maxResults=0)["events"] == first["events"]
    # The execution grows between the pages: the next page starts after the last one read.
    sfn.stop_execution(executionArn=arn)
    read = _ids(first)
    token = first["nextToken"]
    while token:
        page = sfn.get_execution_history(executionArn=arn, nextToken=token)
        assert 0 < len(page["events"]) <= DEFAULT_PAGE
        read += _ids(page)
        token = page.get("nextToken")
    assert read == list(range(1, total + 2))
    assert sfn.get_execution_history(executionArn=arn, maxResults=1000)["events"][-1]["type"] == (
        "ExecutionAborted"
    )


def test_newest_first_pages_go_back_from_the_newest_event(parked: tuple[Any, str]) -> None:
    sfn, arn = parked
    total = len(whole_history(sfn, arn))
    first = sfn.get_execution_history(executionArn=arn, reverseOrder=True, maxResults=50)
    assert _ids(first) == list(range(total, total - 50, -1))
    sfn.stop_execution(executionArn=arn)  # a newer event: the next page still goes back
    second = sfn.get_execution_history(
        executionArn=arn, reverseOrder=True, maxResults=50, nextToken=first["nextToken"]
    )
    assert _ids(second) == list(range(total - 50, total - 100, -1))


def test_a_token_of_another_request_and_a_page_over_1000_are_refused(
    parked: tuple[Any, str],
) -> None:
    sfn, arn = parked
    token = sfn.get_execution_history(executionArn=arn)["nextToken"]
    for kwargs in ({"nextToken": token, "reverseOrder": True}, {"nextToken": "x" * 20}):
        with pytest.raises(botocore.exceptions.ClientError) as refused:
            sfn.get_execution_history(executionArn=arn, **kwargs)
        assert refused.value.response["Error"]["Code"] == "InvalidToken"
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        sfn.get_execution_history(executionArn=arn, maxResults=MAX_PAGE + 1)
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert "less than or equal to 1000" in refused.value.response["Error"]["Message"]


def test_execution_data_is_left_out_when_asked() -> None:
    from scripts.rehearsal.history_pages import page

    event = {"id": 1, "type": "PassStateExited",
             "stateExitedEventDetails": {"name": "Item", "output": "{}",
                                         "outputDetails": {"truncated": False}}}  # fmt: skip
    answer = page([event], "arn", max_results=None, reverse=False, token=None, include_data=False)
    assert answer == {"events": [{**event, "stateExitedEventDetails": {"name": "Item"}}]}


def test_the_clis_reader_reads_every_page_it_needs(parked: tuple[Any, str]) -> None:
    """The CLI follows a job newest first, 100 events a call, until it reaches the events it
    has read: with 250 events, what came after event 20 takes three calls."""
    sfn, arn = parked
    events = whole_history(sfn, arn)
    calls: list[dict[str, Any]] = []
    sfn.meta.events.register(
        "provide-client-params.states.GetExecutionHistory",
        lambda params, **_: calls.append(dict(params)),
    )
    reader = Executions(sfn, cast(Any, None))
    assert reader.history(arn, after=20) == events[20:]
    # Newest first, each call 100 older events, until one holds event 20.
    assert len(calls) == (len(events) - 20) // DEFAULT_PAGE + 1
    assert all(c["reverseOrder"] and c["maxResults"] == DEFAULT_PAGE for c in calls)
    assert reader.history(arn, newest=5) == events[-5:]
    assert reader.history(arn, after=len(events)) == []
