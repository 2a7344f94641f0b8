"""What the rehearsal's AWS stand-in (scripts/rehearsal/) must answer, for the rehearsal of a
node that dies mid-job (tests/test_supervisor.py), as AWS answers it; applied with pytest's
monkeypatch, for that test only, until the stand-in itself answers so.

- An invocation whose instance died while the agent ran it stays where the agent last left it:
  InProgress (Pending if the agent never picked it up). The stand-in reports TimedOut at once,
  which is kinder than the platform: SSM learns an invocation's end from the agent, and the
  agent is what enforces executionTimeout. The SSM API reference (CommandInvocation,
  StatusDetails) defines "In Progress" as "sent to the managed node but hasn't reached a
  terminal state", "Undeliverable" only for a command that cannot be delivered and "Execution
  Timed Out" as the execution outliving its timeout; the EC2 user guide's Monitoring Commands
  (2016) said it outright: "If the SSM agent is not available on the instance, the command
  status will show In Progress until the SSM agent is available again".
- DescribeInstances honours the `instance-id` filter ("The ID of the instance", EC2 API
  reference, DescribeInstances, Filter.N); the stand-in ignores filters it does not know and so
  answers with every instance.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.ssm_stand_in import Invocation

#: Invocation statuses after which the agent reports nothing more.
_AGENT_ENDED = ("Success", "Failed", "Cancelled", "TimedOut")


def answer_as_the_platform_for_dead_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Invocations on dead instances stay InProgress (or Pending), and DescribeInstances
    honours `instance-id` filters (the module's docstring says why)."""
    status, describe = Invocation.status, LocalCloud._ec2_DescribeInstances

    def invocation_status(self: Invocation) -> dict[str, Any]:
        if self.failure or self.instance.state == "running":
            return status(self)
        path = self.folder / "status.json"
        if not path.is_file():
            return {"status": "Pending", "details": "Pending", "code": -1}
        last: dict[str, Any] = json.loads(path.read_text())
        if last["status"] in _AGENT_ENDED:
            return status(self)
        return {"status": "InProgress", "details": "InProgress", "code": -1}

    def describe_instances(self: LocalCloud, params: dict[str, Any]) -> dict[str, Any]:
        answer = describe(self, params)
        wanted = [set(f["Values"]) for f in params.get("Filters", []) if f["Name"] == "instance-id"]
        if not wanted:
            return answer
        reservations = []
        for reservation in answer["Reservations"]:
            kept = [
                i for i in reservation["Instances"] if all(i["InstanceId"] in w for w in wanted)
            ]
            if kept:
                reservations.append({**reservation, "Instances": kept})
        return {**answer, "Reservations": reservations}

    monkeypatch.setattr(Invocation, "status", invocation_status)
    monkeypatch.setattr(LocalCloud, "_ec2_DescribeInstances", describe_instances)
