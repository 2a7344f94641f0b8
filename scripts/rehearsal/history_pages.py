"""moto's GetExecutionHistory, answering in pages as Step Functions does.

Step Functions returns at most ``maxResults`` events a call (0 or absent: 100; at most 1,000),
oldest first or, with ``reverseOrder``, newest first, with a ``nextToken`` while more remain;
a token is for the same request ("Keep all other arguments unchanged") and a bad one is
refused with InvalidToken; ``includeExecutionData`` false leaves out the events' input and
output (API reference, GetExecutionHistory; botocore's stepfunctions model, its
GetExecutionHistoryInput and errors). moto 5 answers every call with the whole history,
oldest first, whatever was asked: a reader that pages wrongly (the CLI follows a job with
``reverseOrder`` and pages of 100, scripts/cluster_lib/executions.py) or reads one page and
takes it for the whole history passes against it and fails on AWS; and a long history was
serialized whole for every poll.

Adjusted: the answer is the requested page of the interpreter's own history. A token names
the execution, the order and the ID of the page's last event, so the next page starts after
that event, however many events the running execution has added meanwhile.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from typing import Any

#: The page size when maxResults is 0 or absent, and the largest one (API reference).
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: What includeExecutionData false leaves out of an event's details.
EXECUTION_DATA = ("input", "inputDetails", "output", "outputDetails")


def _token(arn: str, reverse: bool, last_id: int) -> str:
    raw = json.dumps({"arn": arn, "reverse": reverse, "after": last_id}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _after(token: str, arn: str, reverse: bool) -> int:
    """The last event ID of the page that `token` continues; ValueError if it is not a token
    of this request."""
    try:
        read = json.loads(base64.urlsafe_b64decode(token.encode()))
        after = read["after"]
        same = read["arn"] == arn and read["reverse"] == reverse
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError("not a token of GetExecutionHistory") from error
    if not same or not isinstance(after, int):
        raise ValueError("the token is for another execution or order")
    return after


def page(
    events: list[dict[str, Any]],
    arn: str,
    *,
    max_results: int | None,
    reverse: bool,
    token: str | None,
    include_data: bool = True,
) -> dict[str, Any]:
    """The page of `events` (the whole history, oldest first) that the request asks for."""
    size = max_results or DEFAULT_PAGE
    ordered = list(reversed(events)) if reverse else list(events)
    if token is not None:
        after = _after(token, arn, reverse)
        ordered = [e for e in ordered if (e["id"] < after if reverse else e["id"] > after)]
    found = ordered[:size]
    if not include_data:
        found = [_without_data(e) for e in found]
    answer: dict[str, Any] = {"events": found}
    if len(ordered) > size:
        answer["nextToken"] = _token(arn, reverse, found[-1]["id"])
    return answer


def _without_data(event: dict[str, Any]) -> dict[str, Any]:
    stripped = dict(event)
    for key, value in event.items():
        if key.endswith("EventDetails") and isinstance(value, dict):
            stripped[key] = {k: v for k, v in value.items() if k not in EXECUTION_DATA}
    return stripped


def whole_history(client: Any, arn: str) -> list[dict[str, Any]]:
    """Every event of the execution `arn`, oldest first, in pages of MAX_PAGE (Step Functions'
    GetExecutionHistory through botocore's paginator; `client` a stepfunctions client)."""
    events: list[dict[str, Any]] = []
    pages = client.get_paginator("get_execution_history").paginate(
        executionArn=arn, PaginationConfig={"PageSize": MAX_PAGE}
    )
    for found in pages:
        events += found["events"]
    return events


@contextlib.contextmanager
def histories_in_pages() -> Iterator[None]:
    """Within it, moto's GetExecutionHistory answers one page, as Step Functions does."""
    from moto.core.responses import ActionResult
    from moto.stepfunctions.exceptions import InvalidToken, ValidationException
    from moto.stepfunctions.responses import StepFunctionResponse

    original = StepFunctionResponse.get_execution_history

    def get_execution_history(self: Any) -> Any:
        arn = self._get_param("executionArn")
        size = self._get_param("maxResults")
        if size is not None and size > MAX_PAGE:  # botocore checks the minimum only
            raise ValidationException(
                f"1 validation error detected: Value '{size}' at 'maxResults' failed to "
                f"satisfy constraint: Member must have value less than or equal to {MAX_PAGE}"
            )
        history = self.stepfunction_backend.get_execution_history(arn)
        include = self._get_param("includeExecutionData")
        try:
            answer = page(
                list(history["events"]),
                arn,
                max_results=size,
                reverse=bool(self._get_param("reverseOrder")),
                token=self._get_param("nextToken"),
                include_data=include is None or bool(include),
            )
        except ValueError as error:
            raise InvalidToken(str(error)) from None
        return ActionResult(answer)

    StepFunctionResponse.get_execution_history = get_execution_history  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepFunctionResponse.get_execution_history = original  # type: ignore[method-assign]
