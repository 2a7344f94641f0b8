"""The job queue on this machine: its DynamoDB table in moto, the dispatcher's synthesized
definition in moto's ASL interpreter, and EventBridge's rule that starts the dispatcher when a
supervisor execution ends (stacks/job_queue.py).

EventBridge is emulated from what is deployed: the rule's event pattern and target as the
template has them (the pattern's references resolved), and each event built from the ended
execution's DescribeExecution as Step Functions sends "Step Functions Execution Status Change"
events (EventBridge events reference, Step Functions: detail.executionArn, stateMachineArn,
name, status, startDate and stopDate in epoch milliseconds, input and output as JSON strings,
inputDetails/outputDetails). A rule target without Input passes the whole event.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from scripts.cluster_lib import ClusterError

ACCOUNT = "123456789012"


def _resources(template: dict[str, Any], kind: str) -> dict[str, Any]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == kind}


def _resolve(value: Any, refs: dict[str, str]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"Ref"}:
            if value["Ref"] not in refs:
                raise ClusterError(f"the rule refers to {value}: not known here")
            return refs[value["Ref"]]
        return {k: _resolve(v, refs) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, refs) for v in value]
    return value


def matches(pattern: dict[str, Any], event: dict[str, Any]) -> bool:
    """EventBridge's match of exact values: every key of the pattern is in the event, and the
    event's value is one of the pattern's list (EventBridge user guide, event patterns)."""
    for key, wanted in pattern.items():
        if key not in event:
            return False
        if isinstance(wanted, dict):
            if not isinstance(event[key], dict) or not matches(wanted, event[key]):
                return False
        elif event[key] not in wanted:
            return False
    return True


def create_table(dynamodb: Any, template: dict[str, Any], logical_id: str, name: str) -> None:
    """The queue's table as the template declares it (keys and attributes), in moto."""
    properties = template["Resources"][logical_id]["Properties"]
    dynamodb.create_table(
        TableName=name,
        KeySchema=properties["KeySchema"],
        AttributeDefinitions=properties["AttributeDefinitions"],
        BillingMode=properties.get("BillingMode", "PAY_PER_REQUEST"),
    )


def claim_slot(cloud_session: Any, table: str, job_id: str, execution_name: str) -> None:
    """What the dispatcher's ClaimSlot writes (stacks/job_queue.py), for the rehearsals that
    start a supervisor execution themselves rather than through the queue."""
    cloud_session.client("dynamodb").put_item(
        TableName=table,
        Item={
            "Pk": {"S": "slot"},
            "Sk": {"S": "slot"},
            "JobId": {"S": job_id},
            "ExecutionName": {"S": execution_name},
        },
        ConditionExpression="attribute_not_exists(Pk)",
    )


def table_logical_id(template: dict[str, Any]) -> str:
    (logical_id,) = _resources(template, "AWS::DynamoDB::GlobalTable")
    return logical_id


def status_change_event(described: dict[str, Any], region: str) -> dict[str, Any]:
    """The Step Functions Execution Status Change event of an ended execution."""

    def millis(moment: Any) -> int | None:
        return int(moment.timestamp() * 1000) if moment is not None else None

    return {
        "version": "0",
        "id": str(uuid.uuid4()),
        "detail-type": "Step Functions Execution Status Change",
        "source": "aws.states",
        "account": ACCOUNT,
        "time": f"{described.get('stopDate'):%Y-%m-%dT%H:%M:%SZ}",
        "region": region,
        "resources": [described["executionArn"]],
        "detail": {
            "executionArn": described["executionArn"],
            "stateMachineArn": described["stateMachineArn"],
            "name": described["name"],
            "status": described["status"],
            "startDate": millis(described.get("startDate")),
            "stopDate": millis(described.get("stopDate")),
            "input": described.get("input"),
            "output": described.get("output"),
            "inputDetails": {"included": True},
            "outputDetails": {"included": True},
        },
    }


