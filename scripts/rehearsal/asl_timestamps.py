"""moto's Amazon States Language interpreter, made to read a Choice rule's timestamps as Step
Functions does.

The ASL specification (Choice Rules, "Timestamps") takes RFC 3339 timestamps with an uppercase
T and Z, and Step Functions accepts a fraction of a second in them and ignores it when it
compares. moto (5.x, moto/stepfunctions/parser/.../implementations/is_operator.py,
`IsTimestamp.string_to_timestamp`) parses only "%Y-%m-%dT%H:%M:%SZ", so the timestamps Step
Functions itself writes ($$.State.EnteredTime, an AWS SDK task's answers: "2026-11-28T02:33:00
.000Z") never compare: every TimestampXxx rule is false. LocalStack, whose interpreter moto's
is, fixed the same (localstack/localstack pull request 9813: "StepFunctions on AWS also allows
specifying milliseconds or microseconds (though they seem to be ignored anyway)"); this does
what that fix does: the fraction is accepted and dropped.
"""

from __future__ import annotations

import contextlib
import datetime
import re
from collections.abc import Iterator

#: RFC 3339's date-time in UTC as the ASL specification restricts it, with an optional
#: fraction of a second (the pattern LocalStack's interpreter checks).
TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d+)?Z")


def parse_timestamp(text: object) -> datetime.datetime | None:
    """The time `text` names to the second, or None where it is no ASL timestamp."""
    if not isinstance(text, str) or not (match := TIMESTAMP.fullmatch(text)):
        return None
    try:
        return datetime.datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S")
    except ValueError:  # a month 13, a minute 61
        return None


@contextlib.contextmanager
def rfc3339_timestamps() -> Iterator[None]:
    """Within it, moto's Choice rules parse timestamps with `parse_timestamp`."""
    from moto.stepfunctions.parser.asl.component.state.choice.comparison.operator.implementations import (  # noqa: E501
        is_operator,
    )

    owner = is_operator.IsTimestamp
    original = owner.__dict__["string_to_timestamp"]
    owner.string_to_timestamp = staticmethod(parse_timestamp)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        owner.string_to_timestamp = original  # type: ignore[method-assign]
