"""The Run Command stand-in's CloudWatch Logs: the nodes' command output, as the SSM agent
streams it with CloudWatchOutputEnabled.

Each invocation's stdout and stderr files (written by the node agent) are the log streams
`<command-id>/<instance-id>/<step>/stdout` and `.../stderr` of the command's log group; one event
per line, stamped with the file's modification time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from scripts.rehearsal.ssm_stand_in import LocalError, SsmStandIn


class LogsStandIn:
    """DescribeLogStreams, GetLogEvents and FilterLogEvents over the commands' output files."""

    def __init__(self, ssm: SsmStandIn) -> None:
        self.ssm = ssm

    def _streams(self, group: str) -> dict[str, Path]:
        """Log streams the agent writes with CloudWatchOutputEnabled:
        <command-id>/<instance-id>/<step>/stdout|stderr."""
        streams = {}
        for command in self.ssm.commands.values():
            if command.log_group != group:
                continue
            for instance_id, inv in command.invocations.items():
                for name in ("stdout", "stderr"):
                    if (inv.folder / name).is_file():
                        key = f"{command.command_id}/{instance_id}/{command.step}/{name}"
                        streams[key] = inv.folder / name
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
    def _events(path: Path) -> list[dict[str, Any]]:
        stamp = int(path.stat().st_mtime * 1000)
        lines = path.read_text(errors="replace").splitlines()
        return [{"timestamp": stamp, "message": line, "ingestionTime": stamp} for line in lines]

    def _logs_GetLogEvents(self, params: dict[str, Any]) -> dict[str, Any]:
        path = self._streams(params["logGroupName"]).get(params["logStreamName"])
        if path is None:
            raise LocalError(
                "ResourceNotFoundException", "The specified log stream does not exist."
            )
        events = self._events(path)
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
        for name, path in sorted(streams.items()):
            if (names and name not in names) or not name.startswith(prefix):
                continue
            events += [{**e, "logStreamName": name, "eventId": f"{name}-{i}"}
                       for i, e in enumerate(self._events(path))]  # fmt: skip
        start = int(params.get("nextToken") or 0)
        size = int(params.get("limit") or 10000)
        result: dict[str, Any] = {"events": events[start : start + size]}
        if start + size < len(events):
            result["nextToken"] = str(start + size)
        return result
