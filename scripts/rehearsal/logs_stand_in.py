"""The stand-in's CloudWatch Logs: the nodes' command output, as the SSM agent streams it
with CloudWatchOutputEnabled, and the nodes' job logs, as the CloudWatch agent ships them.

- Each invocation's stdout and stderr files (written by the node agent) are the log streams
  `<command-id>/<instance-id>/<step>/stdout` and `.../stderr` of the command's log group; one
  event per line, stamped with the file's modification time.
- Each node's `/var/log/trainium-cluster/jobs/*.log`, `precompile/*.log` and
  `metrics/*.jsonl` are the streams `<instance-id>/jobs`, `<instance-id>/precompile` and
  `<instance-id>/metrics` of the training log group, as the
  CloudWatch agent's configuration in scripts/node/bootstrap.sh (phase_monitoring) ships them:
  only the newest file a wildcard matches is read ("file_path", CloudWatch agent user guide),
  on from where the agent left it, whole lines only. A line is stamped no earlier than it was
  written (the agent stamps a line without a timestamp_format with the time it reads it): here
  with the file's modification time when the stand-in reads it, on any call.
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path
from typing import Any

from scripts.rehearsal.ssm_stand_in import LocalError, SsmStandIn

#: The node's log folder and the CloudWatch agent's file entries in it (bootstrap.sh
#: phase_monitoring): folder -> the wildcard of its files; stream `<instance-id>/<folder>`.
#: `metrics` holds the jobs' metrics files (launch.sh TRAINIUM_METRICS_FILE), one JSON object
#: a line, which `cluster.py jobs` reads.
NODE_LOG_DIR = "/var/log/trainium-cluster"
AGENT_FOLDERS = {"jobs": "*.log", "precompile": "*.log", "metrics": "*.jsonl"}

Event = dict[str, Any]


def _messages(text: str) -> list[str]:
    """The log events a text becomes: its lines, less the empty ones, which no agent can send
    (PutLogEvents' InputLogEvent.message has a minimum length of 1, botocore's logs model)."""
    return [line for line in text.splitlines() if line]


class LogsStandIn:
    """DescribeLogStreams, GetLogEvents and FilterLogEvents over the commands' output files
    and the nodes' job logs; StartQuery and GetQueryResults for the one Insights query the CLI
    sends (scripts/cluster_lib/stragglers.py QUERY), refusing any other."""

    def __init__(self, ssm: SsmStandIn, *, training_log_group: str | None = None) -> None:
        self.ssm = ssm
        #: The group the nodes' CloudWatch agent ships to (the stack's TrainingLogGroupName,
        #: as aws_stand_in.py names it).
        self.training_log_group = (
            training_log_group or f"/trainium-cluster/{ssm.instances.cluster_name}/training"
        )
        self._lock = threading.Lock()
        #: What the CloudWatch agent has shipped: stream -> events; and where it left each file.
        self._shipped: dict[str, list[Event]] = {}
        self._offsets: dict[Path, int] = {}
        #: Insights queries started: query ID -> (group, start, end in ms) and their polls.
        self._queries: dict[str, tuple[str, int, int]] = {}
        self._polled: dict[str, int] = {}

    def _ship(self) -> None:
        """Reads on each node's newest job log per folder, as the CloudWatch agent does."""
        instances = self.ssm.instances
        with self._lock:
            for instance in list(instances.instances):
                for folder, wildcard in AGENT_FOLDERS.items():
                    directory = instances.upper(instance, f"{NODE_LOG_DIR}/{folder}")
                    files = [p for p in directory.glob(wildcard) if p.is_file()]
                    if not files:
                        continue
                    newest = max(files, key=lambda p: p.stat().st_mtime_ns)
                    stamp = int(newest.stat().st_mtime * 1000)
                    offset = self._offsets.get(newest, 0)
                    with newest.open("rb") as f:
                        f.seek(offset)
                        data = f.read()
                    whole = data[: data.rfind(b"\n") + 1]
                    if not whole:
                        continue
                    self._offsets[newest] = offset + len(whole)
                    events = self._shipped.setdefault(f"{instance.instance_id}/{folder}", [])
                    for line in _messages(whole.decode(errors="replace")):
                        events.append({"timestamp": stamp, "message": line, "ingestionTime": stamp})

    def _streams(self, group: str) -> dict[str, Path | list[Event]]:
        """Log streams: the agent's with CloudWatchOutputEnabled,
        <command-id>/<instance-id>/<step>/stdout|stderr, and in the training log group the
        CloudWatch agent's <instance-id>/jobs|precompile|metrics."""
        streams: dict[str, Path | list[Event]] = {}
        for command in self.ssm.commands.values():
            if command.log_group != group:
                continue
            for instance_id, inv in command.invocations.items():
                for name in ("stdout", "stderr"):
                    if (inv.folder / name).is_file():
                        key = f"{command.command_id}/{instance_id}/{command.step}/{name}"
                        streams[key] = inv.folder / name
        if group == self.training_log_group:
            self._ship()
            with self._lock:
                streams.update({k: list(v) for k, v in self._shipped.items()})
        return streams

    def _logs_DescribeLogStreams(self, params: dict[str, Any]) -> dict[str, Any]:
        prefix = params.get("logStreamNamePrefix", "")
        names = sorted(n for n in self._streams(params["logGroupName"]) if n.startswith(prefix))
        start = int(params.get("nextToken") or 0)
        size = int(params.get("limit") or 50)
        views = [{"logStreamName": n, "creationTime": 0} for n in names[start : start + size]]
        result: dict[str, Any] = {"logStreams": views}
        if start + size < len(names):
            result["nextToken"] = str(start + size)
        return result

    @staticmethod
    def _events(source: Path | list[Event]) -> list[Event]:
        if isinstance(source, list):
            return source
        stamp = int(source.stat().st_mtime * 1000)
        lines = _messages(source.read_text(errors="replace"))
        return [{"timestamp": stamp, "message": line, "ingestionTime": stamp} for line in lines]

    @staticmethod
    def _in_time(events: list[Event], params: dict[str, Any]) -> list[Event]:
        """startTime (included) and endTime (excluded), GetLogEvents' and FilterLogEvents'."""
        start, end = params.get("startTime"), params.get("endTime")
        return [
            e
            for e in events
            if (start is None or e["timestamp"] >= start) and (end is None or e["timestamp"] < end)
        ]

    def _logs_GetLogEvents(self, params: dict[str, Any]) -> dict[str, Any]:
        source = self._streams(params["logGroupName"]).get(params["logStreamName"])
        if source is None:
            raise LocalError(
                "ResourceNotFoundException", "The specified log stream does not exist."
            )
        events = self._in_time(self._events(source), params)
        token = params.get("nextToken") or ""
        if token.startswith("f/"):
            start = int(token[2:])
        elif params.get("startFromHead"):
            start = 0
        else:
            start = max(0, len(events) - int(params.get("limit") or 10000))
        page = events[start:]
        if params.get("limit"):
            page = page[: int(params["limit"])]
        end = start + len(page)
        return {
            "events": page,
            "nextForwardToken": f"f/{end}",
            "nextBackwardToken": f"b/{start}",
        }

    def _logs_FilterLogEvents(self, params: dict[str, Any]) -> dict[str, Any]:
        streams = self._streams(params["logGroupName"])
        names = params.get("logStreamNames")
        prefix = params.get("logStreamNamePrefix", "")
        events = []
        for name, source in sorted(streams.items()):
            if (names and name not in names) or not name.startswith(prefix):
                continue
            found = self._in_time(self._events(source), params)
            events += [{**e, "logStreamName": name, "eventId": f"{name}-{i}"}
                       for i, e in enumerate(found)]  # fmt: skip
        start = int(params.get("nextToken") or 0)
        size = int(params.get("limit") or 10000)
        result: dict[str, Any] = {"events": events[start : start + size]}
        if start + size < len(events):
            result["nextToken"] = str(start + size)
        return result

    def _logs_StartQuery(self, params: dict[str, Any]) -> dict[str, Any]:
        """Only stragglers.QUERY over one group: anything else is refused, as a query this
        stand-in cannot evaluate must not pass for one it can."""
        from scripts.cluster_lib.stragglers import QUERY

        if params.get("queryString") != QUERY or not params.get("logGroupName"):
            raise LocalError(
                "MalformedQueryException",
                "the rehearsal evaluates only the nodes'-progress query of "
                "scripts/cluster_lib/stragglers.py, over one log group",
            )
        query_id = str(uuid.uuid4())
        # startTime and endTime: seconds since the epoch (StartQuery, botocore's logs model);
        # both ends inside.
        window = (params["logGroupName"], params["startTime"] * 1000, params["endTime"] * 1000)
        self._queries[query_id] = window
        return {"queryId": query_id}

    def _logs_GetQueryResults(self, params: dict[str, Any]) -> dict[str, Any]:
        """A query runs a while: the first poll finds it Running, the next Complete with every
        metrics stream's max(step) and max(time), each value a string."""
        query_id = params["queryId"]
        if query_id not in self._queries:
            raise LocalError("ResourceNotFoundException", f"query {query_id} does not exist")
        self._polled[query_id] = self._polled.get(query_id, 0) + 1
        if self._polled[query_id] == 1:
            return {"results": [], "status": "Running"}
        group, start, end = self._queries[query_id]
        rows, scanned, matched = [], 0, 0
        for name, source in sorted(self._streams(group).items()):
            events = [e for e in self._events(source) if start <= e["timestamp"] <= end]
            scanned += len(events)
            if not name.endswith("/metrics"):
                continue
            steps, times = [], []
            for event in events:
                try:
                    line = json.loads(event["message"])
                except ValueError:
                    continue
                if not isinstance(line, dict) or not _number(line.get("step")):
                    continue
                matched += 1
                steps.append(line["step"])
                if _number(line.get("time")):
                    times.append(line["time"])
            if not steps:
                continue
            row = [
                {"field": "@logStream", "value": name},
                {"field": "step", "value": str(max(steps))},
            ]
            if times:
                row.append({"field": "at", "value": str(max(times))})
            rows.append(row)
        statistics = {"recordsMatched": float(matched), "recordsScanned": float(scanned),
                      "bytesScanned": 0.0}  # fmt: skip
        return {"results": rows, "statistics": statistics, "status": "Complete"}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
