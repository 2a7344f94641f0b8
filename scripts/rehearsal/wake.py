"""The supervisor's wake on this machine: its queue in moto's SQS, the wake state machine's
synthesized definition in moto's ASL interpreter, and EventBridge's two rules that start it
(stacks/supervisor_wake.py).

EventBridge is emulated from what is deployed, as for the job queue's rule (job_queue.py): each
rule's event pattern as the template has it (its references resolved) decides which events start
the wake, and a target without Input passes the whole event. The events are built as the
services send them, from what the stand-ins see:

- Systems Manager's "EC2 Command Invocation Status-change Notification" when an invocation of
  the Run Command stand-in (ssm_stand_in.py) reaches a status it did not have (EventBridge event
  examples for Systems Manager, Run Command events: source aws.ssm, resources the instance's
  ARN, detail command-id, document-name, instance-id, requested-date-time, status);
- Auto Scaling's "EC2 Instance-terminate Lifecycle Action" when a node of the group stops
  running or enters Terminating:Wait (Amazon EC2 Auto Scaling event reference, scale-in
  lifecycle action: source aws.autoscaling, resources the group's ARN, detail
  LifecycleActionToken, AutoScalingGroupName, LifecycleHookName, EC2InstanceId,
  LifecycleTransition, Origin, Destination). AWS sends it once the group starts terminating the
  node, which for a node that died is after the group's health check has found it not running;
  the stand-in sends it at once, so a rehearsal measures the supervisor's part, not that delay.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from scripts.cluster_lib import ClusterError
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.job_queue import _resolve, _resources, matches

ACCOUNT = "123456789012"
#: How often the stand-ins are looked at: about how soon EventBridge delivers an event.
LOOK_SECONDS = 0.5
#: Invocation statuses that change no more (botocore's ssm CommandInvocationStatus).
ENDED = frozenset({"Success", "Failed", "Cancelled", "TimedOut"})
#: The construct of the wake (stacks/supervisor.py: JobSupervisor's "Wake").
WAKE_CONSTRUCT = "JobSupervisorWake"


def queue_logical_id(template: dict[str, Any]) -> str:
    (logical_id,) = [k for k in _resources(template, "AWS::SQS::Queue") if "WakeQueue" in k]
    return logical_id


def create_queue(sqs: Any, template: dict[str, Any]) -> str:
    """The wake queue as the template declares it, in moto; returns its URL."""
    properties = template["Resources"][queue_logical_id(template)]["Properties"]
    attributes = {
        name: str(properties[name])
        for name in ("MessageRetentionPeriod", "VisibilityTimeout")
        if name in properties
    }
    url: str = sqs.create_queue(QueueName=properties["QueueName"], Attributes=attributes)[
        "QueueUrl"
    ]
    return url


def _time(moment: datetime) -> str:
    return f"{moment:%Y-%m-%dT%H:%M:%SZ}"


def invocation_event(command: Any, invocation: Any, status: str, region: str) -> dict[str, Any]:
    """Run Command's invocation status-change event."""
    instance_id = invocation.instance.instance_id
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "EC2 Command Invocation Status-change Notification",
        "source": "aws.ssm",
        "account": ACCOUNT,
        "time": _time(datetime.now(UTC)),
        "region": region,
        "resources": [f"arn:aws:ec2:{region}:{ACCOUNT}:instance/{instance_id}"],
        "detail": {
            "command-id": command.command_id,
            "document-name": command.document,
            "instance-id": instance_id,
            "requested-date-time": f"{command.requested:%Y-%m-%dT%H:%M:%S.%f}"[:-3] + "Z",
            "status": status,
        },
    }


def terminate_event(group: str, hook: str, instance_id: str, region: str) -> dict[str, Any]:
    """Auto Scaling's scale-in lifecycle action event."""
    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "EC2 Instance-terminate Lifecycle Action",
        "source": "aws.autoscaling",
        "account": ACCOUNT,
        "time": _time(datetime.now(UTC)),
        "region": region,
        "resources": [
            f"arn:aws:autoscaling:{region}:{ACCOUNT}:autoScalingGroup:"
            f"00000000-0000-4000-8000-000000000000:autoScalingGroupName/{group}"
        ],
        "detail": {
            "LifecycleActionToken": str(uuid.uuid4()),
            "AutoScalingGroupName": group,
            "LifecycleHookName": hook,
            "EC2InstanceId": instance_id,
            "LifecycleTransition": "autoscaling:EC2_INSTANCE_TERMINATING",
            "Origin": "AutoScalingGroup",
            "Destination": "EC2",
        },
    }


@dataclass
class WakeOutcome:
    """How one wake execution ended (``WakeRules.outcomes``)."""

    time: str  # the event's time of day, UTC
    event: str  # its detail-type and the status or instance it names
    status: str  # the execution's status, or "not started"
    error: str = ""
    cause: str = ""
    failures: list[str] = field(default_factory=list)  # its history's failure events

    @property
    def failed(self) -> bool:
        return self.status == "FAILED"

    def lines(self) -> list[str]:
        head = f"{self.time} {self.event}: {self.status}"
        if self.failed:
            head += f" {self.error} {self.cause}"
        return [head, *(f"  {failure}" for failure in self.failures)]


