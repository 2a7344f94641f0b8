"""A job's progress as the cluster's JobStep metric (stacks/progress_metric.py): the training log
group's metric filters, as synthesized, checked against botocore's PutMetricFilter model and the
CloudWatch Logs limits, and run by the stand-in's matcher (scripts/rehearsal/metric_filter.py,
the CloudWatch Logs user guide's filter pattern syntax) over the lines the reference trainer's
metrics logger writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import botocore.session
import pytest
from botocore.validate import validate_parameters

from scripts.cluster_lib.progress import PHASES as SCHEMA_PHASES
from scripts.cluster_lib.progress import read
from scripts.rehearsal import metrics_stand_in
from scripts.rehearsal.logs_stand_in import LogsStandIn
from scripts.rehearsal.metric_filter import (
    Datapoint,
    FilterSyntaxError,
    MetricFilter,
    json_event,
    parse,
    template_filters,
)
from stacks.progress_metric import METRIC_NAME, PHASES
from tests.cdk_support import Synth, resources, synth
from workload.metrics import PROGRESS_VARIABLE, MetricsLogger

#: "The maximum number of metric filters that can be associated with a log group is 100"
#: (botocore's logs model, PutMetricFilter); "One metric filter can include as many as three
#: dimensions" (MetricTransformation.dimensions).
FILTERS_PER_LOG_GROUP = 100
DIMENSIONS_PER_FILTER = 3


@pytest.fixture(scope="module")
def default() -> Synth:
    return synth()


def training_log_group(template: dict[str, Any]) -> str:
    (logical_id,) = [
        k
        for k, v in resources(template, "AWS::Logs::LogGroup").items()
        if k.startswith("TrainingLogGroup")
    ]
    return logical_id


def as_put_metric_filter(properties: dict[str, Any]) -> dict[str, Any]:
    """A MetricFilter's CloudFormation properties as the PutMetricFilter request they make."""
    (transformation,) = properties["MetricTransformations"]
    request: dict[str, Any] = {
        "logGroupName": "/trainium-cluster/trainium/training",
        "filterName": "progress",
        "filterPattern": properties["FilterPattern"],
        "metricTransformations": [
            {
                "metricName": transformation["MetricName"],
                "metricNamespace": transformation["MetricNamespace"],
                "metricValue": transformation["MetricValue"],
            }
        ],
    }
    if "Dimensions" in transformation:
        request["metricTransformations"][0]["dimensions"] = {
            d["Key"]: d["Value"] for d in transformation["Dimensions"]
        }
    return request


def test_the_training_log_group_has_the_two_progress_filters_within_the_limits(
    default: Synth,
) -> None:
    """Both filters are on the training log group (where the CloudWatch agent ships the
    metrics files), publish JobStep in the cluster's namespace, have no default value (it would
    emit a datapoint for every line of the commands' output), at most three dimensions, and
    make valid PutMetricFilter requests (botocore's logs model)."""
    template = default.templates["operations"]
    filters = resources(template, "AWS::Logs::MetricFilter")
    assert len(filters) == 2
    group = training_log_group(template)
    on_group = [f for f in filters.values() if f["Properties"]["LogGroupName"] == {"Ref": group}]
    assert len(on_group) == 2 <= FILTERS_PER_LOG_GROUP
    model = botocore.session.get_session().get_service_model("logs")
    shape = model.operation_model("PutMetricFilter").input_shape
    for resource in on_group:
        (transformation,) = resource["Properties"]["MetricTransformations"]
        assert transformation["MetricNamespace"] == default.config.metrics_namespace
        assert transformation["MetricName"] == METRIC_NAME
        assert "DefaultValue" not in transformation
        assert len(transformation.get("Dimensions", [])) <= DIMENSIONS_PER_FILTER
        validate_parameters(as_put_metric_filter(resource["Properties"]), shape)
    assert PHASES == SCHEMA_PHASES  # the phases the filter knows are the contract's


