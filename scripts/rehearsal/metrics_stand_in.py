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

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from botocore.utils import parse_timestamp

from scripts.rehearsal.logs_stand_in import Event, LogsStandIn
from scripts.rehearsal.metric_filter import Datapoint, MetricFilter, json_event
from scripts.rehearsal.ssm_stand_in import LocalError

STATISTICS: dict[str, Callable[[list[float]], float]] = {
    "Maximum": max,
    "Minimum": min,
    "Sum": sum,
    "SampleCount": lambda values: float(len(values)),
}


#: A datapoint at its event's time (seconds).
Point = tuple[float, Datapoint]


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
        #: A shipped stream's events only grow (logs_stand_in.py `_ship`), and an event's
        #: datapoints are made once, at ingestion: per stream, the events read and their points.
        self._published: dict[str, tuple[int, list[Point]]] = {}
        #: A command's output file is read again only once it changed (its size or its time,
        #: which is its events' time): per file, the (mtime, size) read and its points.
        self._files: dict[Path, tuple[tuple[int, int], list[Point]]] = {}
        self._lock = threading.Lock()

    def _points(self, events: list[Event]) -> list[Point]:
        found = []
        for event in events:
            parsed = json_event(event["message"])  # once for every filter
            if parsed is None:
                continue
            for metric_filter in self.filters:
                point = metric_filter.datapoint_of(parsed)
                if point is not None:
                    found.append((event["timestamp"] / 1000, point))
        return found

    def _file_points(self, path: Path) -> list[Point]:
        stat = path.stat()
        version = (stat.st_mtime_ns, stat.st_size)
        with self._lock:
            read = self._files.get(path)
        if read is not None and read[0] == version:
            return read[1]
        points = self._points(self.logs._events(path))
        with self._lock:  # if the file changed since its stat, the next look reads it again
            self._files[path] = (version, points)
        return points

    def datapoints(self) -> list[Point]:
        """(seconds, datapoint) for every event of the training log group the filters match:
        at 1,024 nodes, the commands' output alone is thousands of files and more than a
        million lines (tests/test_scale_rehearsal.py), and each progress read asks again."""
        found = []
        streams = self.logs._streams(self.logs.training_log_group)
        for name, source in streams.items():
            if not isinstance(source, list):
                found.extend(self._file_points(source))
                continue
            with self._lock:
                read, points = self._published.setdefault(name, (0, []))
                points.extend(self._points(source[read:]))
                self._published[name] = (len(source), points)
            found.extend(points)
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
