"""The Run Command stand-in's SSM: SendCommand and the calls that read and cancel commands,
answered by the node agents of the stand-in's instances.

SendCommand checks the parameters as the SSM agent does (Go's regexp on allowedPattern, then
minChars/maxChars: ssm_agent/), substitutes them into the document's step and drops one spec per
instance into its agent's spool folder (node_agent.py); an invocation's status, exit code and
output are what the agent writes beside it. A refused parameter fails every invocation, as the
agent refuses the document on every node.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scripts.cluster_lib.documents import Document
from scripts.rehearsal.instances import REGION, Instance, Instances, now
from scripts.rehearsal.ssm_agent import (
    agent_environment,
    execution_timeout,
    go_check,
    substitute,
)
from scripts.rehearsal.ssm_agent.runscript import (
    pipecopy_binary,
    plugin_output,
    standard_error,
    standard_output,
)

#: SendCommand InstanceIds: "Array Members: Maximum number of 50 items" (SSM API reference).
MAX_INSTANCE_IDS = 50


class LocalError(Exception):
    """An AWS error response: code and message, as a service would send them."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status


@dataclass
class Invocation:
    command_id: str
    instance: Instance
    folder: Path
    requested: datetime
    delivered: bool = False
    failure: str = ""  # the agent refused the command (parameter validation)

    def status(self) -> dict[str, Any]:
        if self.failure:
            return {"status": "Failed", "details": "Failed", "code": 1}
        # SSM learns an invocation's end from the agent, and the agent is what enforces
        # executionTimeout: an invocation whose instance died stays where the agent last left
        # it, Pending or InProgress. The SSM API reference (CommandInvocation, StatusDetails)
        # defines "In Progress" as sent to the managed node but not in a terminal state, and
        # "Undeliverable" only for a command that cannot be delivered; the EC2 user guide's
        # Monitoring Commands (2016) said: "If the SSM agent is not available on the instance,
        # the command status will show In Progress until the SSM agent is available again".
        path = self.folder / "status.json"
        if not path.is_file():
            return {"status": "Pending", "details": "Pending", "code": -1}
        state: dict[str, Any] = json.loads(path.read_text())
        if state["status"] == "InProgress" and (self.instance.spool / "cancel" / self.key).exists():
            return {"status": "Cancelling", "details": "Cancelling", "code": -1}
        state.setdefault("details", state["status"])
        return state

    @property
    def key(self) -> str:
        return f"{self.command_id}-{self.instance.instance_id}"

    def output(self, name: str) -> bytes:
        """The agent's whole `stdout` or `stderr` file of the step, as bytes."""
        path = self.folder / name
        if self.failure:
            return b"" if name == "stdout" else self.failure.encode()
        return path.read_bytes() if path.is_file() else b""


@dataclass
class Command:
    command_id: str
    document: str
    parameters: dict[str, list[str]]
    comment: str
    requested: datetime
    log_group: str
    invocations: dict[str, Invocation]
    step: str


def _cloudwatch_config(log_group: str) -> dict[str, Any]:
    """CloudWatchOutputConfig as SSM returns it: the group's name only where one was given
    (botocore: CloudWatchLogGroupName is at least 1 character)."""
    if not log_group:
        return {"CloudWatchOutputEnabled": False}
    return {"CloudWatchLogGroupName": log_group, "CloudWatchOutputEnabled": True}


