"""The nodes' output in CloudWatch Logs: the commands' and the jobs'.

Two kinds of stream reach the stack's training log group (output `TrainingLogGroupName`):

- the SSM agent writes each invocation's output, one stream per node and output:
  `<command-id>/<instance-id>/<step>/stdout` and `.../stderr` (the whole output, where SSM
  itself keeps only the first 24,000 characters). For RunTraining and Precompile that is only
  launch.sh's own lines and, when torchrun fails, the last lines of the job's output;
- the CloudWatch agent ships each node's job logs (`/var/log/trainium-cluster/jobs/<job>.log`,
  `precompile/<job>.log`; phase_monitoring in scripts/node/bootstrap.sh) to one stream per
  node and folder, `<instance-id>/jobs` and `<instance-id>/precompile`: everything the job
  wrote, launch.sh's lines among it. One job runs at a time on a node, so a command's part of
  that stream is its time window: from the command's RequestedDateTime to that of the next
  attempt of any job (`job_output_window`).

Read here: the streams of a command or a node, the last lines of a stream, the new lines since
the last read (`StreamReader`, for `logs --follow` and for following rank 0 while a command or
a job runs), and lines matching a filter pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from scripts.cluster_lib.command_history import attempt_of
from scripts.cluster_lib.outputs import Stack

#: The documents whose job output the CloudWatch agent ships, and the folder (and stream
#: suffix) of each: launch.sh --log-folder, bootstrap.sh phase_monitoring's collect_list.
JOB_OUTPUT_FOLDERS = {"RunTraining": "jobs", "Precompile": "precompile"}


def job_stream(instance_id: str, document: str = "RunTraining") -> str:
    """The CloudWatch agent's stream of a node's job logs: `<instance-id>/jobs`."""
    return f"{instance_id}/{JOB_OUTPUT_FOLDERS[document]}"


def metrics_stream(instance_id: str) -> str:
    """The CloudWatch agent's stream of a node's job metrics files (launch.sh's
    TRAINIUM_METRICS_FILE, scripts/cluster_lib/progress.py): `<instance-id>/metrics`."""
    return f"{instance_id}/metrics"


def millis(moment: datetime) -> int:
    """A time as CloudWatch Logs counts it: milliseconds since the epoch."""
    return int(moment.timestamp() * 1000)


def job_output_window(
    command: dict[str, Any], commands: Iterable[dict[str, Any]]
) -> tuple[int, int | None]:
    """The command's part of the nodes' job-log streams, in CloudWatch Logs milliseconds:
    from its RequestedDateTime to the first RequestedDateTime of a later attempt among
    `commands` (the same document's; its own other batches are not an end), or open."""
    start = command["RequestedDateTime"]

    def batch_of_this(other: dict[str, Any]) -> bool:
        return " part " in str(other.get("Comment", "")) and attempt_of(other) == attempt_of(
            command
        )

    later = [
        c["RequestedDateTime"]
        for c in commands
        if c.get("RequestedDateTime") and c["RequestedDateTime"] > start and not batch_of_this(c)
    ]
    return millis(start), (millis(min(later)) if later else None)


class StreamReader:
    """Reads log streams on from where the previous read of each ended (nextForwardToken).
    The first read of a stream starts at its head, or with `first_lines` set, takes only that
    many of its last events."""

    def __init__(self, client: Any, log_group: str, *, first_lines: int | None = None) -> None:
        self.client = client
        self.log_group = log_group
        self.first_lines = first_lines
        self.tokens: dict[str, str] = {}

    def read(self, name: str, window: tuple[int, int | None] | None = None) -> list[dict[str, Any]]:
        """The stream's events not read yet; with `window` (start, end in milliseconds, end
        excluded or None), only those stamped inside it."""
        kwargs: dict[str, Any] = {"logGroupName": self.log_group, "logStreamName": name}
        if window is not None:
            kwargs["startTime"] = window[0]
            if window[1] is not None:
                kwargs["endTime"] = window[1]
        if name in self.tokens:
            kwargs.update(nextToken=self.tokens[name], startFromHead=True)
        elif self.first_lines is None:
            kwargs.update(startFromHead=True)
        else:
            kwargs.update(startFromHead=False, limit=self.first_lines)
        response = self.client.get_log_events(**kwargs)
        self.tokens[name] = response["nextForwardToken"]
        events: list[dict[str, Any]] = response["events"]
        return events


def lines_of(event: dict[str, Any]) -> list[str]:
    """The lines of one log event's message."""
    message: str = event["message"]
    return message.rstrip("\n").splitlines()


class Logs:
    """The training log group's streams, as the CLI reads them."""

    def __init__(self, client: Any, stack: Stack, out: Callable[[str], None]) -> None:
        self.client = client
        self.stack = stack
        self.out = out

    @property
    def log_group(self) -> str:
        return self.stack.outputs()["TrainingLogGroupName"]

    def log_streams(self, log_group: str, prefix: str) -> list[str]:
        """Names of the log streams under prefix (DescribeLogStreams, all pages)."""
        names: list[str] = []
        paginator = self.client.get_paginator("describe_log_streams")
        for page in paginator.paginate(logGroupName=log_group, logStreamNamePrefix=prefix):
            names.extend(stream["logStreamName"] for stream in page["logStreams"])
        return sorted(names)

    def last_events(
        self,
        log_group: str,
        stream: str,
        limit: int,
        window: tuple[int, int | None] | None = None,
    ) -> list[dict[str, Any]]:
        """The last `limit` events of one stream (inside `window`, as StreamReader.read)."""
        kwargs: dict[str, Any] = {}
        if window is not None:
            kwargs["startTime"] = window[0]
            if window[1] is not None:
                kwargs["endTime"] = window[1]
        events: list[dict[str, Any]] = self.client.get_log_events(
            logGroupName=log_group, logStreamName=stream, startFromHead=False, limit=limit,
            **kwargs,
        )["events"]  # fmt: skip
        return events

    def last_lines(self, command_id: str, instance_id: str, limit: int) -> list[str]:
        """The last lines a node wrote for a command, `limit` events of each stream; none
        when CloudWatch Logs cannot tell."""
        lines: list[str] = []
        log_group = self.log_group
        try:
            for stream in reversed(self.log_streams(log_group, f"{command_id}/{instance_id}/")):
                for event in self.last_events(log_group, stream, limit):
                    lines.extend(lines_of(event))
        except (ClientError, BotoCoreError):
            return []
        return lines

    def matching(self, command_id: str, instance_id: str, pattern: str) -> list[str] | None:
        """The messages a node wrote for a command that match a CloudWatch Logs filter
        pattern (the first page of FilterLogEvents); None when CloudWatch Logs cannot tell."""
        try:
            response = self.client.filter_log_events(
                logGroupName=self.log_group,
                logStreamNamePrefix=f"{command_id}/{instance_id}/",
                filterPattern=pattern,
            )
        except (ClientError, BotoCoreError):
            return None
        return [str(event.get("message", "")) for event in response.get("events", [])]

    def reader(self, *, first_lines: int | None = None) -> StreamReader:
        return StreamReader(self.client, self.log_group, first_lines=first_lines)

    def follower(
        self,
        command_id: str,
        instance_id: str,
        *,
        job_output_since: datetime | None = None,
        document: str = "RunTraining",
    ) -> LogFollower:
        """A follower of a node's output of a command; with `job_output_since` (when a
        RunTraining or Precompile command was sent), of the job's whole output in the node's
        job-log stream from then on."""
        return LogFollower(
            self, command_id, instance_id, job_output_since=job_output_since, document=document
        )


class LogFollower:
    """Prints a node's new output from CloudWatch Logs while a command runs: the command's
    streams, or from `job_output_since` on, the node's job-log stream (the job's own lines,
    which the command's output does not carry)."""

    def __init__(
        self,
        logs: Logs,
        command_id: str,
        instance_id: str,
        *,
        job_output_since: datetime | None = None,
        document: str = "RunTraining",
    ) -> None:
        self.logs = logs
        self.prefix = f"{command_id}/{instance_id}/"
        self.stream = job_stream(instance_id, document) if job_output_since else None
        self.window = (millis(job_output_since), None) if job_output_since else None
        self.reader = logs.reader()

    def poll(self) -> None:
        try:
            if self.stream is not None:
                names = [self.stream]
            else:
                names = self.logs.log_streams(self.reader.log_group, self.prefix)
            for name in names:
                for event in self.reader.read(name, self.window):
                    for line in lines_of(event):
                        self.logs.out(f"  | {line}")
        except (ClientError, BotoCoreError):
            return  # the log stream appears only once the node has written something
