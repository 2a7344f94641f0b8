"""The job supervisor at 1,024 nodes: the synthesized definition of a 1,024-node cluster runs in
moto's interpreter against the AWS stand-in's answers for 1,024 simulated instances (no node is
started: the answers are what EC2 and Auto Scaling would say, at their fields' real lengths),
and every raw answer, every state's output and every child execution's stays far below Step
Functions' 256 KiB (Step Functions quotas: "Maximum input or output size for a task, state, or
execution: 256 KiB"; a task's raw result counts before its ResultSelector,
TaskSucceededEventDetails.output)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.history_pages import whole_history
from scripts.rehearsal.instances import REGION, Instance
from scripts.rehearsal.supervisor import definition as machine_definition
from scripts.rehearsal.supervisor import map_run_histories, step_functions_as_on_aws
from stacks.supervisor import JOB_DEFAULTS
from stacks.supervisor_limits import SEND_BATCH, TAG_PAGE, tag_pages
from tests.cdk_support import Synth, synth
from tests.cluster_support import LONGEST_CODE
from tests.test_supervisor import (
    PAYLOAD_LIMIT,
    PAYLOAD_SHARE,
    placeholder_refs,
)

NODES = 1024


@pytest.fixture(scope="module")
def largest() -> Synth:
    return synth(node_count=str(NODES))


class _Fleet:
    """The stand-in's instances, none started: `running` at 172.x.y.z (the longest IPv4
    addresses), the first `unhealthy` of them marked Unhealthy, and `terminated` more that EC2
    still lists (with their tags) after the group replaced them."""

    def __init__(self, running: int, *, unhealthy: int = 0, terminated: int = 0) -> None:
        self.instances = [
            Instance(
                n,
                f"i-{n:017x}",
                f"172.{100 + n // 10_000 % 100}.{100 + n // 100 % 100}.{100 + n % 100}",
                Path("/"),
                state="running" if n < running else "terminated",
                health="Unhealthy" if n < unhealthy else "Healthy",
            )
            for n in range(running + terminated)
        ]

    def running(self) -> list[Instance]:
        return [i for i in self.instances if i.state == "running"]


def _cloud(fleet: _Fleet, answers: dict[str, list[int]]) -> LocalCloud:
    """The AWS stand-in over `fleet`; `answers` gets each call's raw answer size in bytes."""
    cloud = object.__new__(LocalCloud)
    cloud.cluster_name, cloud.instances = "trainium", fleet  # type: ignore[assignment]
    cloud.region, cloud.calls, cloud._lock = REGION, [], threading.Lock()
    cloud.call_times = []
    cloud._services = {}
    for name in ("_ec2_DescribeTags", "_autoscaling_DescribeAutoScalingInstances",
                 "_ec2_DescribeNetworkInterfaces"):  # fmt: skip
        answer: Callable[[dict[str, Any]], dict[str, Any]] = getattr(cloud, name)

        def measured(params: dict[str, Any], answer: Any = answer, name: str = name) -> Any:
            body = answer(params)
            size = len(json.dumps(body, default=str, separators=(",", ":")).encode())
            answers.setdefault(name.split("_", 2)[2], []).append(size)
            return body

        setattr(cloud, name, measured)
    return cloud


def run_against(
    cloud: LocalCloud, machine: dict[str, Any], given: dict[str, Any]
) -> tuple[str, list[dict[str, Any]], list[list[Any]]]:
    """Runs `machine` in moto's interpreter, its SDK calls answered by `cloud`; returns the
    status, the execution's history and the Distributed Map children's histories."""
    from moto import mock_aws
    from moto.stepfunctions.parser.asl.component.state.exec.state_task.service import (
        state_task_service_aws_sdk as aws_sdk,
    )

    session = cloud.session()
    original = aws_sdk.boto_client_for
    with (
        mock_aws(config={"stepfunctions": {"execute_state_machine": True}}),
        step_functions_as_on_aws(),
        map_run_histories() as children,
    ):
        aws_sdk.boto_client_for = lambda region, service, *_, **__: session.client(
            service, region_name=region
        )
        try:
            import boto3

            client = boto3.client("stepfunctions", region_name=REGION)
            arn = client.create_state_machine(
                name="scale", definition=json.dumps(machine),
                roleArn="arn:aws:iam::123456789012:role/scale",
            )["stateMachineArn"]  # fmt: skip
            execution = client.start_execution(stateMachineArn=arn, input=json.dumps(given))
            deadline = time.monotonic() + 300  # an upper bound only
            while (
                status := client.describe_execution(executionArn=execution["executionArn"])[
                    "status"
                ]
            ) == "RUNNING":
                assert time.monotonic() < deadline
                time.sleep(0.1)
            events = whole_history(client, execution["executionArn"])
        finally:
            aws_sdk.boto_client_for = original
        histories = [list(manager.get_event_history()) for manager in children]
    return status, events, histories


def _attempt_input() -> dict[str, Any]:
    """What the wait for nodes starts from: the largest job settings the documents allow."""
    return {
        "Job": {**JOB_DEFAULTS, **LONGEST_CODE, "JobId": "j" * 64, "TrainArgs": "x" * 2048},
        "Counters": {"Retries": 0, "Legs": 1, "Attempts": 0},
        "ContinuedFrom": "",
        "NodeWaits": {"Count": 3},
    }