@dataclass
class WakeRules:
    """The wake's rules, applied to what the stand-ins see change (every LOOK_SECONDS)."""

    cloud: Any
    session: Any
    patterns: list[dict[str, Any]]
    machine: str
    #: The termination hook's name (stacks/compute.py termination_hook_name).
    hook: str
    #: The events delivered (each started a wake execution), in order.
    delivered: list[dict[str, Any]] = field(default_factory=list)
    #: Off: no event is delivered (the rehearsals that show what the timed poll alone does).
    enabled: bool = True
    _statuses: dict[str, str] = field(default_factory=dict)
    _running: set[str] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        client = self.session.client("stepfunctions", region_name=self.cloud.region)
        while not self._stop.wait(LOOK_SECONDS):
            for event in self.changes():
                self.deliver(client, event)

    def changes(self) -> list[dict[str, Any]]:
        """The events of what changed since the last look."""
        cloud, region = self.cloud, self.cloud.region
        found = []
        for command in list(cloud.commands.values()):
            for invocation in list(command.invocations.values()):
                if self._statuses.get(invocation.key) in ENDED:
                    continue  # an ended invocation changes no more
                status = invocation.status()["status"]
                if self._statuses.get(invocation.key, "Pending") != status:
                    self._statuses[invocation.key] = status
                    found.append(invocation_event(command, invocation, status, region))
        in_service = {i.instance_id for i in cloud.in_service()}
        for instance_id in sorted(self._running - in_service):
            found.append(terminate_event(cloud.group_name, self.hook, instance_id, region))
        self._running = in_service
        return found

    def outcomes(self) -> list[WakeOutcome]:
        """Each wake execution's outcome, with its error, cause and failure events where it
        failed, in the order the events came (what a rehearsal whose poll was not woken looks
        at)."""
        client = self.session.client("stepfunctions", region_name=self.cloud.region)
        pages = client.get_paginator("list_executions").paginate(stateMachineArn=self.machine)
        status = {e["name"]: e["status"] for page in pages for e in page["executions"]}
        found = []
        for event in self.delivered:
            detail = event["detail"]
            outcome = WakeOutcome(
                time=event["time"][11:19],
                event=f"{event['detail-type']} "
                f"{detail.get('status') or detail.get('EC2InstanceId', '')}".strip(),
                status=status.get(event["id"], "not started"),
            )
            if outcome.status == "FAILED":
                arn = f"{self.machine.replace(':stateMachine:', ':execution:', 1)}:{event['id']}"
                described = client.describe_execution(executionArn=arn)
                outcome.error = described.get("error", "")
                outcome.cause = described.get("cause", "")[:200]
                outcome.failures = _failures(client, arn)
            found.append(outcome)
        return found

    def deliver(self, client: Any, event: dict[str, Any]) -> None:
        if not self.enabled or not any(matches(p, event) for p in self.patterns):
            return
        client.start_execution(stateMachineArn=self.machine, name=event["id"],
                               input=json.dumps(event))  # fmt: skip
        self.delivered.append(event)


def _failures(client: Any, arn: str) -> list[str]:
    """The failure events of an execution's history, with their error and cause."""
    found = []
    for event in whole_history(client, arn):
        for key, details in event.items():
            if key.endswith("EventDetails") and "Failed" in key:
                found.append(f"{event['type']}: {details.get('error', '')} "
                             f"{str(details.get('cause', ''))[:400]}")  # fmt: skip
    return found


@contextlib.contextmanager
def local_wake(
    cloud: Any, session: Any, template: dict[str, Any], refs: dict[str, str], *,
    definition: dict[str, Any], hook: str,
) -> Iterator[WakeRules]:  # fmt: skip
    """The wake state machine (its definition with the references resolved) and its rules, in
    moto; the queue exists already (its URL in `refs`)."""
    region = cloud.region
    client = session.client("stepfunctions", region_name=region)
    name = f"{cloud.cluster_name}-wake"
    machine: str = client.create_state_machine(
        name=name,
        definition=json.dumps(definition),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/{name}",
        type="STANDARD",
    )["stateMachineArn"]
    (machine_id,) = [
        k
        for k in _resources(template, "AWS::StepFunctions::StateMachine")
        if k.startswith(f"{WAKE_CONSTRUCT}StateMachine")
    ]
    rules = [
        r
        for r in _resources(template, "AWS::Events::Rule").values()
        if any(t.get("Arn") == {"Ref": machine_id} for t in r["Properties"]["Targets"])
    ]
    for rule in rules:
        (target,) = rule["Properties"]["Targets"]
        if "Input" in target or "InputPath" in target or "InputTransformer" in target:
            raise ClusterError("the wake's rule transforms its input: not emulated here")
    patterns = [_resolve(r["Properties"]["EventPattern"], refs) for r in rules]
    emulator = WakeRules(cloud, session, patterns, machine, hook)
    emulator._running = {i.instance_id for i in cloud.in_service()}
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.close()
        # No wake may outlive moto: its calls would then leave this machine. Each ends within
        # seconds (its rounds, the settle); one still running after the bound is stopped.
        deadline = time.monotonic() + 60
        while running := client.list_executions(stateMachineArn=machine, statusFilter="RUNNING")[
            "executions"
        ]:
            if time.monotonic() > deadline:
                for execution in running:
                    with contextlib.suppress(Exception):
                        client.stop_execution(executionArn=execution["executionArn"])
                break
            time.sleep(0.2)