class SsmStandIn:
    """The stand-in's SSM: the commands sent, each with one invocation per instance."""

    def __init__(
        self, instances: Instances, documents: dict[str, Document], ids: Iterator[int]
    ) -> None:
        self.instances = instances
        #: The stack's documents by the names the stack gives them.
        self.documents = documents
        #: The stand-in's one counter of IDs (instances and commands).
        self.ids = ids
        self.commands: dict[str, Command] = {}
        #: The instances' tags (the EC2 stand-in's), which a command's Targets select by.
        self.tags: Callable[[], dict[str, str]] = dict

    def _targeted(self, targets: list[dict[str, Any]]) -> list[str]:
        """The running instances a command's Targets select: every Key (tag:<key>, or
        InstanceIds) must match (SSM API reference, Target: up to 5 keys; a managed node that
        is not running gets no invocation). Other keys are refused rather than guessed."""
        if len(targets) > 5:
            raise LocalError("ValidationException", "Targets holds at most 5 entries")
        chosen = []
        for instance in self.instances.running():
            tags = self.tags()
            for target in targets:
                key, values = target["Key"], set(target["Values"])
                if key == "InstanceIds":
                    if instance.instance_id not in values:
                        break
                elif key.startswith("tag:"):
                    if tags.get(key[4:]) not in values:
                        break
                else:
                    raise LocalError("UnsupportedOperation", f"Targets key {key}: not served here")
            else:
                chosen.append(instance.instance_id)
        return chosen

    def _ssm_DescribeInstanceInformation(self, params: dict[str, Any]) -> dict[str, Any]:
        wanted: set[str] = set()
        for item in params.get("Filters", []) or []:
            if item["Key"] == "InstanceIds":
                wanted |= set(item["Values"])
        infos = [
            {
                "InstanceId": i.instance_id,
                "PingStatus": "Online" if i.online() else "ConnectionLost",
                "PlatformType": "Linux",
                "IPAddress": i.address,
            }
            for i in self.instances.instances
            if (not wanted or i.instance_id in wanted) and i.state == "running"
        ]
        return {"InstanceInformationList": infos}

    def _ssm_SendCommand(self, params: dict[str, Any]) -> dict[str, Any]:
        ids = list(params.get("InstanceIds", []))
        if len(ids) > MAX_INSTANCE_IDS:
            raise LocalError(
                "ValidationException",
                f"1 validation error detected: Value at 'instanceIds' failed to satisfy "
                f"constraint: Member must have length less than or equal to {MAX_INSTANCE_IDS}",
            )
        if params.get("Targets"):
            if ids:
                raise LocalError(
                    "ValidationException", "InstanceIds and Targets cannot both be given"
                )
            ids = self._targeted(params["Targets"])
        document = self.documents.get(params["DocumentName"])
        if document is None:
            raise LocalError("InvalidDocument", f"document {params['DocumentName']} does not exist")
        given = {k: v for k, v in (params.get("Parameters") or {}).items()}
        unknown = set(given) - set(document.parameters)
        if unknown:
            raise LocalError("InvalidParameters", f"unknown parameters {sorted(unknown)}")
        values: dict[str, str] = {}
        for name, parameter in document.parameters.items():
            if name in given:
                values[name] = given[name][0] if given[name] else ""
            elif parameter.default is not None:
                values[name] = parameter.default
            else:
                raise LocalError("InvalidParameters", f"parameter {name} is required")
        # The agent's checks: Go's regexp on allowedPattern, then minChars/maxChars.
        names = list(document.parameters)
        errors = go_check(
            [
                {
                    "pattern": document.parameters[n].allowed_pattern,
                    "minChars": document.parameters[n].min_chars,
                    "maxChars": document.parameters[n].max_chars,
                    "value": values[n],
                }
                for n in names
            ]
        )
        refusal = next((e for e in errors if e), "")
        step = document.content["mainSteps"][0]
        script = "\n".join(substitute(line, values) for line in step["inputs"]["runCommand"])
        timeout_text = substitute(str(step["inputs"].get("timeoutSeconds", "3600")), values)
        timeout = execution_timeout(timeout_text)
        command_id = f"{next(self.ids):08x}-0000-4000-8000-{int(time.time()):012x}"
        output_config = params.get("CloudWatchOutputConfig") or {}
        requested = now()
        command = Command(
            command_id=command_id,
            document=params["DocumentName"],
            parameters={k: [v] for k, v in values.items()},
            comment=params.get("Comment", ""),
            requested=requested,
            log_group=output_config.get("CloudWatchLogGroupName", ""),
            invocations={},
            step=step["name"],
        )
        # SSM refuses the whole command, before any node gets it, for an instance that is not
        # valid, one that is shutting down or terminated included (botocore's ssm model,
        # InvalidInstanceId: "Invalid states are: Shutting-down and Terminated").
        targets = [self.instances.instance(instance_id) for instance_id in ids]
        for instance_id, target in zip(ids, targets, strict=True):
            if target is None or target.state == "terminated":
                raise LocalError("InvalidInstanceId", f"instance {instance_id} is not valid")
        for instance_id, instance in zip(ids, targets, strict=True):
            assert instance is not None
            folder = instance.root / "orchestration" / command_id / step["name"]
            invocation = Invocation(command_id, instance, folder, requested)
            command.invocations[instance_id] = invocation
            if refusal:
                invocation.failure = refusal + "\n"
                continue
            env = agent_environment(instance.instance_id, REGION, command_id=command_id)
            spec = {"id": invocation.key, "script": script, "env": env, "timeout": timeout,
                    "dir": str(folder), "copier": str(pipecopy_binary())}  # fmt: skip
            commands = instance.spool / "commands"
            partial = commands / f"{invocation.key}.json.tmp"
            partial.write_text(json.dumps(spec))
            partial.replace(commands / f"{invocation.key}.json")
        self.commands[command_id] = command
        return {"Command": self._command_view(command)}

    def _command_view(self, command: Command) -> dict[str, Any]:
        statuses = [inv.status()["status"] for inv in command.invocations.values()]
        if any(s in ("Pending", "InProgress", "Cancelling") for s in statuses):
            status = "Cancelling" if "Cancelling" in statuses else "InProgress"
            if all(s == "Pending" for s in statuses):
                status = "Pending"
        elif all(s == "Success" for s in statuses):
            status = "Success"
        elif any(s == "Cancelled" for s in statuses):
            status = "Cancelled"
        elif any(s == "TimedOut" for s in statuses):
            status = "TimedOut"
        else:
            status = "Failed"
        return {
            "CommandId": command.command_id,
            "DocumentName": command.document,
            "Comment": command.comment,
            "Parameters": command.parameters,
            "InstanceIds": list(command.invocations),
            "RequestedDateTime": command.requested,
            "Status": status,
            "StatusDetails": status,
            "TargetCount": len(statuses),
            "CompletedCount": sum(
                s not in ("Pending", "InProgress", "Cancelling") for s in statuses
            ),
            "ErrorCount": sum(s in ("Failed", "TimedOut") for s in statuses),
            "CloudWatchOutputConfig": _cloudwatch_config(command.log_group),
        }

    def _command(self, command_id: str) -> Command:
        command = self.commands.get(command_id)
        if command is None:
            raise LocalError("InvalidCommandId", f"command {command_id} does not exist")
        return command

    @staticmethod
    def _page(items: list[Any], params: dict[str, Any], default: int = 50) -> tuple[list[Any], str]:
        start = int(params.get("NextToken") or 0)
        size = int(params.get("MaxResults") or default)
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    def _ssm_ListCommands(self, params: dict[str, Any]) -> dict[str, Any]:
        commands = sorted(self.commands.values(), key=lambda c: c.requested, reverse=True)
        if params.get("CommandId"):
            commands = [self._command(params["CommandId"])]
        if params.get("InstanceId"):
            commands = [c for c in commands if params["InstanceId"] in c.invocations]
        views = [self._command_view(c) for c in commands]
        for item in params.get("Filters", []) or []:
            key, value = item["key"], item["value"]
            if key == "DocumentName":
                views = [v for v in views if v["DocumentName"] == value]
            elif key == "Status":
                views = [v for v in views if v["Status"] == value]
            elif key == "ExecutionStage":
                active = {"Pending", "InProgress", "Cancelling"}
                views = [v for v in views if (v["Status"] in active) == (value == "Executing")]
            elif key in ("InvokedAfter", "InvokedBefore"):
                # The form the SSM API reference (CommandFilter, value) gives:
                # "2024-07-07T00:00:00Z"; anything else is refused here rather than guessed.
                try:
                    moment = datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
                except ValueError:
                    raise LocalError(
                        "InvalidFilterValue", f"{key} {value!r} is not like 2024-07-07T00:00:00Z"
                    ) from None
                views = [
                    v for v in views
                    if (v["RequestedDateTime"] >= moment) == (key == "InvokedAfter")
                ]  # fmt: skip
        page, token = self._page(views, params)
        result: dict[str, Any] = {"Commands": page}
        if token:
            result["NextToken"] = token
        return result

    def _invocation_view(self, command: Command, inv: Invocation, details: bool) -> dict[str, Any]:
        state = inv.status()
        view: dict[str, Any] = {
            "CommandId": command.command_id,
            "InstanceId": inv.instance.instance_id,
            "DocumentName": command.document,
            "Comment": command.comment,
            "RequestedDateTime": inv.requested,
            "Status": state["status"],
            "StatusDetails": state["details"],
        }
        if details:
            view["CommandPlugins"] = [
                {
                    "Name": command.step,
                    "Status": state["status"],
                    "StatusDetails": state["details"],
                    "ResponseCode": int(state.get("code", -1)),
                    # iohandler.go String(): stdout and stderr joined, cut at 2,500.
                    "Output": plugin_output(
                        inv.output("stdout"), inv.output("stderr"), int(state.get("code", -1))
                    ),
                }
            ]
        return view

    def _ssm_ListCommandInvocations(self, params: dict[str, Any]) -> dict[str, Any]:
        commands = (
            [self._command(params["CommandId"])]
            if params.get("CommandId")
            else sorted(self.commands.values(), key=lambda c: c.requested, reverse=True)
        )
        views = [
            self._invocation_view(c, inv, bool(params.get("Details")))
            for c in commands
            for instance_id, inv in c.invocations.items()
            if not params.get("InstanceId") or params["InstanceId"] == instance_id
        ]
        page, token = self._page(views, params)
        result: dict[str, Any] = {"CommandInvocations": page}
        if token:
            result["NextToken"] = token
        return result

    def _ssm_GetCommandInvocation(self, params: dict[str, Any]) -> dict[str, Any]:
        command = self.commands.get(params["CommandId"])
        inv = command.invocations.get(params["InstanceId"]) if command else None
        if command is None or inv is None:
            raise LocalError("InvocationDoesNotExist", "the invocation does not exist")
        state = inv.status()
        ended = state["status"] not in ("Pending", "InProgress", "Cancelling", "Delayed")
        code = int(state.get("code", -1))
        stdout = standard_output(inv.output("stdout"), code) if ended else ""
        stderr = standard_error(inv.output("stderr"), code) if ended else ""
        return {
            "CommandId": command.command_id,
            "InstanceId": inv.instance.instance_id,
            "DocumentName": command.document,
            "PluginName": command.step,
            "ResponseCode": code,
            "Status": state["status"],
            "StatusDetails": state["details"],
            # The first 24,000 / 8,000 characters (ssm_agent/runscript.py for the sources).
            "StandardOutputContent": stdout,
            "StandardErrorContent": stderr,
            "CloudWatchOutputConfig": _cloudwatch_config(command.log_group),
        }

    def _ssm_CancelCommand(self, params: dict[str, Any]) -> dict[str, Any]:
        command = self._command(params["CommandId"])
        for instance_id in params.get("InstanceIds") or list(command.invocations):
            inv = command.invocations.get(instance_id)
            # SSM records the cancel whether or not the node's agent ever acknowledges it
            # (CancelCommand: "There is no guarantee that the command will be terminated"):
            # an invocation on a node that died stays Cancelling (CommandInvocationStatus),
            # and so does its command.
            if inv is not None:
                (inv.instance.spool / "cancel").mkdir(parents=True, exist_ok=True)
                (inv.instance.spool / "cancel" / inv.key).touch()
        return {}

    def cancel(self, command_id: str, instance_id: str) -> None:
        """What the console's Cancel command does, for one node."""
        self._ssm_CancelCommand({"CommandId": command_id, "InstanceIds": [instance_id]})