def logger_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the reference trainer's metrics logger (rank 0) writes to TRAINIUM_METRICS_FILE
    through one run's phases."""
    progress = tmp_path / "metrics" / "job.jsonl"
    monkeypatch.setenv(PROGRESS_VARIABLE, str(progress))
    logger = MetricsLogger(tmp_path / "out", enabled=True, total_steps=20, initial_step=0)
    logger.phase(0, "compiling")
    logger.write("train", step=10, loss=0.5, lr=1e-4, samples_per_second=12.5)
    logger.phase(10, "saving")
    logger.phase(10, "compiling")
    logger.write("eval", step=10, eval_loss=0.4, eval_accuracy=0.75)
    logger.phase(20, "evaluating")
    logger.write("hold", step=20)  # not a progress event: not in the file
    logger.close()
    return progress.read_text().splitlines()


def test_every_line_of_the_metrics_file_is_a_jobstep_datapoint_and_nothing_else_is(
    default: Synth, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The synthesized filters, run over the logger's lines: each is one JobStep datapoint of
    its step, and one more with its phase as the Phase dimension. The group's other events
    (a command's output, a logger's JSON after a prefix, a line of another job's schema) make
    none, and a line with a phase the contract does not know makes no Phase datapoint."""
    template = default.templates["operations"]
    filters = template_filters(template, training_log_group(template))
    namespace = default.config.metrics_namespace
    lines = logger_lines(tmp_path, monkeypatch)
    records, errors = read(lines)
    assert errors == [] and len(records) == 6

    def published(message: str) -> list[Datapoint]:
        return [p for f in filters if (p := f.datapoint(message)) is not None]

    for line, record in zip(lines, records, strict=True):
        assert sorted(published(line), key=lambda p: p.dimensions) == [
            Datapoint(namespace, METRIC_NAME, (), float(record.step)),
            Datapoint(namespace, METRIC_NAME, (("Phase", str(record.phase)),), float(record.step)),
        ], line
    assert [p.dimensions for line in lines for p in published(line) if p.dimensions] == [
        (("Phase", phase),)
        for phase in ("compiling", "training", "saving", "compiling", "evaluating", "evaluating")
    ]
    others = [
        '2026-11-26 05:00:00 INFO workload.train: summary: {"step": 20}',
        "step 10/20 loss 0.5000 lr 1.00e-04 12.5 samples/s",
        json.dumps({"event": "train", "loss": 0.5}),
        json.dumps({"step": "10", "phase": "training"}),
        json.dumps({"step": -1, "phase": "training"}),
        json.dumps([{"step": 1}]),
    ]
    assert [published(line) for line in others] == [[]] * len(others)
    warmup = published(json.dumps({"step": 3, "phase": "warmup"}))
    assert warmup == [Datapoint(namespace, METRIC_NAME, (), 3.0)]


def test_the_stand_ins_matcher_refuses_what_it_does_not_implement() -> None:
    """Only what the deployed patterns use is implemented (the CloudWatch Logs user guide's
    JSON patterns: comparisons joined with && or ||, grouped in parentheses); the rest is
    refused, never guessed."""
    for pattern in (
        "ERROR",  # a term pattern, not JSON
        "{ $.step >= 0 && $.a = 1 || $.b = 2 }",  # precedence the guide does not state
        '{ $.phase = "train*" }',  # a wildcard
        "{ $.step IS NULL }",
        "{ $.a.b = 1 }",
        "{ $.step >= }",
    ):
        with pytest.raises(FilterSyntaxError):
            parse(pattern)
    both = parse('{ ($.a = 1) && ($.b != "x" || $.c < 2.5) }')
    assert both.matches({"a": 1, "b": "y"})
    assert both.matches({"a": 1.0, "b": "x", "c": 2})
    assert not both.matches({"a": 1, "b": "x", "c": 3})
    assert not both.matches({"a": "1", "b": "y"})  # a number compares only with a number
    assert not both.matches({"b": "y"})  # a missing field does not match
    with pytest.raises(FilterSyntaxError):
        MetricFilter(
            {
                "FilterPattern": "{ $.step >= 0 }",
                "MetricTransformations": [
                    {"MetricName": "m", "MetricNamespace": "n", "MetricValue": "$.step",
                     "DefaultValue": 0}
                ],
            }
        )  # fmt: skip


class _ShippedLogs:
    """What MetricsStandIn reads of the logs stand-in: the training log group's streams, a
    shipped stream as its growing list of events and a command's output as a file."""

    training_log_group = "/trainium-cluster/trainium/training"

    def __init__(self, output: Path) -> None:
        self.shipped: dict[str, list[dict[str, Any]]] = {"i-0/metrics": []}
        self.output = output

    def _streams(self, group: str) -> dict[str, Any]:
        assert group == self.training_log_group
        return {**self.shipped, "cmd/i-0/RunTraining/stdout": self.output}

    @staticmethod
    def _events(source: Any) -> list[dict[str, Any]]:
        return LogsStandIn._events(source)

    def ship(self, stream: str, lines: list[str], stamp: int) -> None:
        events = self.shipped.setdefault(stream, [])
        events.extend({"timestamp": stamp, "message": m, "ingestionTime": stamp} for m in lines)


def test_the_metrics_stand_in_reads_each_event_once_and_answers_as_if_anew(
    default: Synth, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GetMetricData's datapoints as events are shipped and a command's output grows between
    calls: the same as a stand-in that reads every event for the first time, each shipped
    message parsed once (not once a filter and a call: every execution's polls ask again and
    again), a command's output file read again only once it changed, and then at its new time."""
    template = default.templates["operations"]
    filters = template_filters(template, training_log_group(template))
    lines = logger_lines(tmp_path, monkeypatch)
    output = tmp_path / "stdout"
    output.write_text(lines[0] + "\n")
    logs = _ShippedLogs(output)
    parsed: list[str] = []

    def counted(message: str) -> dict[str, Any] | None:
        parsed.append(message)
        return json_event(message)

    monkeypatch.setattr(metrics_stand_in, "json_event", counted)
    metrics = metrics_stand_in.MetricsStandIn(cast(Any, logs), filters)
    answers = []
    for stream, shipped, stamp, printed in (
        ("i-0/metrics", lines[:2], 60_000, None),
        ("i-0/metrics", [*lines[2:4], "not json", "[1]"], 120_000, None),
        ("i-1/metrics", lines[4:], 180_000, "a line of a command's output"),
        ("i-1/metrics", [], 240_000, None),
    ):
        logs.ship(stream, shipped, stamp)
        if printed is not None:
            with output.open("a") as f:
                f.write(printed + "\n")
        answers.append(metrics.datapoints())
        parsed_by_metrics = len(parsed)
        anew = metrics_stand_in.MetricsStandIn(cast(Any, logs), filters)
        assert sorted(answers[-1], key=repr) == sorted(anew.datapoints(), key=repr)
        del parsed[parsed_by_metrics:]
    assert [len(points) for points in answers] == [6, 10, 14, 14]  # 2 a line, 2 from stdout
    shipped_messages = [e["message"] for events in logs.shipped.values() for e in events]
    printed_twice = [lines[0], lines[0], "a line of a command's output"]
    assert sorted(parsed) == sorted(shipped_messages + printed_twice)
    stamp = int(output.stat().st_mtime * 1000) / 1000
    assert sum(1 for seconds, _ in answers[-1] if seconds == stamp) == 2
    # JSON's whitespace may come before the object; a message that is no object is not one
    assert json_event(' \t\r\n{"step": 1}') == {"step": 1}
    assert [json_event(m) for m in ("[1]", "\xa0{}", "{", "1", "")] == [None] * 5
