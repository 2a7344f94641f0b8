"""CloudWatch Logs metric filters, as far as the training log group's use them: a log event
becomes a datapoint, or nothing, the way the synthesized AWS::Logs::MetricFilter says.

The syntax and its meaning are the CloudWatch Logs user guide's ("Filter pattern syntax for
metric filters, subscription filters, filter log events, and Live Tail", Matching terms in
JSON log events; "Publishing dimensions with metrics from values in JSON or space-delimited
log events"):

- `{ EXPRESSION }` is a JSON pattern: it matches only an event whose message is a JSON
  object; any other event (text, a logger's prefix before JSON) does not match.
- A comparison is `$.FIELD OPERATOR VALUE`; a field the event lacks does not match. With a
  number, the operators =, !=, <, <=, >, >= compare numbers (a field that is not a number does
  not match); with a quoted string, = and != compare strings.
- `&&` and `||` join comparisons and parentheses group them.
- The metric value `$.FIELD` is the field's number (an event whose field is not a number
  emits nothing); a dimension `$.FIELD` is the field's value as text.

Anything else the syntax allows (wildcards, IS NULL, arrays, regular expressions, and && and ||
mixed without parentheses, whose precedence the guide does not state) is refused with
FilterSyntaxError rather than guessed: the stand-in covers the patterns stacks/progress_metric.py
deploys, no more.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

_TOKEN = re.compile(
    r"\s*(?:(?P<paren>[()])|(?P<join>&&|\|\|)|(?P<field>\$\.[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>!=|<=|>=|=|<|>)|(?P<number>-?\d+(?:\.\d+)?)|(?P<string>\"[^\"*]*\"))"
)


class FilterSyntaxError(ValueError):
    """A pattern outside what this stand-in implements."""


@dataclass(frozen=True)
class _Comparison:
    field: str
    op: str
    value: float | str

    def matches(self, event: dict[str, Any]) -> bool:
        if self.field not in event:
            return False
        found = event[self.field]
        if isinstance(self.value, str):
            if not isinstance(found, str) or self.op not in ("=", "!="):
                return False
            return (found == self.value) == (self.op == "=")
        if isinstance(found, bool) or not isinstance(found, int | float):
            return False
        return {
            "=": found == self.value,
            "!=": found != self.value,
            "<": found < self.value,
            "<=": found <= self.value,
            ">": found > self.value,
            ">=": found >= self.value,
        }[self.op]


@dataclass(frozen=True)
class _Join:
    op: str  # && or ||
    parts: tuple[Any, ...]

    def matches(self, event: dict[str, Any]) -> bool:
        results = (part.matches(event) for part in self.parts)
        return all(results) if self.op == "&&" else any(results)


def _tokens(text: str) -> list[tuple[str, str]]:
    tokens, at = [], 0
    while at < len(text):
        if not text[at:].strip():
            break
        found = _TOKEN.match(text, at)
        if not found or found.lastgroup is None:
            raise FilterSyntaxError(f"not implemented here at {text[at:]!r}")
        tokens.append((found.lastgroup, found[found.lastgroup]))
        at = found.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens, self.at = tokens, 0

    def take(self, kind: str) -> str:
        if self.at >= len(self.tokens) or self.tokens[self.at][0] != kind:
            got = self.tokens[self.at][1] if self.at < len(self.tokens) else "the end"
            raise FilterSyntaxError(f"expected a {kind}, found {got!r}")
        self.at += 1
        return self.tokens[self.at - 1][1]

    def peek(self) -> str | None:
        return self.tokens[self.at][0] if self.at < len(self.tokens) else None

    def expression(self) -> Any:
        parts, joins = [self.term()], set()
        while self.peek() == "join":
            joins.add(self.take("join"))
            parts.append(self.term())
        if len(joins) > 1:
            raise FilterSyntaxError("&& and || mixed without parentheses")
        return parts[0] if len(parts) == 1 else _Join(joins.pop(), tuple(parts))

    def term(self) -> Any:
        if self.peek() == "paren":
            if self.take("paren") != "(":
                raise FilterSyntaxError("a ')' with no '('")
            inner = self.expression()
            if self.take("paren") != ")":
                raise FilterSyntaxError("a '(' with no ')'")
            return inner
        field = self.take("field")[2:]
        op = self.take("op")
        if self.peek() == "number":
            return _Comparison(field, op, float(self.take("number")))
        return _Comparison(field, op, self.take("string")[1:-1])


def parse(pattern: str) -> Any:
    """The pattern's expression; FilterSyntaxError for what this stand-in does not implement."""
    text = pattern.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise FilterSyntaxError(f"{pattern!r} is not a JSON pattern ({{ ... }})")
    parser = _Parser(_tokens(text[1:-1]))
    expression = parser.expression()
    if parser.peek() is not None:
        raise FilterSyntaxError(f"{pattern!r}: left over after the expression")
    return expression


def _field(path: str) -> str:
    if not re.fullmatch(r"\$\.[A-Za-z_][A-Za-z0-9_]*", path):
        raise FilterSyntaxError(f"{path!r}: only a top-level field ($.name) is implemented")
    return path[2:]


@dataclass(frozen=True)
class Datapoint:
    namespace: str
    name: str
    dimensions: tuple[tuple[str, str], ...]
    value: float


class MetricFilter:
    """One AWS::Logs::MetricFilter resource of a synthesized template."""

    def __init__(self, properties: dict[str, Any]) -> None:
        self.expression = parse(properties["FilterPattern"])
        (transformation,) = properties["MetricTransformations"]
        if "DefaultValue" in transformation:
            raise FilterSyntaxError("a default value is not implemented here")
        self.namespace = str(transformation["MetricNamespace"])
        self.name = str(transformation["MetricName"])
        self.value = _field(transformation["MetricValue"])
        self.dimensions = tuple(
            (d["Key"], _field(d["Value"])) for d in transformation.get("Dimensions", [])
        )

    def datapoint(self, message: str) -> Datapoint | None:
        """What one log event's message publishes: a datapoint, or None."""
        event = json_event(message)
        return None if event is None else self.datapoint_of(event)

    def datapoint_of(self, event: dict[str, Any]) -> Datapoint | None:
        """What a log event whose message is the JSON object `event` publishes."""
        if not self.expression.matches(event):
            return None
        value = event.get(self.value)
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        if not math.isfinite(value):
            return None
        dimensions = tuple((key, str(event.get(field))) for key, field in self.dimensions)
        return Datapoint(self.namespace, self.name, dimensions, float(value))


def json_event(message: str) -> dict[str, Any] | None:
    """A log event's message as the JSON object a filter pattern of the JSON form reads, or None
    where it is not one (such a pattern matches no other message). A message that does not
    start with "{" after JSON's whitespace is no object, and is not parsed: most of what the
    training log group holds is the commands' plain output."""
    if message.lstrip(" \t\n\r")[:1] != "{":
        return None
    try:
        event = json.loads(message)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def template_filters(template: dict[str, Any], log_group: str | None = None) -> list[MetricFilter]:
    """The template's metric filters (on the log group of logical ID `log_group`, if named)."""
    found = []
    for resource in template["Resources"].values():
        if resource["Type"] != "AWS::Logs::MetricFilter":
            continue
        properties = resource["Properties"]
        if log_group is not None and properties["LogGroupName"] != {"Ref": log_group}:
            continue
        found.append(MetricFilter(properties))
    return found