def _wait_for_nodes(definition: dict[str, Any]) -> dict[str, Any]:
    """The definition's wait for nodes, from ReadGroup to NodesReady; where FullSet would wait
    for more nodes, the test machine fails (NotFullSet) instead."""
    names = ["ReadGroup", "MoreOfGroup", "ReadGroupPage", "AddGroupPage", "JoinGroupPage",
             "PartitionGroup", "ReadNodes", "CountNodes", "FullSet", "JoinHosts",
             "NodesReadyAt", "SplitNodesReadyAt", "NodesReady"]  # fmt: skip
    chosen = {name: dict(definition["States"][name]) for name in names}
    chosen["FullSet"]["Default"] = "NotFullSet"
    ready = chosen["NodesReady"]
    ready.pop("Next")
    ready["End"] = True
    chosen["NotFullSet"] = {"Type": "Fail", "Error": "NotFullSet"}
    return {"StartAt": "ReadGroup", "States": chosen}


def _sizes(events: list[dict[str, Any]]) -> dict[str, int]:
    """Each state's largest output, in bytes, from a history."""
    sizes: dict[str, int] = {}
    for event in events:
        exited = event.get("stateExitedEventDetails") or {}
        if "output" in exited:
            size = len(exited["output"].encode())
            sizes[exited["name"]] = max(size, sizes.get(exited["name"], 0))
    return sizes


def test_the_group_is_read_in_pages_and_batches_at_1024_nodes(largest: Synth) -> None:
    """The wait for nodes of a 1,024-node cluster, run against 1,025 running instances (one
    Unhealthy, which the group is replacing) and 1,000 terminated ones EC2 still lists with
    their tags: the group's IDs come in pages of TAG_PAGE, each batch of 50 in a child
    execution keeps the InService, HEALTHY nodes and reads their addresses, and the attempt
    goes on with exactly the 1,024 healthy nodes' host list. Each raw answer stays under a
    third of a task's result, and so does every state's output, the children's included."""
    template = largest.templates["operations"]
    definition = machine_definition(template, placeholder_refs(template))
    fleet = _Fleet(NODES + 1, unhealthy=1, terminated=1000)
    answers: dict[str, list[int]] = {}
    cloud = _cloud(fleet, answers)
    status, events, children = run_against(cloud, _wait_for_nodes(definition), _attempt_input())
    assert status == "SUCCEEDED", [(e["type"], str(e)[-600:]) for e in events[-4:]]

    healthy = [i for i in fleet.running() if i.health == "Healthy"]
    ready = json.loads(_outputs(events)["NodesReady"])["Nodes"]
    assert sorted(ready["Hosts"].split(",")) == sorted(i.address for i in healthy)
    assert sorted(i for b in ready["Batches"] for i in b) == sorted(i.instance_id for i in healthy)
    assert [len(b) for b in ready["Batches"]] == [SEND_BATCH] * 20 + [24]

    # The calls: every tag page (2,025 instances: 5 pages of 500), a batch of 50 IDs each.
    tagged = len(fleet.instances)
    calls = Counter(cloud.calls)
    assert calls["ec2.DescribeTags"] == -(-tagged // TAG_PAGE) == 5 <= tag_pages(NODES)
    assert calls["autoscaling.DescribeAutoScalingInstances"] == -(-tagged // SEND_BATCH) == 41
    assert calls["ec2.DescribeNetworkInterfaces"] == 21  # the batches with a node InService
    assert max(max(a) for a in answers.values()) < PAYLOAD_SHARE * PAYLOAD_LIMIT, answers

    sizes = _sizes(events)
    child_sizes = Counter[str]()
    for history in children:
        for name, size in _sizes(history).items():
            child_sizes[name] = max(size, child_sizes[name])
    print(f"\nraw answers at {NODES} nodes (largest, bytes): "
          f"{ {k: max(v) for k, v in answers.items()} }\nlargest state outputs: {sizes}\n"
          f"largest child state outputs: {dict(child_sizes)}")  # fmt: skip
    assert max(sizes.values()) < PAYLOAD_SHARE * PAYLOAD_LIMIT, sizes
    assert max(child_sizes.values()) < PAYLOAD_SHARE * PAYLOAD_LIMIT, child_sizes
    # No event per node or per batch in the job's execution.
    assert len(events) < 100, len(events)


def _outputs(events: list[dict[str, Any]]) -> dict[str, str]:
    return {
        e["stateExitedEventDetails"]["name"]: e["stateExitedEventDetails"]["output"]
        for e in events
        if "stateExitedEventDetails" in e
    }


def test_a_group_short_of_a_node_is_not_a_full_set(largest: Synth) -> None:
    """1,024 running nodes, one of them Unhealthy: 1,023 is not a full set, and neither are
    nodes not yet InService (none at all: a group still launching)."""
    template = largest.templates["operations"]
    machine = _wait_for_nodes(machine_definition(template, placeholder_refs(template)))
    for fleet in (_Fleet(NODES, unhealthy=1), _Fleet(0, terminated=3)):
        status, events, _ = run_against(_cloud(fleet, {}), machine, _attempt_input())
        assert status == "FAILED" and events[-1]["executionFailedEventDetails"]["error"] == (
            "NotFullSet"
        )
        counted = json.loads(_outputs(events)["CountNodes"])["Group"]["Count"]
        assert counted == len(fleet.running()) - (1 if fleet.running() else 0)
