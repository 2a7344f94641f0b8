"""The stand-in's network interfaces are the synthesized launch template's, and the supervisor's
read of the nodes' addresses takes one interface a node from them.

EC2's guidance for types with several network cards puts an `efa-only` interface (no IP
address) at device index 0 of every card but the first (EC2 user guide, "Maximize network
bandwidth on accelerated instance types"; stacks/compute.py). DescribeNetworkInterfaces has no
filter on the network card (botocore's EC2 model, DescribeNetworkInterfaces Filters), so a
filter on device index 0 alone lists every card's interface: the supervisor would count each
trn1 node 8 times and never see a full set.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest

from scripts.rehearsal import ec2_shapes
from scripts.rehearsal.aws_stand_in import LocalCloud
from scripts.rehearsal.instances import Instance
from stacks.instance_types import CLUSTER_INSTANCE_TYPES, INSTANCE_TYPES
from stacks.supervisor_group import address_filters
from stacks.supervisor_limits import SEND_BATCH
from tests.cdk_support import only_resource, synth

#: A task's result before its ResultSelector: 262,144 bytes (Step Functions API reference,
#: TaskSucceededEventDetails.output).
TASK_RESULT = 262_144
#: What the supervisor read before: every interface at device index 0.
DEVICE_INDEX_ONLY = "attachment.device-index"


def _compute_interfaces(instance_type: str) -> list[dict[str, Any]]:
    spec = INSTANCE_TYPES[instance_type]
    synthesized = synth(
        instance_type=instance_type,
        node_count="2" if spec.supports_multi_node else "1",
        region=spec.regions[0],
    )
    template = only_resource(synthesized.templates["compute"], "AWS::EC2::LaunchTemplate")
    entries: list[dict[str, Any]] = template["Properties"]["LaunchTemplateData"][
        "NetworkInterfaces"
    ]
    return entries


@pytest.mark.parametrize(
    "instance_type",
    [
        pytest.param(t, marks=[] if t == "trn1.32xlarge" else [pytest.mark.slow])
        for t in CLUSTER_INSTANCE_TYPES
    ],
)
def test_the_stand_ins_interfaces_are_the_synthesized_launch_templates(instance_type: str) -> None:
    """Card, device index, type and description of every entry, as the whole compute stack
    synthesizes them (the security group is a reference there)."""

    def shape(entries: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in e.items() if k != "Groups"} for e in entries]

    assert shape(ec2_shapes.launch_template_interfaces(instance_type)) == shape(
        _compute_interfaces(instance_type)
    )


class _Nodes:
    def __init__(self, count: int) -> None:
        self.instances = [
            Instance(n, f"i-{n:017x}", f"172.{100 + n // 100}.{100 + n % 100}.200", Path("/"))
            for n in range(count)
        ]

    def running(self) -> list[Instance]:
        return self.instances


def _interfaces(instance_type: str, nodes: int, filters: list[dict[str, Any]]) -> Any:
    cloud = object.__new__(LocalCloud)
    cloud.cluster_name, cloud.instances = "trainium", _Nodes(nodes)  # type: ignore[assignment]
    with patch("scripts.rehearsal.aws_stand_in.INSTANCE_TYPE", instance_type):
        return cloud._ec2_DescribeNetworkInterfaces({"Filters": filters})["NetworkInterfaces"]


@pytest.mark.parametrize("instance_type", CLUSTER_INSTANCE_TYPES)
def test_the_address_read_takes_one_interface_a_node_with_its_address(instance_type: str) -> None:
    """A batch of 50 nodes: the supervisor's filters (stacks/supervisor_group.py) give 50
    interfaces, each node once with its address, in under a third of a task's result on every
    type, 16 network cards included; device index 0 alone gives one a network card, most
    without an address, as many IDs as cards per node and as many addresses as nodes."""
    ids = [f"i-{n:017x}" for n in range(SEND_BATCH)]
    found = _interfaces(instance_type, SEND_BATCH, address_filters(ids))
    assert [i["Attachment"]["InstanceId"] for i in found] == ids
    addresses = [i.get("PrivateIpAddress") for i in found]
    assert addresses == [i.address for i in _Nodes(SEND_BATCH).instances]
    size = len(json.dumps({"NetworkInterfaces": found}, default=str, separators=(",", ":")))
    assert size < TASK_RESULT / 3, size

    cards = len(ec2_shapes.launch_template_interfaces(instance_type))
    old = [f for f in address_filters(ids) if f["Name"] != "interface-type"]
    assert [f["Name"] for f in old] == ["attachment.instance-id", DEVICE_INDEX_ONLY]
    every = _interfaces(instance_type, SEND_BATCH, old)
    counts = Counter(i["Attachment"]["InstanceId"] for i in every)
    spec = INSTANCE_TYPES[instance_type]
    if spec.efa_only_interfaces:
        assert set(counts.values()) == {cards} and cards in (8, 16)
        assert len([i for i in every if "PrivateIpAddress" in i]) == SEND_BATCH
        assert all(i["PrivateIpAddresses"] == [] for i in every if i["InterfaceType"] == "efa-only")
    else:
        assert set(counts.values()) == {1}
    print(f"{instance_type}: {size} bytes for {SEND_BATCH} nodes; device index 0 alone lists "
          f"{len(every)} interfaces")  # fmt: skip


def test_every_stand_in_answer_is_checked_against_botocores_output_shape() -> None:
    """The stand-in's one hook for every answer (LocalCloud._answer) refuses, as botocore's
    Stubber refuses a response it is given (botocore/stub.py, ParamValidator on the output
    shape), a member the model does not have and a value of the wrong type."""
    from scripts.rehearsal.aws_stand_in import StandInAnswerError

    cloud = object.__new__(LocalCloud)
    cloud.cluster_name, cloud.instances = "trainium", _Nodes(2)  # type: ignore[assignment]
    cloud.calls, cloud.call_times, cloud._services = [], [], {}
    cloud._lock = threading.Lock()
    client = cloud.client("ec2")
    ids = [i.instance_id for i in cloud.instances.instances]
    found = client.describe_network_interfaces(Filters=address_filters(ids))
    assert len(found["NetworkInterfaces"]) == 2
    for wrong in ({"NetworkInterfaces": [{"NetworkCard": 0}]},
                  {"NetworkInterfaces": [{"Attachment": {"DeviceIndex": "0"}}]}):  # fmt: skip
        cloud._ec2_DescribeNetworkInterfaces = lambda params, wrong=wrong: wrong  # type: ignore[method-assign]
        with pytest.raises(StandInAnswerError, match="DescribeNetworkInterfaces"):
            client.describe_network_interfaces(Filters=address_filters(ids))
