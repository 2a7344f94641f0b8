"""The nodes' command output in CloudWatch Logs.

SSM's agent writes each invocation's output to the stack's training log group (output
`TrainingLogGroupName`), one stream per node and output: `<command-id>/<instance-id>/<step>/
stdout` and `.../stderr`. The whole output is there, where SSM itself keeps only the first 24,000
characters. Read here: the streams of a command or a node, the last lines of a stream, the new
lines since the last read (`StreamReader`, for `logs --follow` and for following rank 0 while a
command or a job runs), and lines matching a filter pattern.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from scripts.cluster_lib.outputs import Stack


class StreamReader:
    """Reads log streams on from where the previous read of each ended (nextForwardToken).
    The first read of a stream starts at its head, or with `first_lines` set, takes only that
    many of its last events."""

    def __init__(self, client: Any, log_group: str, *, first_lines: int | None = None) -> None:
        self.client = client
        self.log_group = log_group
        self.first_lines = first_lines
        self.tokens: dict[str, str] = {}

    def read(self, name: str) -> list[dict[str, Any]]:
        """The stream's events not read yet."""
        kwargs: dict[str, Any] = {"logGroupName": self.log_group, "logStreamName": name}
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

    def last_events(self, log_group: str, stream: str, limit: int) -> list[dict[str, Any]]:
        """The last `limit` events of one stream."""
        events: list[dict[str, Any]] = self.client.get_log_events(
            logGroupName=log_group, logStreamName=stream, startFromHead=False, limit=limit
        )["events"]
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

    def follower(self, command_id: str, instance_id: str) -> LogFollower:
        return LogFollower(self, command_id, instance_id)


class LogFollower:
    """Prints a node's new command output from CloudWatch Logs while a command runs."""

    def __init__(self, logs: Logs, command_id: str, instance_id: str) -> None:
        self.logs = logs
        self.prefix = f"{command_id}/{instance_id}/"
        self.reader = logs.reader()

    def poll(self) -> None:
        try:
            for name in self.logs.log_streams(self.reader.log_group, self.prefix):
                for event in self.reader.read(name):
                    for line in lines_of(event):
                        self.logs.out(f"  | {line}")
        except (ClientError, BotoCoreError):
            return  # the log stream appears only once the node has written something
