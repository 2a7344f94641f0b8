"""The stand-in's CloudWatch metrics: GetMetricData over the datapoints that the operations
stack's metric filters (as synthesized: metric_filter.py) make of the training log group's
events, as the logs stand-in serves them (logs_stand_in.py: the nodes' metrics files, shipped
as the CloudWatch agent ships them).

What is served follows the GetMetricData API reference (botocore's cloudwatch model): a
MetricStat query names a metric by namespace, name and its exact set of dimensions; StartTime
is inclusive and, less than 15 days ago, rounded down to the minute; EndTime is exclusive;
each period (from the epoch, a multiple of Period) with a datapoint gives one value of the
statistic (Maximum, SampleCount, Sum, Minimum: the ones implemented here); TimestampDescending
returns the newest first. Every answer passes botocore's output shape (aws_stand_in.py
validate_answer) before the caller sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from botocore.utils import parse_timestamp

from scripts.rehearsal.logs_stand_in import LogsStandIn
from scripts.rehearsal.metric_filter import Datapoint, MetricFilter
from scripts.rehearsal.ssm_stand_in import LocalError

STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "Maximum": max,
    "Minimum": min,
    "Sum": sum,
    "SampleCount": lambda values: float(len(values)),
}


def _seconds(value: Any) -> float:
    when = value if isinstance(value, datetime) else parse_timestamp(value)
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


class MetricsStandIn:
    """GetMetricData for the metrics the training log group's filters publish."""

    def __init__(self, logs: LogsStandIn, filters: list[MetricFilter]) -> None:
        self.logs = logs
        self.filters = filters
        #: Every request, as botocore passed it (a test reads what was asked).
        self.requests: list[dict[str, Any]] = []

    def datapoints(self) -> list[tuple[float, Datapoint]]:
        """(seconds, datapoint) for every event of the training log group the filters match."""
        found = []
        streams = self.logs._streams(self.logs.training_log_group)
        for source in streams.values():
            for event in self.logs._events(source):
                for metric_filter in self.filters:
                    point = metric_filter.datapoint(event["message"])
                    if point is not None:
                        found.append((event["timestamp"] / 1000, point))
        return found

    def _cloudwatch_GetMetricData(self, params: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(params)
        start = _seconds(params["StartTime"]) // 60 * 60  # rounded down to the minute
        end = _seconds(params["EndTime"])
        descending = params.get("ScanBy", "TimestampDescending") == "TimestampDescending"
        points = self.datapoints()
        results = []
        for query in params["MetricDataQueries"]:
            stat = query.get("MetricStat")
            if stat is None or stat["Stat"] not in STATISTICS:
                raise LocalError(
                    "InvalidParameterValue",
                    f"the stand-in serves MetricStat queries of {', '.join(STATISTICS)} only",
                )
            metric, period = stat["Metric"], int(stat["Period"])
            named = metric.get("Dimensions", [])
            dimensions = tuple(sorted((d["Name"], d["Value"]) for d in named))
            buckets: dict[float, list[float]] = {}
            for seconds, point in points:
                if (
                    point.namespace == metric["Namespace"]
                    and point.name == metric["MetricName"]
                    and tuple(sorted(point.dimensions)) == dimensions
                    and start <= seconds < end
                ):
                    buckets.setdefault(seconds // period * period, []).append(point.value)
            times = sorted(buckets, reverse=descending)
            if query.get("ReturnData", True):
                results.append(
                    {
                        "Id": query["Id"],
                        "Label": query.get("Label", metric["MetricName"]),
                        "Timestamps": [datetime.fromtimestamp(t, UTC) for t in times],
                        "Values": [STATISTICS[stat["Stat"]](buckets[t]) for t in times],
                        "StatusCode": "Complete",
                    }
                )
        return {"MetricDataResults": results, "Messages": []}