@dataclass
class RuleEmulator:
    """The rule that targets the dispatcher, applied to every supervisor execution that ends."""

    session: Any
    region: str
    pattern: dict[str, Any]
    supervisor: str
    dispatcher: str
    #: The events delivered (each started a dispatcher execution), in order.
    delivered: list[dict[str, Any]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)
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
        client = self.session.client("stepfunctions", region_name=self.region)
        while not self._stop.wait(0.1):
            if self.undelivered():
                self.deliver(client)

    def undelivered(self) -> bool:
        """Whether a supervisor execution has ended that has no event yet: a look at moto's
        backend in memory, so that the rule goes through the API (deliver) only when there is
        something to deliver. Through the API every look cost a ListExecutions request made,
        dispatched and answered by botocore and moto, ten a second for the whole rehearsal:
        about a tenth of a core, the largest share of the test process's CPU of anything the
        rehearsal ran (py-spy --gil: 18% of a test of two queued jobs on rehearsal nodes, 0.5%
        after)."""
        from moto.stepfunctions.parser.models import stepfunctions_parser_backends

        backend = stepfunctions_parser_backends[ACCOUNT][self.region]
        executions = list(backend.describe_state_machine(self.supervisor).executions)
        return any(e.status != "RUNNING" and e.execution_arn not in self._seen for e in executions)

    def deliver(self, client: Any) -> None:
        """One look at the supervisor's executions: an event for each that ended since."""
        listed = client.list_executions(stateMachineArn=self.supervisor)["executions"]
        for execution in reversed(listed):  # oldest first
            arn = execution["executionArn"]
            if execution["status"] == "RUNNING" or arn in self._seen:
                continue
            event = status_change_event(client.describe_execution(executionArn=arn), self.region)
            if matches(self.pattern, event):
                # EventBridge names the execution (a UUID); moto would name every one "None".
                client.start_execution(
                    stateMachineArn=self.dispatcher, name=event["id"], input=json.dumps(event)
                )
                self.delivered.append(event)
            # Seen once its dispatcher exists: settled() reads _seen as "delivered".
            self._seen.add(arn)

    def settled_dispatchers(self, timeout: float = 120) -> None:
        """Returns once no dispatcher execution runs (with the rule closed: no event comes)."""
        client = self.session.client("stepfunctions", region_name=self.region)
        deadline = time.monotonic() + timeout
        while client.list_executions(stateMachineArn=self.dispatcher, statusFilter="RUNNING")[
            "executions"
        ]:
            if time.monotonic() > deadline:
                raise AssertionError(f"a dispatcher still runs after {timeout} s")
            time.sleep(0.1)

    def settled(self, timeout: float = 120) -> None:
        """Returns once every ended supervisor execution has been delivered and no dispatcher
        execution runs (the bound only keeps a broken run from hanging); a supervisor execution
        still running is not waited for. Once the rule is closed no event comes: only the
        dispatchers are waited for.

        Settled is read from three listings in this order, with no pause between them to
        race: the dispatchers (none running: whatever they started exists by now), the
        supervisors (each that ended delivered: its dispatcher exists), the dispatchers again
        (the same ones, none running: no delivery started one since the first listing)."""
        if self._stop.is_set():
            self.settled_dispatchers(timeout)
            return
        client = self.session.client("stepfunctions", region_name=self.region)
        deadline = time.monotonic() + timeout

        def dispatchers() -> dict[str, str] | None:
            """The dispatcher's executions and their statuses; None while one runs."""
            found = {
                e["executionArn"]: e["status"]
                for e in client.list_executions(stateMachineArn=self.dispatcher)["executions"]
            }
            return None if "RUNNING" in found.values() else found

        while True:
            before = dispatchers()
            if before is not None:
                supervisors = client.list_executions(stateMachineArn=self.supervisor)["executions"]
                ended = {e["executionArn"] for e in supervisors if e["status"] != "RUNNING"}
                if ended <= self._seen and dispatchers() == before:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"the job queue did not settle in {timeout} s")
            time.sleep(0.1)


@dataclass
class LocalQueue:
    table: str
    dispatcher: str
    rule: RuleEmulator


@contextlib.contextmanager
def local_queue(
    session: Any,
    region: str,
    template: dict[str, Any],
    refs: dict[str, str],
    *,
    supervisor: str,
    definition: dict[str, Any],
    name: str,
) -> Iterator[LocalQueue]:
    """The table (already named in `refs`), the dispatcher (its definition with the references
    resolved) and the rule, in moto; the supervisor's state machine exists already."""
    table = refs[table_logical_id(template)]
    create_table(
        session.client("dynamodb", region_name=region), template, table_logical_id(template), table
    )
    client = session.client("stepfunctions", region_name=region)
    dispatcher: str = client.create_state_machine(
        name=name,
        definition=json.dumps(definition),
        roleArn=f"arn:aws:iam::{ACCOUNT}:role/{name}",
        type="STANDARD",
    )["stateMachineArn"]
    (dispatcher_id,) = [
        k
        for k in _resources(template, "AWS::StepFunctions::StateMachine")
        if k.startswith("JobDispatcherStateMachine")
    ]
    (rule,) = [
        r
        for r in _resources(template, "AWS::Events::Rule").values()
        if any(t.get("Arn") == {"Ref": dispatcher_id} for t in r["Properties"]["Targets"])
    ]
    (target,) = rule["Properties"]["Targets"]
    if "Input" in target or "InputPath" in target or "InputTransformer" in target:
        raise ClusterError("the dispatcher's rule transforms its input: not emulated here")
    (supervisor_id,) = [
        k
        for k in _resources(template, "AWS::StepFunctions::StateMachine")
        if k.startswith("JobSupervisorStateMachine")
    ]
    pattern = _resolve(rule["Properties"]["EventPattern"], {supervisor_id: supervisor})
    emulator = RuleEmulator(session, region, pattern, supervisor, dispatcher)
    emulator.start()
    try:
        yield LocalQueue(table=table, dispatcher=dispatcher, rule=emulator)
    finally:
        emulator.close()
        # No dispatcher may outlive moto: its calls would then leave this machine.
        with contextlib.suppress(Exception):
            emulator.settled_dispatchers(timeout=60)
