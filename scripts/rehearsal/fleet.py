"""A simulated fleet for the scale rehearsal: up to 1,024 instances behind the AWS stand-in,
without namespaces, agents or trainers.

The stand-in's SSM, EC2, Auto Scaling and CloudWatch Logs answer for these instances exactly as
for the rehearsal's real nodes (aws_stand_in.py, ssm_stand_in.py): SendCommand checks the
parameters with Go's regexp and writes each invocation's spec; what differs is who answers the
invocation. Instead of an agent per node running the document's script, `SimulatedAgents`
answers every node's invocation as the test tells it, in the agent's terms: status.json beside
the invocation (InProgress while it runs; Success, Failed or Cancelled from
ssm_agent.runscript.plugin_result, as node_agent.py writes it). Preflight, Precompile and
StopTraining end at once with status 0; RunTraining starts (its node counts as launched) and
runs until the test ends it (`finish`, `fail`) or the supervisor cancels it (the agent's
SIGKILL, 137: Cancelled). An instance that dies (`die`) answers nothing more: its invocations
stay InProgress, as on AWS, and the group launches a replacement in its place.

What a node's own scripts do at 1,024 hosts (parse the host list, find the node's rank, size
the open-file limit) is checked on the real launch.sh (tests/test_scale_rehearsal.py); the
rest of a node's work does not change with the cluster's size.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.rehearsal.instances import Instance, Instances, software_version
from scripts.rehearsal.ssm_agent.runscript import plugin_result

#: The exit status the agent sees when it SIGKILLs a cancelled script's process group.
KILLED = 137


class _Agent:
    """Stands for a node's running agent process (Instance.online asks it)."""

    @staticmethod
    def poll() -> None:
        return None


class SimulatedHosts:
    """`count` addresses in 10.128.0.0/16 (no namespaces)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.addresses = [f"10.128.{slot // 250}.{slot % 250 + 4}" for slot in range(count)]

    def close(self) -> None:
        pass


class SimulatedInstances(Instances):
    """Instances with a spool folder each and nothing running on them."""

    def __init__(self, hosts: SimulatedHosts, output: Path, ids: Any, **_: Any) -> None:
        self.hosts = hosts  # type: ignore[assignment]
        self.output = output
        self.ids = ids
        self.cluster_name = "rehearsal"
        self.node_settings: dict[str, str] = {}
        self.software_version = software_version()
        self.instances: list[Instance] = []
        self.died: list[Instance] = []
        for slot in range(hosts.count):
            self.instances.append(self.launch(slot))

    def launch(self, slot: int) -> Instance:
        instance_id = f"i-{next(self.ids):017x}"
        instance = Instance(
            slot, instance_id, self.hosts.addresses[slot], self.output / instance_id
        )
        for folder in ("commands", "cancel"):
            (instance.spool / folder).mkdir(parents=True, exist_ok=True)
        instance.agent = _Agent()  # type: ignore[assignment]
        return instance

    def terminate(self, instance: Instance) -> None:
        instance.state = "terminated"

    def close(self) -> None:
        for instance in self.instances:
            instance.state = "terminated"


@dataclass
class _Running:
    folder: Path
    instance: Instance
    document: str
    started: float


@dataclass
class SimulatedAgents:
    """Answers the invocations SendCommand delivers to the simulated fleet (see the module's
    docstring); `launched` holds, per RunTraining command, when each node started it."""

    instances: SimulatedInstances
    running: dict[str, _Running] = field(default_factory=dict)
    launched: dict[str, dict[str, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self._changed = threading.Condition(self._lock)

    def attach(self, cloud: Any) -> None:
        """Answers what `cloud`'s SSM stand-in sends, as each node's agent would."""
        ssm = cloud.ssm
        send, cancel = ssm._ssm_SendCommand, ssm._ssm_CancelCommand

        def send_and_start(params: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = send(params)
            command = ssm.commands[answer["Command"]["CommandId"]]
            for invocation in command.invocations.values():
                if invocation.failure or invocation.instance.state != "running":
                    continue
                self._start(command.command_id, command.document, invocation)
            return answer

        def cancel_and_kill(params: dict[str, Any]) -> dict[str, Any]:
            answer: dict[str, Any] = cancel(params)
            command = ssm.commands[params["CommandId"]]
            for instance_id in params.get("InstanceIds") or list(command.invocations):
                self._end(f"{command.command_id}-{instance_id}", KILLED, ending="cancel")
            return answer

        ssm._ssm_SendCommand = send_and_start
        ssm._ssm_CancelCommand = cancel_and_kill

    def _start(self, command_id: str, document: str, invocation: Any) -> None:
        key = f"{command_id}-{invocation.instance.instance_id}"
        invocation.folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        _write(invocation.folder / "status.json", {"status": "InProgress", "started": now})
        with self._changed:
            self.running[key] = _Running(invocation.folder, invocation.instance, document, now)
            if document.endswith("RunTraining"):
                self.launched.setdefault(command_id, {})[invocation.instance.instance_id] = now
            self._changed.notify_all()
        if not document.endswith("RunTraining"):
            self._end(key, 0)

    def _end(self, key: str, code: int, *, ending: str = "") -> None:
        with self._changed:
            item = self.running.pop(key, None)
            self._changed.notify_all()
        if item is None or item.instance.state != "running":
            return
        status, details, code = plugin_result(code, ending)
        ended = {"status": status, "details": details, "code": code, "ended": time.time()}
        _write(item.folder / "status.json", {**ended, "started": item.started})

    def training(self) -> list[str]:
        """The keys of the RunTraining invocations running on live nodes."""
        with self._lock:
            return [
                key
                for key, item in self.running.items()
                if item.document.endswith("RunTraining") and item.instance.state == "running"
            ]

    def wait_launched(
        self, count: int, timeout: float, *, after: frozenset[str] = frozenset()
    ) -> frozenset[str]:
        """Waits until `count` live nodes run RunTraining from commands not in `after` (an
        attempt sends one command per batch of 50); returns those commands' IDs. `timeout` is
        an upper bound only."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                commands = {c for c in self.launched if c not in after}
                nodes = {
                    item.instance.instance_id
                    for key, item in self.running.items()
                    if item.instance.state == "running" and key[:36] in commands
                    and item.document.endswith("RunTraining")
                }  # fmt: skip
                if len(nodes) >= count:
                    return frozenset(commands)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(nodes)} of {count} nodes run RunTraining")
                self._changed.wait(min(left, 1.0))

    def finish(self) -> None:
        """Every running trainer ends well (launch.sh's status 0)."""
        for key in self.training():
            self._end(key, 0)

    def fail(self, instance: Instance, code: int = 1) -> None:
        """The node's RunTraining ends with `code` (1: torchrun failed)."""
        for key in self.training():
            if key.endswith(instance.instance_id):
                self._end(key, code)

    def die(self, instance: Instance) -> Instance:
        """The instance dies: its invocations never end; the group launches a replacement."""
        self.instances.died.append(instance)
        replacement: Instance = self.instances.replace(instance)
        return replacement


def _write(path: Path, value: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(value))
    partial.replace(path)
