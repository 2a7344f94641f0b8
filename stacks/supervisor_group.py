"""Reading the cluster's nodes at any size, for the job supervisor's wait for a full set.

No single answer about every node of a large group fits a task's result (at most 262,144
bytes before its ResultSelector runs: Step Functions API reference,
TaskSucceededEventDetails.output). DescribeAutoScalingGroups lists each instance in about 300
bytes (past the limit from about 860 nodes), DescribeInstances every network interface of a
node (about 10 KB a trn1.32xlarge), DescribeNetworkInterfaces about 1.2 KB a primary
interface (past it from about 200). So the supervisor reads the group in three narrow steps:

- the group's instance IDs from the tags Auto Scaling puts on them (EC2 DescribeTags, filters
  key aws:autoscaling:groupName and its value: one entry of about 165 bytes an instance, in
  pages of TAG_PAGE: "This value can be between 5 and 1000", EC2 API reference, DescribeTags
  MaxResults). A terminated instance keeps its tags for a while, so the list may hold
  instances that no longer run; the next step leaves them out;
- per batch of SEND_BATCH IDs, in a child execution of a Distributed Map (no history event
  per batch in the job's execution): which are InService and HEALTHY (Auto Scaling
  DescribeAutoScalingInstances: at most 50 IDs, "an ID that does not exist is ignored with no
  error"), and those nodes' private addresses from their primary interfaces
  (DescribeNetworkInterfaces, device index 0 and not efa-only: one interface a node, about
  60 KB a batch whatever the number of network cards);
- the batches' IDs and addresses, flattened by the map's ResultSelector (about 40 bytes a node:
  41 KB at 1,024).

tests/test_supervisor.py measures each raw answer at 1,024 nodes and runs these states in
moto's interpreter against the stand-in.
"""

from __future__ import annotations

from aws_cdk import aws_stepfunctions as sfn

from stacks.supervisor_limits import SEND_BATCH, TAG_PAGE
from stacks.supervisor_tasks import SupervisorTasks

#: Batches read at once: the Distributed Map's MaxConcurrency, which paces the calls of a
#: 1,024-node read (21 batches, 2 calls each) well under EC2's and Auto Scaling's request
#: rates (tests/test_supervisor.py).
READ_CONCURRENCY = 5
#: The tag Auto Scaling puts on every instance it launches (Amazon EC2 Auto Scaling user guide,
#: Tag Auto Scaling groups and instances).
GROUP_TAG = "aws:autoscaling:groupName"


def tag_filters(group_name: str) -> list[dict[str, object]]:
    """DescribeTags' filters for the group's instances: one entry per instance."""
    return [
        {"Name": "resource-type", "Values": ["instance"]},
        {"Name": "key", "Values": [GROUP_TAG]},
        {"Name": "value", "Values": [group_name]},
    ]


#: The types a node's primary interface has (network card 0, device index 0: stacks/compute.py's
#: launch template): `efa` on a type with EFA, `interface` (no InterfaceType) on one without.
#: Never `efa-only`: that is every other card's interface on trn1, trn1n and trn2, also at
#: device index 0 (on its own card) and with no IP address.
PRIMARY_INTERFACE_TYPES = ["efa", "interface"]


def address_filters(instance_ids: object) -> list[dict[str, object]]:
    """DescribeNetworkInterfaces' filters for the nodes' primary interfaces only: one entry,
    with the node's address, per node. Device index 0 alone matches every network card's
    interface (8 a trn1.32xlarge node, 16 a trn1n or trn2 one: each efa-only interface sits at
    device index 0 of its card), and EC2 has no filter on the network card (EC2 API
    reference, DescribeNetworkInterfaces, Filter.N); the interface type leaves out the
    efa-only ones."""
    return [
        {"Name": "attachment.instance-id", "Values": instance_ids},
        {"Name": "attachment.device-index", "Values": ["0"]},
        {"Name": "interface-type", "Values": PRIMARY_INTERFACE_TYPES},
    ]


def read_tags(t: SupervisorTasks, construct_id: str, *, next_token: bool) -> sfn.TaskStateBase:
    """One page of the group's instance IDs: {"Ids": [...], "Next": [token] or []}."""
    parameters: dict[str, object] = {
        "Filters": tag_filters(t.config.auto_scaling_group_name),
        "MaxResults": TAG_PAGE,
    }
    if next_token:
        parameters["NextToken"] = sfn.JsonPath.string_at("$.Group.Next[0]")
    return t.sdk(
        construct_id,
        "ec2",
        "describeTags",
        parameters,
        ["*"],
        iam_action="ec2:DescribeTags",
        result_selector={
            "Ids": sfn.JsonPath.list_at("$.Tags[*].ResourceId"),
            # An indefinite path: [] on the last page, [token] before it.
            "Next": sfn.JsonPath.list_at("$..NextToken"),
        },
        result_path="$.Group" if not next_token else "$.Page",
    )


def read_batches(t: SupervisorTasks) -> sfn.DistributedMap:
    """For each batch of $.Group.Batches, the IDs and addresses of its nodes that are
    InService and HEALTHY; $.Group gets them all, {"Ids": [...], "Addresses": [...]}."""
    lifecycle = t.in_service("ReadBatchNodes", "InService", "", "$")
    # InService means the node's bootstrap completed the launch lifecycle hook (contract C2);
    # HEALTHY, that nothing asked the group to replace it (this API's spelling).
    healthy = sfn.Pass(
        t.scope,
        "SelectBatchHealthy",
        parameters={
            "Ids": sfn.JsonPath.list_at("$.InService[?(@.HealthStatus == 'HEALTHY')].InstanceId")
        },
    )
    any_ready = sfn.Choice(t.scope, "AnyBatchNodeReady")
    interfaces = "$.NetworkInterfaces[*]"
    addresses = t.sdk(
        "ReadBatchAddresses",
        "ec2",
        "describeNetworkInterfaces",
        {"Filters": address_filters(sfn.JsonPath.list_at("$.Ids"))},
        ["*"],
        iam_action="ec2:DescribeNetworkInterfaces",
        result_selector={
            "Ids": sfn.JsonPath.list_at(f"{interfaces}.Attachment.InstanceId"),
            "Addresses": sfn.JsonPath.list_at(f"{interfaces}.PrivateIpAddress"),
        },
        result_path="$",
    )
    none_ready = sfn.Pass(
        t.scope,
        "NoBatchNodeReady",
        result=sfn.Result.from_object({"Ids": [], "Addresses": []}),
    )
    lifecycle.next(healthy).next(any_ready)
    any_ready.when(sfn.Condition.is_present("$.Ids[0]"), addresses).otherwise(none_ready)
    batches = sfn.DistributedMap(
        t.scope,
        "ReadNodes",
        comment=f"The group's nodes that are InService and HEALTHY, and their addresses: a "
        f"batch of {SEND_BATCH} IDs in each child execution.",
        # Standard children, as the other two maps': each keeps a history an operator can read,
        # and the rehearsal's interpreter (moto) runs no express ones.
        map_execution_type=sfn.StateMachineType.STANDARD,
        max_concurrency=READ_CONCURRENCY,
        items_path="$.Group.Batches",
        item_selector={"InstanceIds": sfn.JsonPath.list_at("$$.Map.Item.Value")},
        result_selector={
            "Ids": sfn.JsonPath.list_at("$[*].Ids[*]"),
            "Addresses": sfn.JsonPath.list_at("$[*].Addresses[*]"),
        },
        result_path="$.Group",
    )
    batches.item_processor(lifecycle)
    return batches
